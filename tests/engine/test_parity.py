"""tandem's Transformer gives transformers' logits, position by position, for every supported family
and geometry, through chunked prefill and single-token decode into the KV cache."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.cli.tiny import TOKENIZER_SIZE, tiny_config, write_tiny_model
from engine.files.weights import open_model
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache, model_cache
from engine.model.transformer import Transformer

TOLERANCE = 1e-4  # max abs logit difference in f32
PROMPT_LEN, CHUNK, DECODE_STEPS = 40, 16, 32
MAX_POSITIONS = PROMPT_LEN + DECODE_STEPS


@dataclass(frozen=True)
class Case:
    config: dict
    # Write RoPE the transformers 4 way (rope_theta + rope_scaling with "type"), as older
    # checkpoints on disk still do, instead of transformers 5's rope_parameters.
    legacy_rope: bool = False


# The scaled cases set a short pretraining context so that, within MAX_POSITIONS, the scaling
# moves most frequencies: with a long one, llama3 and yarn leave every angle used here unchanged.
# yarn's context is factor x the original, as transformers expects (it warns otherwise).
ROPE_CASES = {
    "rope_linear_legacy_keys": Case(tiny_config("llama", rope_scaling={"type": "linear", "factor": 2.0}),
                                    legacy_rope=True),
    "rope_llama3": Case(tiny_config("llama3")),
    "rope_yarn": Case(tiny_config("llama", max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
}
CASES = {
    **{name: Case(tiny_config(name)) for name in ("llama", "qwen2", "qwen3", "mistral", "hd160", "explicit_hd",
                                                  "qwen3_5", "qwen4_exp")},
    "gqa_16_heads_8_kv": Case(tiny_config("llama", hidden_size=256, num_attention_heads=16, num_key_value_heads=8)),
    **ROPE_CASES,
}


def use_legacy_rope_keys(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **{k: v for k, v in rope.items() if k != "type"}}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These matrices are too small to gain from a second thread, and on a shared machine every
    # parallel region then waits for the other core: measured 50-100x slower under load.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class Reference:
    path: Path
    tokens: list[int]  # the prompt, then transformers' own greedy continuation
    logits: torch.Tensor  # [len(tokens), vocab]: transformers' logits over the whole sequence at once


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """reference(name) writes the tiny model once and runs transformers on it once."""
    from transformers import AutoModelForCausalLM

    @functools.cache
    def make(name: str) -> Reference:
        case = CASES[name]
        path = write_tiny_model(case.config, tmp_path_factory.mktemp(name))
        if case.legacy_rope:
            use_legacy_rope_keys(path)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
        return Reference(path, *greedy_reference(hf, TOKENIZER_SIZE))

    return make


def greedy_reference(hf, vocab: int) -> tuple[list[int], torch.Tensor]:
    """A seeded random prompt of ids below `vocab`, then transformers' greedy continuation of
    DECODE_STEPS tokens; and its logits over the whole sequence at once, [len(tokens), vocab]."""
    prompt = torch.randint(0, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # min_new_tokens keeps the end-of-sequence token from stopping the continuation early.
        tokens = hf.generate(prompt, max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS, do_sample=False,
                             pad_token_id=hf.config.eos_token_id)
        return tokens[0].tolist(), hf(tokens).logits[0]


def load_engine_model(path: Path) -> Transformer:
    files = open_model(path)
    return Transformer(files.config, files.load_tensors(), dtype="f32", max_positions=MAX_POSITIONS)


def new_cache(model: Transformer, slots: int, steps: int = 1) -> KVCache:
    """steps: positions whose recurrent state a slot keeps (a model with linear-attention layers)."""
    return model_cache(model.config, model.specs, slots, MAX_POSITIONS, steps)


def step(model: Transformer, cache: KVCache, rows: list[Row]) -> list[torch.Tensor]:
    """One forward pass; each row's logits, [len(row.tokens), vocab]."""
    logits = model.logits(model(ForwardBatch.build(rows), cache))
    return list(logits.split([len(r.tokens) for r in rows]))


def engine_logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Prefill the prompt in CHUNK-token rows into one slot, then decode the rest one token a step."""
    cache = new_cache(model, slots=1)
    starts = [*range(0, PROMPT_LEN, CHUNK), *range(PROMPT_LEN, len(tokens))]
    ends = starts[1:] + [len(tokens)]
    return torch.cat([step(model, cache, [Row(0, s, tokens[s:e])])[0] for s, e in zip(starts, ends)])


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (got - expected).abs()
    worst = int(diff.amax(-1).argmax())
    assert diff.max() <= TOLERANCE, f"max abs logit difference {diff.max():.3g} at position {worst} (> {TOLERANCE})"


@pytest.mark.parametrize("name", [n for n in CASES if n not in ROPE_CASES])
def test_chunked_prefill_then_decode_matches_transformers(reference, name):
    ref = reference(name)
    assert_matches(engine_logits(load_engine_model(ref.path), ref.tokens), ref.logits)


@pytest.mark.parametrize("name", ROPE_CASES)
def test_rope_scaling_matches_transformers(reference, name):
    ref, unscaled = reference(name), reference("llama")
    # Same seed and shapes, so only RoPE differs: this shows the scaling changes the logits far
    # beyond the tolerance, so the parity below really checks the scaled frequencies.
    assert (ref.logits[:PROMPT_LEN] - unscaled.logits[:PROMPT_LEN]).abs().max() > 10 * TOLERANCE
    assert_matches(engine_logits(load_engine_model(ref.path), ref.tokens), ref.logits)


def test_two_slots_in_one_batch_equal_each_alone(reference):
    ref = reference("qwen2")
    model = load_engine_model(ref.path)
    a, b = ref.tokens[:27], ref.tokens[40:53]
    # Per slot, its row in each of three steps: prefill; a decode beside a prefill chunk; decode.
    plans = [
        [Row(0, 0, a[:25]), Row(0, 25, a[25:26]), Row(0, 26, a[26:27])],
        [Row(1, 0, b[:9]), Row(1, 9, b[9:12]), Row(1, 12, b[12:13])],
    ]
    cache = new_cache(model, slots=2)
    together = [step(model, cache, [plans[0][i], plans[1][i]]) for i in range(3)]
    for slot, plan in enumerate(plans):
        alone_cache = new_cache(model, slots=1)
        for i, row in enumerate(plan):
            alone = step(model, alone_cache, [Row(0, row.start, row.tokens)])[0]
            assert_matches(together[i][slot], alone)
