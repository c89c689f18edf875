"""Tokenizer and chat template, from an HF directory or from GGUF metadata (via transformers)."""
from __future__ import annotations

import functools
import logging
import shutil
from pathlib import Path

from engine.errors import ConfigError
from engine.files.disk_cache import cache_path, partial_path
from engine.files.weights import ModelFiles


# GGUF architectures transformers cannot make a config of, with the tokenizer class their family
# uses: their vocabulary is read by that class directly (the tokenizer.ggml.* keys are the same).
GGUF_TOKENIZERS = {"qwen4_exp": "Qwen2TokenizerFast"}


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(path: Path, gguf: bool, mtime_ns: int, family: str = ""):
    """transformers' tokenizer for a model, made once per process and file version: converting a
    GGUF vocabulary parses the whole file's metadata, seconds each time, and an engine reloaded in
    the same process (tests, the bench) would pay it again. Shared: nothing here mutates it."""
    import transformers
    from transformers import AutoTokenizer
    # transformers logs at length while it converts a GGUF vocabulary; none of it is actionable.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if not gguf:
        return AutoTokenizer.from_pretrained(str(path))
    # The conversion took 4.8 s of every server start on the default model, loading its result 1.5 s:
    # it is saved once per file version (and transformers version) and loaded from there after.
    saved = cache_path("tokenizers", path, transformers.__version__)
    if (saved / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    kind = getattr(transformers, GGUF_TOKENIZERS[family]) if family in GGUF_TOKENIZERS else AutoTokenizer
    hf = kind.from_pretrained(str(path.parent), gguf_file=path.name)
    partial = partial_path(saved)
    try:
        hf.save_pretrained(str(partial))
        partial.rename(saved)
    except OSError:  # a read-only home, or another process renamed its copy first
        shutil.rmtree(partial, ignore_errors=True)
    return hf


class Tokenizer:
    def __init__(self, hf_tokenizer, chat_template: str | None = None):
        self.hf = hf_tokenizer
        self.chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None)

    @classmethod
    def load(cls, files: ModelFiles, chat_template_file: str | Path | None = None) -> "Tokenizer":
        hf = _hf_tokenizer(files.path, files.format == "gguf", files.path.stat().st_mtime_ns, files.config.family)
        template = None
        if chat_template_file is not None:
            path = Path(chat_template_file)
            if not path.is_file():
                raise ConfigError(f"chat_template={str(path)!r}: file does not exist")
            template = path.read_text()
        tok = cls(hf, template)
        if tok.vocab_size > files.config.vocab_size:
            raise ConfigError(f"tokenizer vocabulary={tok.vocab_size}: larger than the embedding "
                              f"(vocab_size={files.config.vocab_size})")
        return tok

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ConfigError("chat_template: the model has none; pass --chat-template FILE")
        return self.hf.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting a UTF-8 character:
    text is released only once the tokens so far decode without a replacement character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[:prefix] are fully released
        self.read = 0  # ids[:read] produced text that was released

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""
