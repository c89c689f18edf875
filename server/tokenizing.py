"""Text to token ids for the HTTP handlers, without stalling the event loop.

A prompt that cannot fit a slot is refused from its size alone, before any of it is tokenized:
no token stands for more bytes of text than the longest vocabulary entry's UTF-8 bytes (a
byte-level BPE entry spells each byte with a character of one or two bytes, a SentencePiece entry
spells a space as the three-byte "▁", a byte-fallback entry "<0x0A>" spells one byte with six),
so a text of more than slot context x that many bytes needs more tokens than the slot holds.
(A normalizer that shrinks text, as NFKC does with full-width letters, would break that bound;
the tokenizers tandem loads do not normalize so.) A 6 MB prompt is refused in milliseconds instead
of being tokenized for seconds into millions of tokens.

The rest is tokenized in a worker thread. transformers' `encode` runs the fast tokenizer's batch
encoding, which releases the GIL while Rust works, so other streams keep flowing meanwhile."""
from __future__ import annotations

import asyncio

from engine import Tokenizer
from server.protocol import APIError


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, ctx: int):
        self.tokenizer, self.ctx = tokenizer, ctx
        self.max_token_bytes = max(len(piece.encode("utf-8")) for piece in tokenizer.hf.get_vocab())

    @property
    def max_prompt_bytes(self) -> int:
        """Text longer than this cannot fit one slot, whatever its tokens."""
        return self.ctx * self.max_token_bytes

    async def prompt_ids(self, text: str) -> list[int]:
        """The ids of a prompt that may fit a slot (prepare() checks that it does); raises a 400 for
        one that cannot."""
        bound = self.max_prompt_bytes
        # Characters never outnumber UTF-8 bytes: a text with more characters than the bound is
        # refused without encoding it.
        size, unit = len(text), "characters"
        if size <= bound:
            size, unit = len(text.encode("utf-8")), "bytes"
        if size > bound:
            raise APIError(400, f"prompt: {size} {unit} of text cannot fit the slot context of {self.ctx} tokens "
                                f"(no token spells more than {self.max_token_bytes} bytes)")
        return await asyncio.to_thread(self.tokenizer.encode, text)

    async def ids(self, text: str, add_special: bool) -> list[int]:
        """Any text's ids (/tokenize): no slot to fit, so no bound; off the event loop all the same."""
        return await asyncio.to_thread(self.tokenizer.hf.encode, text, add_special_tokens=add_special)
