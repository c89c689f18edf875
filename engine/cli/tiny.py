"""Tiny random models: a servable HF directory (config, seeded weights, tokenizer) from a small config.

Tests and local runs use these instead of downloads. transformers completes the config and names
the tensors, so a tiny model is exactly what transformers itself would save for that architecture,
and the engine is checked against the real layout rather than against its own idea of it.

    python -m engine.cli.tiny --config configs/tiny/llama.json --out /tmp/tiny-llama [--seed N]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine.errors import ConfigError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Ids follow the 256 byte tokens, in SPECIAL_TOKENS order.
BOS_ID, EOS_ID = 256 + SPECIAL_TOKENS.index("<|im_start|>"), 256 + SPECIAL_TOKENS.index("<|im_end|>")
TOKENIZER_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The repository's small configs (llama, qwen2, mistral, ...), that tests and bench tools build from.
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tiny"

WEIGHT_STD = 0.02
NORM_NOISE = 0.1  # norms are 1 + noise, so a norm applied to the wrong axis or skipped shows up
# A linear-attention layer's decay parameters and convolution, which transformers initialises to
# fixed values, drawn wide enough that a decay or a tap applied wrongly shows up.
WIDE = {"A_log": 1.0, "dt_bias": 1.0, "conv1d.weight": 0.5}


def tiny_config(name: str = "llama", **overrides) -> dict:
    """configs/tiny/<name>.json with `overrides` applied."""
    return {**json.loads((CONFIGS / f"{name}.json").read_text()), **overrides}


def hf_config(config: dict) -> PretrainedConfig:
    """transformers' complete config for `config`, with the tiny tokenizer's special-token ids."""
    if config.get("vocab_size", 0) < TOKENIZER_SIZE:
        raise ConfigError(f"vocab_size={config.get('vocab_size')}: must be >= the tiny tokenizer's {TOKENIZER_SIZE} tokens")
    hf = AutoConfig.for_model(**{**config, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "dtype": "float32"})
    hf.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf.model_type]]
    return hf


def tensor_shapes(hf: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors transformers saves for this config (a tied head left out),
    and of the model's own MTP layers where the config asks for them (`mtp_num_hidden_layers`:
    transformers drops `mtp.*` on load, but checkpoints carry them, as Qwen3.5's do)."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = AutoModelForCausalLM.from_config(hf)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if hf.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return {**shapes, **mtp_shapes(hf, shapes)}


def mtp_shapes(hf: PretrainedConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's MTP layers: each a full-attention decoder layer (shaped as the trunk's first one),
    and the projection and norms they share."""
    layers = getattr(hf, "mtp_num_hidden_layers", 0) or 0
    if not layers:
        return {}
    h = hf.hidden_size
    attention = hf.layer_types.index("full_attention")
    prefix = f"model.layers.{attention}."
    out = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
           "mtp.norm.weight": (h,)}
    for k in range(layers):
        out.update({f"mtp.layers.{k}.{n[len(prefix):]}": s for n, s in shapes.items() if n.startswith(prefix)})
    return out


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):  # a fixed order, so a seed always gives the same weights
        noise = torch.randn(shapes[name], generator=generator)
        wide = next((std for suffix, std in WIDE.items() if name.endswith(suffix)), None)
        if wide is not None:
            out[name] = wide * noise
        elif name.endswith("norm.weight"):
            out[name] = 1.0 + NORM_NOISE * noise
        else:
            out[name] = WEIGHT_STD * noise
    if "mtp.fc.weight" in out:
        # The MTP layer's projection passes the token's embedding on (plus noise): its drafts repeat
        # the token they read, which a random model's greedy loops make right often enough that
        # verification keeps drafts and rejects others.
        h = out["mtp.fc.weight"].shape[0]
        out["mtp.fc.weight"][:, :h] += torch.eye(h)
    return out


def write_tokenizer(out: Path) -> None:
    """Byte-level BPE over the 256 bytes with no merges: every byte is one token, nothing trained."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
    }, indent=2))


def write_tiny_model(config: dict, out: Path, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors and the tokenizer into `out`; returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_config(config)
    if hf.model_type in SAVED_BY_TRANSFORMERS:
        save_randomised(hf, out, seed)
    else:
        save_file(random_tensors(tensor_shapes(hf), seed), str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf.to_dict(), indent=2, sort_keys=True))
    write_tokenizer(out)
    return out


# Models whose checkpoint layout differs from their modules' (per-expert tensors, sharded n-gram
# tables, int64 hash constants): transformers' own save_pretrained writes them.
SAVED_BY_TRANSFORMERS = ("qwen4_exp_text",)


def save_randomised(hf: PretrainedConfig, out: Path, seed: int) -> None:
    """transformers' model for `hf` with every floating parameter drawn as random_tensors draws it
    (the zero-initialised ones included), saved by save_pretrained; buffers (the hash constants)
    keep the values transformers computes."""
    model = AutoModelForCausalLM.from_config(hf)
    params = dict(model.named_parameters())
    drawn = random_tensors({name: tuple(p.shape) for name, p in params.items()}, seed)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(drawn[name])
    model.save_pretrained(out)
    layers = getattr(hf, "mtp_num_hidden_layers", 0) or 0
    if layers:  # transformers has no MTP module for it: its tensors are added to the file as checkpoints hold them
        file = out / "model.safetensors"
        saved = load_file(str(file))
        mtp = random_tensors(qwen4_exp_mtp_shapes(hf, {n: tuple(t.shape) for n, t in saved.items()}, layers), seed)
        h = hf.hidden_size
        mtp["mtp.fc_embedding.weight"] += torch.eye(h)  # as Qwen3.5's: drafts that repeat their token
        save_file({**saved, **mtp}, str(file), metadata={"format": "pt"})


def qwen4_exp_mtp_shapes(hf: PretrainedConfig, shapes: dict[str, tuple[int, ...]], layers: int) -> dict:
    """Qwen4-Exp's MTP layers as its checkpoints hold them: each an attention layer shaped as the
    trunk's first one (its indexer included), its experts merged in two tensors; the projections of
    the embedding and of each residual stream, their norms, and a stream mixer of its own."""
    h, wide = hf.hidden_size, hf.hidden_size * hf.hc_count
    attention = hf.layer_types.index("indexed_attention")
    prefix = f"model.layers.{attention}."
    out = {"mtp.fc_embedding.weight": (h, h), "mtp.fc_hidden.weight": (h, h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (wide,)}
    out.update({"mtp." + n[len("model."):]: s for n, s in shapes.items() if n.startswith("model.hyper_connection_mixer.")})
    e, width = hf.num_experts, hf.moe_intermediate_size
    for k in range(layers):
        own = {n[len(prefix):]: s for n, s in shapes.items() if n.startswith(prefix) and ".experts." not in n}
        out.update({f"mtp.layers.{k}.{n}": s for n, s in own.items()})
        out[f"mtp.layers.{k}.mlp.experts.gate_up_proj"] = (e, 2 * width, h)
        out[f"mtp.layers.{k}.mlp.experts.down_proj"] = (e, h, width)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="small HF-style config (JSON)")
    parser.add_argument("--out", required=True, type=Path, help="model directory to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write_tiny_model(json.loads(args.config.read_text()), args.out, args.seed)
    print(path)


if __name__ == "__main__":
    main()
