"""Per-request speculation limits (llama-server's `speculative.n_max`, `n_min`, `p_min`) and the
combined drafter draft-mtp-ngram: greedy output stays the target's whatever the limits or the
drafter, drafts keep the request's limits, and a sampled draft keeps the target's distribution."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from engine.engine import Engine
from engine.errors import ConfigError
from engine.files.weights import open_model
from engine.model import mtp
from engine.model.batch import ForwardBatch, Row
from engine.sched.request import Request
from engine.sched.sampling import SamplingParams, distribution, make_generator
from engine.settings import DraftLimits, EngineConfig, SpecConfig
from engine.spec.acceptance import verify
from engine.spec.drafter import Span
from tests.engine.test_mtp import save_draft

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Repeats itself, so the n-gram lookup offers a continuation at nearly every step.
PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def draft(tiny_model, tmp_path_factory):
    """An untrained MTP draft for the tiny model: its top-1 probability is near 1/64 (a 64-token
    subset), far below any useful p_min."""
    files = open_model(tiny_model)
    tensors = files.load_tensors()
    fingerprint = mtp.target_fingerprint(files.config, tensors["model.embed_tokens.weight"])
    path = tmp_path_factory.mktemp("tiny-draft") / "draft.safetensors"
    save_draft(path, files.config, tensors, fingerprint)
    return path


def engine_with(tiny_model, spec: SpecConfig | None) -> Engine:
    return Engine.load(EngineConfig(model=str(tiny_model), ctx_size=512, spec=spec))


@pytest.fixture(scope="module")
def plain(tiny_model):
    return engine_with(tiny_model, None)


def spec_of(kind: str, draft, p_min: float) -> SpecConfig:
    return SpecConfig(pacing=False, type=kind, draft_model=None if kind == "ngram-simple" else str(draft), n_max=3, p_min=p_min,
                      ngram_n=2)


def run(engine: Engine, ids: list[int], params: SamplingParams, limits: DraftLimits | None = None):
    """(tokens, the finished request, the length of each draft the request got)."""
    out, drafts = [], []
    req = engine.submit(ids, params, lambda o: out.extend(o.token_ids), cache_prompt=False, draft_limits=limits)
    while req.finish_reason is None:
        engine.step()
        drafts.append(len(req.draft.tokens))
    return out, req, drafts


LIMITS = {"server's": {}, "n_max 0": {"n_max": 0}, "n_max 1": {"n_max": 1}, "n_min 2": {"n_min": 2},
          "p_min 0": {"p_min": 0.0}, "p_min 1": {"p_min": 1.0}}


@pytest.mark.parametrize("kind", ["ngram-simple", "draft-mtp", "draft-mtp-ngram"])
def test_greedy_output_is_the_targets_whatever_the_request_limits(tiny_model, draft, plain, kind):
    engine = engine_with(tiny_model, spec_of(kind, draft, p_min=0.5))
    ids = plain.tokenizer.encode(PROMPT)
    expected, _, _ = run(plain, ids, GREEDY)
    for name, given in LIMITS.items():
        limits = engine.config.spec.request_limits(**given)
        tokens, req, drafts = run(engine, ids, GREEDY, limits)
        assert tokens == expected, name
        assert max(drafts) <= limits.n_max and all(n == 0 or n >= limits.n_min for n in drafts), name
        if limits.n_max == 0:
            assert req.draft_n == 0 and req.timings().draft_n == 0, name


def test_n_max_1_drafts_one_token_a_step_and_n_max_0_none(tiny_model, draft, plain):
    # p_min 0: the MTP draft drafts as deep as it may at every step.
    engine = engine_with(tiny_model, spec_of("draft-mtp", draft, p_min=0.0))
    ids = plain.tokenizer.encode(PROMPT)
    _, req, drafts = run(engine, ids, GREEDY, engine.config.spec.request_limits(n_max=1))
    assert set(drafts) == {0, 1} and req.draft_n > 0
    _, req, drafts = run(engine, ids, GREEDY)
    assert max(drafts) == 3, "the server's n_max: a request without limits drafts up to 3"
    _, req, drafts = run(engine, ids, GREEDY, engine.config.spec.request_limits(n_max=0))
    assert set(drafts) == {0} and req.draft_n == req.draft_n_accepted == 0


def test_request_limits_are_checked_against_the_servers():
    spec = SpecConfig(pacing=False, type="ngram-simple", n_max=3, n_min=2, p_min=0.5)
    assert spec.request_limits() == DraftLimits(3, 2, 0.5)
    # The server's n_min shrinks to a smaller n_max, as llama-server clamps it; a given one must fit.
    assert spec.request_limits(n_max=1) == DraftLimits(1, 1, 0.5)
    assert spec.request_limits(n_max=0, p_min=0.9) == DraftLimits(0, 0, 0.9)
    with pytest.raises(ConfigError, match=r"speculative.n_max=4: must be <= the server's --spec-draft-n-max=3"):
        spec.request_limits(n_max=4)
    with pytest.raises(ConfigError, match=r"speculative.n_min=3: must be in 0..speculative.n_max=2"):
        spec.request_limits(n_max=2, n_min=3)


@pytest.mark.parametrize("p_min", [0.5, 0.0])
def test_combined_drafter_takes_the_lookup_where_the_mtp_draft_agrees_or_is_unsure(tiny_model, draft, plain, p_min):
    engine = engine_with(tiny_model, spec_of("draft-mtp-ngram", draft, p_min))
    ids = plain.tokenizer.encode(PROMPT)
    expected, _, _ = run(plain, ids, GREEDY)
    tokens, req, drafts = run(engine, ids, GREEDY)
    assert tokens == expected and req.draft_n > 0
    lookups, steps = engine.drafter.lookup_drafts, sum(n > 0 for n in drafts)
    if p_min:
        # The untrained draft's top-1 is far below 0.5, where draft-mtp alone drafts nothing: every
        # draft was the lookup's.
        assert lookups == steps
    else:
        # Never unsure, the MTP draft leaves the lookup only its own top-1 and drafts deeper elsewhere.
        assert steps > lookups


DRAWS = 4000
TOP_K = 8  # the target's support: few enough tokens that the draws test each one


def history_with_a_lookup(engine: Engine, params: SamplingParams) -> tuple[list[int], int]:
    """A history whose last 2 tokens occurred once before, followed by a token y the target may
    emit next (y is in its top-k there), so the lookup's one-hot draft is sometimes accepted."""
    body = torch.randperm(300, generator=torch.Generator().manual_seed(3))[:20].add(10).tolist()
    y = 0
    for _ in range(4):  # y changes the target's distribution a little: settle on one it keeps
        history = body + [y] + body
        p = distribution(target_pass(engine, history)[1][0], params)
        if p[y] > 0:
            return history, y
        y = int(p.argmax())
    raise AssertionError("no token the target keeps after its own history")


