"""The hybrid families (Qwen3.5: Gated DeltaNet layers beside gated attention; Qwen4-Exp: the same
with experts, residual streams, n-gram embeddings and its QSA indexer, tests/engine/test_qwen4_exp.py)
give transformers' logits through every path a served request takes: a whole prompt, prompt chunks
computed in chunks or token by token, decode, a verify block whose rejected drafts are rolled back,
slots side by side, and a prefix resumed from a snapshot of its recurrent state. The tiny
checkpoints randomise every parameter, the (1 + w) norms' offsets, the decay parameters and the
convolutions included (engine/cli/tiny.py)."""
from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.model.batch import Row
from tests.engine.test_parity import (PROMPT_LEN, assert_matches, load_engine_model, new_cache, one_thread,  # noqa: F401
                                      reference, step)

STEPS = 4  # states a slot keeps: a decode row and three drafts, as with --spec-draft-n-max 3


@pytest.fixture(scope="module", params=["qwen3_5", "qwen4_exp"])
def qwen(reference, request):
    ref = reference(request.param)
    return ref, load_engine_model(ref.path)


def run(model, rows_per_step: list[list[Row]], slots: int = 1) -> list[list[torch.Tensor]]:
    cache = new_cache(model, slots, STEPS)
    return [step(model, cache, rows) for rows in rows_per_step]


def test_the_model_has_both_layer_kinds(qwen):
    _, model = qwen
    assert [spec.kind for spec in model.specs] == ["recurrent", "qsa" if model.config.indexer else "dense"] * 2


def test_a_whole_prompt_matches_transformers(qwen):
    ref, model = qwen
    (logits,), = run(model, [[Row(0, 0, ref.tokens)]])
    assert_matches(logits, ref.logits)


def test_short_prompt_chunks_run_token_by_token_and_match(qwen):
    # Chunks of at most STEPS tokens keep every position's state (the verify path); longer ones
    # are computed in chunks of 64. Both continue the same recurrence.
    ref, model = qwen
    bounds = [0, 3, 7, 30, 31, 35, len(ref.tokens)]
    out = run(model, [[Row(0, a, ref.tokens[a:b])] for a, b in zip(bounds, bounds[1:])])
    assert_matches(torch.cat([rows[0] for rows in out]), ref.logits)


def test_a_rejected_verify_suffix_leaves_the_state_as_if_only_the_kept_tokens_ran(qwen):
    ref, model = qwen
    tokens, n = ref.tokens, PROMPT_LEN + 2  # the row completes a QSA block (of 4) with a wrong token
    cache = new_cache(model, 1, STEPS)
    prefill = step(model, cache, [Row(0, 0, tokens[:n])])[0]
    # The last sampled token and three drafts, of which the first is right and two are wrong.
    wrong = [(tokens[n + 2] + 1) % 256, (tokens[n + 3] + 7) % 256]
    verify = step(model, cache, [Row(0, n, [tokens[n], tokens[n + 1], *wrong])])[0]
    cache.truncate(0, n + 2)  # what the scheduler commits: the kept tokens' positions
    rest = [step(model, cache, [Row(0, p, [tokens[p]])])[0] for p in range(n + 2, len(tokens))]
    assert_matches(torch.cat([prefill, verify[:2], *rest]), ref.logits)
    # The rejected positions' outputs really differ: the state after them was not the kept one.
    assert (verify[3] - ref.logits[n + 3]).abs().max() > 1e-2


def test_two_slots_in_one_step_equal_each_alone(qwen):
    ref, model = qwen
    a, b = ref.tokens[:30], ref.tokens[10:41]
    plans = [[Row(0, 0, a[:26]), Row(0, 26, a[26:29]), Row(0, 29, a[29:30])],
             [Row(1, 0, b[:9]), Row(1, 9, b[9:30]), Row(1, 30, b[30:31])]]
    together = run(model, [[plans[0][i], plans[1][i]] for i in range(3)], slots=2)
    for slot, plan in enumerate(plans):
        alone = run(model, [[Row(0, row.start, row.tokens)] for row in plan])
        for i in range(3):
            assert_matches(together[i][slot], alone[i][0])


def test_a_prefix_resumes_from_its_snapshot(qwen):
    ref, model = qwen
    tokens, n = ref.tokens, PROMPT_LEN
    cache = new_cache(model, 1, STEPS)
    step(model, cache, [Row(0, 0, tokens[:n])])
    cache.checkpoint(0, n)  # where the prompt ended
    for p in range(n, n + 8):  # an answer, then another request that shares only the prompt
        step(model, cache, [Row(0, p, [tokens[p]])])
    # The slot keeps the states after its last STEPS positions (n+4 .. n+7) and the snapshot.
    assert (cache.reusable(0, n + 3), cache.reusable(0, n + 6)) == (n, n + 6)
    cache.truncate(0, n)
    resumed = step(model, cache, [Row(0, n, tokens[n:n + 12])])[0]
    assert_matches(resumed, ref.logits[n:n + 12])


def test_a_long_row_keeps_the_states_after_its_last_two_positions_only(qwen):
    # Computed in chunks, the last token alone: a draft model that caught up through a sampled
    # token goes on from the position before it.
    ref, model = qwen
    cache = new_cache(model, 1, STEPS)
    step(model, cache, [Row(0, 0, ref.tokens[:PROMPT_LEN])])
    assert [cache.reusable(0, n) for n in (PROMPT_LEN, PROMPT_LEN - 1, PROMPT_LEN - 2)] == \
        [PROMPT_LEN, PROMPT_LEN - 1, 0]
    cache.truncate(0, PROMPT_LEN - 1)
    again = step(model, cache, [Row(0, PROMPT_LEN - 1, ref.tokens[PROMPT_LEN - 1:PROMPT_LEN + 3])])[0]
    assert_matches(again, ref.logits[PROMPT_LEN - 1:PROMPT_LEN + 3])


@pytest.mark.parametrize("override, message", [
    ({"compress_ratios": [4, 0, 0, 0, 0], "qsa_budget": 8},
     "compress_ratios[0]=4: layer 0 is a linear_attention (recurrent) layer; only attention layers take a compress "
     "ratio"),
    ({"layer_types": ["linear_attention", "full_attention"]},
     "layer_types has 2 entries: needs one per trunk layer (4)"),
    ({"linear_num_key_heads": 3},
     "linear_num_key_heads=3: must divide linear_num_value_heads=4"),
])
def test_bad_qwen3_5_geometry_is_refused_naming_the_field(tmp_path, override, message):
    from engine.cli.tiny import tiny_config
    from engine.files.config_readers import from_hf_dict
    with pytest.raises(ConfigError) as e:
        from_hf_dict({**tiny_config("qwen3_5"), **override})
    assert str(e.value) == message