def target_pass(engine: Engine, history: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden states over `history` (in slot 0) and its logits [1, vocab] after it."""
    model = engine.model
    with torch.inference_mode():
        hidden = model(ForwardBatch.build([Row(0, 0, history)]), engine.cache)
        return hidden, model.logits(hidden[-1:])


@pytest.mark.parametrize("kind, p_min, branch", [("ngram-simple", 0.5, "lookup"), ("draft-mtp", 0.0, "mtp"),
                                                 ("draft-mtp-ngram", 1.0, "lookup"), ("draft-mtp-ngram", 0.0, "mtp"),
                                                 ("draft-mtp", 0.0, "tree")])
def test_sampled_drafts_keep_the_target_distribution(tiny_model, draft, kind, p_min, branch):
    """Each drafter's first emitted token, drafted and verified DRAWS times after one history,
    follows the target's distribution (chi-square), with the lookup's one-hot q or the MTP draft's,
    and for a tree with two siblings beside the drafted token."""
    spec = spec_of(kind, draft, p_min)
    if branch == "tree":
        spec = dataclasses.replace(spec, width=3, p_sibling=0.0)
    engine = engine_with(tiny_model, spec)
    params = SamplingParams(temperature=0.7, top_k=TOP_K, max_tokens=8)
    history, y = history_with_a_lookup(engine, params)
    hidden, logits = target_pass(engine, history)
    p = distribution(logits[0], params)
    req = Request("draws", history[:-1], params, on_output=None, generator=make_generator(11),
                  draft_limits=engine.config.spec.request_limits(n_max=1))
    req.token_ids.append(history[-1])  # the history's last token as the request's output
    req.admit(slot=0, reuse=len(history) - 1, now=0.0)
    n = len(history) - 1
    first, lookups = [], 0
    for i in range(DRAWS):
        # The drafter's cache sees the whole history once; later draws rewrite only the last position.
        start = 0 if i == 0 else n - 1
        got = engine.drafter.draft([Span(req, start, n, hidden[start:n], room=8)])[req]
        assert len(got.tokens) == 1 and got.q.shape == (1, engine.model.config.vocab_size)
        assert len(got.siblings) == (2 if branch == "tree" else 0)
        lookups += got.tokens == [y] and float(got.q[0, y]) == 1.0
        verdict = verify(got, logits.expand(1 + len(got.row), -1), params, req.token_ids, req.generator)
        first.append(verdict.tokens[0])
    assert (lookups == DRAWS) == (branch == "lookup")
    observed = torch.bincount(torch.tensor(first), minlength=p.numel()).double()
    support = p > 0
    assert observed[~support].sum() == 0, "a token the target gives zero probability came out"
    expected = p[support].double() / p[support].double().sum() * DRAWS  # p in f32 sums to 1 only nearly
    assert chisquare(observed[support].numpy(), expected.numpy()).pvalue > 0.001


@pytest.mark.parametrize("kind", ["ngram-simple", "draft-mtp"])
def test_past_max_batch_decoding_requests_no_request_drafts_and_output_stays_the_targets(tiny_model, draft, plain,
                                                                                         kind):
    spec = SpecConfig(pacing=False, type=kind, draft_model=None if kind == "ngram-simple" else str(draft), n_max=3, p_min=0.0,
                      ngram_n=2, max_batch=1)
    engine = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=512, parallel=2, spec=spec))
    ids = plain.tokenizer.encode(PROMPT)
    expected, _, _ = run(plain, ids, GREEDY)
    outs = [[], []]
    reqs = [engine.submit(ids, GREEDY, lambda o, out=out: out.extend(o.token_ids),
                          cache_prompt=False) for out in outs]
    while any(r.finish_reason is None for r in reqs):
        engine.step()
        both_decode = all(r.finish_reason is None and not r.prefilling for r in reqs)
        assert not (both_decode and any(r.draft.tokens for r in reqs)), "two requests decode: nobody drafts"
    assert outs == [expected, expected] and all(r.draft_n == 0 for r in reqs)
    # Alone, the same request drafts again: the limit counts the requests decoding now.
    tokens, req, _ = run(engine, ids, GREEDY)
    assert tokens == expected and req.draft_n > 0


@pytest.mark.parametrize("chunk", [128, 3])
def test_past_max_batch_the_draft_catches_up_later_in_one_forward_and_its_cache_ends_whole(tiny_model, draft, plain,
                                                                                          chunk):
    """While two requests decode past max_batch 1 the drafter is not called at all (unless a request
    owes a chunk of positions); the positions they commit meanwhile are caught up when the one
    left drafts again, when a request owes a chunk, and when the other finishes. Whichever, the
    draft's cache ends as it does for each request served alone."""
    spec = SpecConfig(pacing=False, type="draft-mtp", draft_model=str(draft), n_max=3, p_min=0.0, max_batch=1)
    ids = plain.tokenizer.encode(PROMPT)
    lengths = [GREEDY, dataclasses.replace(GREEDY, max_tokens=12)]

    def serve(params: list[SamplingParams]):
        engine = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=512, parallel=2, spec=spec))
        engine.drafting.catch_up_chunk = chunk
        drafted, busy_calls = engine.drafter.draft, []
        outs = [[] for _ in params]
        reqs = [engine.submit(ids, p, lambda o, out=out: out.extend(o.token_ids), cache_prompt=False)
                for p, out in zip(params, outs)]
    
        def both_decode() -> bool:
            return len(reqs) > 1 and all(r.finish_reason is None and not r.prefilling for r in reqs)

        def draft(spans, *args):
            busy_calls.append(both_decode())
            return drafted(spans, *args)
        engine.drafter.draft = draft
        steps_together = 0
        while any(r.finish_reason is None for r in reqs):
            steps_together += both_decode()
            engine.step()
        k = engine.drafter.resident()[1].k[0]  # [slots, kv_heads, ctx, head_dim]
        return outs, [k[r.slot].clone() for r in reqs], steps_together, busy_calls

    outs, caches, steps_together, busy_calls = serve(lengths)
    assert steps_together >= 5
    if chunk > steps_together:
        assert not any(busy_calls), "no drafter call while both decode"
    else:
        assert 0 < sum(busy_calls) < steps_together, "a catch-up every chunk, not every step"
    for params, out, cache in zip(lengths, outs, caches):
        (alone,), (cache_alone,), _, _ = serve([params])
        assert out == alone
        # Up to the last step's span, which no finished request catches up (its slot is free).
        caught_up = len(ids) + len(out) - 1 - (spec.n_max + 1)
        torch.testing.assert_close(cache[:, :caught_up], cache_alone[:, :caught_up], rtol=0, atol=1e-5)
