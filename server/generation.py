"""One generation as the HTTP layer sees it: validate and submit, then turn engine outputs into
text pieces (stop strings applied) and a final record with finish_reason, usage and timings.
Formatting into chat or text-completion shapes is left to openai_api."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from engine import (ConfigError, Constraint, DraftLimits, GrammarError, GrammarSpec, IncrementalDecoder, ProbeSpec,
                    SamplingParams)
from server.probes import probe_body, probe_spec
from server.protocol import APIError, FinishReason, GrammarSource, SamplingFields, Timings
from server.state import ServerState
from server.stop import StopMatcher

log = logging.getLogger("tandem.server")

# The engine's name for a parameter where the wire's differs, for errors that name the field sent.
WIRE_NAMES = {"repetition_penalty": "repeat_penalty"}
RETRY_AFTER_S = 1  # what a request refused by the full wait queue is told to wait
GRAMMAR_TIMEOUT_S = 10  # llguidance's fuel limits bound a compile well below this; a guard, not a rule


def _wire_error(e: ConfigError) -> APIError:
    """The engine's `field=value: rule` as a 400 naming the field as the request spelled it."""
    name, sep, rest = str(e).partition("=")
    return APIError(400, f"{WIRE_NAMES.get(name, name)}{sep}{rest}")


@dataclass
class PreparedRequest:
    """A validated request, ready to submit."""
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    cache_prompt: bool
    pinned_slot: int | None
    probe: ProbeSpec | None = None
    draft_limits: DraftLimits | None = None  # the request's own; None: the server's
    constraint: Constraint | None = None  # a grammar's matcher, made by `constrain`


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None  # per token: {"token", "logprob", "top": [(id, logprob)]}


@dataclass
class Final:
    finish_reason: FinishReason
    usage: dict
    timings: dict
    attention_probe: dict | None = None  # when the request asked for one and its prompt ran


def prepare(state: ServerState, body: SamplingFields, prompt_ids: list[int],
            n_logprobs: int | None) -> PreparedRequest:
    """Everything checked before a slot is taken: model name, lengths, sampling parameters (their
    ranges are SamplingParams' rules), the attention probe (ProbeSpec's), the speculation limits
    (SpecConfig.request_limits'), and room in the wait queue."""
    engine = state.runner.engine
    state.check_model(body.model)
    limit = body.token_limit
    try:
        engine.admission.check_prompt(len(prompt_ids), limit)
    except ConfigError as e:
        raise _wire_error(e) from e
    vocab = engine.model.config.vocab_size
    if any(t >= vocab for t in prompt_ids):
        raise APIError(400, f"prompt: token ids must be < the vocabulary size {vocab}")
    bias = dict(body.bias_pairs())
    if any(not 0 <= t < vocab for t in bias):
        raise APIError(400, f"logit_bias: token ids must be in [0, {vocab})")
    if body.id_slot is not None and not 0 <= body.id_slot < engine.config.parallel:
        raise APIError(400, f"id_slot={body.id_slot}: must be in [0, {engine.config.parallel}) or absent")
    try:
        params = SamplingParams(
            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
            repetition_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed,
            max_tokens=limit if limit is not None else engine.admission.room_after(len(prompt_ids)),
            ignore_eos=body.ignore_eos, logit_bias=bias, logprobs=n_logprobs)
        probe = None if body.attention_probe is None else probe_spec(body.attention_probe)
        if probe is not None:
            engine.admission.check_probe(probe, len(prompt_ids))
        draft_limits = _draft_limits(engine.config.spec, body)
    except ConfigError as e:
        raise _wire_error(e) from e
    _check_queue(state)
    return PreparedRequest(prompt_ids, params, body.stop_strings, body.cache_prompt, body.id_slot, probe, draft_limits)


async def constrain(state: ServerState, source: GrammarSource | None) -> Constraint | None:
    """A fresh matcher for the request's grammar, compiled (or found in the cache) on a worker
    thread; a grammar that cannot be used, or takes longer than GRAMMAR_TIMEOUT_S, is a 400."""
    if source is None:
        return None
    grammars = state.runner.engine.grammars
    spec = GrammarSpec(source.kind, source.source, source.field)
    try:
        return await asyncio.wait_for(asyncio.to_thread(grammars.constraint, spec), GRAMMAR_TIMEOUT_S)
    except GrammarError as e:
        raise APIError(400, str(e)) from e
    except TimeoutError:
        raise APIError(400, f"{source.field}: took longer than {GRAMMAR_TIMEOUT_S} s to compile") from None


def _draft_limits(spec, body: SamplingFields) -> DraftLimits | None:
    """The request's own speculation limits, or None: the server's, or none to apply on a server
    that does not speculate (which ignores them, as llama-server does)."""
    given = body.spec_n_max, body.spec_n_min, body.spec_p_min
    if spec is None or given == (None, None, None):
        return None
    return spec.request_limits(*given)


def _check_queue(state: ServerState) -> None:
    """With --queue-limit N, a request that would wait behind N others waiting for a slot gets 503."""
    limit = state.settings.queue_limit
    slots = state.runner.engine.config.parallel
    others = state.completions - 1  # the edge counts this request too
    if limit is not None and others >= slots + limit:
        raise APIError(503, f"all {slots} slot(s) are busy and {others - slots} request(s) already wait: "
                            f"the wait queue's limit is {limit} (--queue-limit)",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


async def run(state: ServerState, prepared: PreparedRequest) -> AsyncIterator[Piece | Final]:
    """Yields Pieces as tokens arrive, then one Final. Cancels the engine request when the
    consumer stops early (client gone), a stop string matches, or --timeout runs out (finish_reason
    "timeout"); a request the client left is counted in /metrics as cancelled."""
    stream = state.runner.submit(prepared.prompt_ids, prepared.params, cache_prompt=prepared.cache_prompt,
                                 pinned_slot=prepared.pinned_slot, probe=prepared.probe,
                                 draft_limits=prepared.draft_limits, constraint=prepared.constraint,
                                 interval=state.settings.stream_interval)
    decoder = IncrementalDecoder(state.runner.engine.tokenizer)
    matcher = StopMatcher(prepared.stops)
    timeout = state.settings.timeout
    deadline = None if timeout is None else stream.t_arrived + timeout
    n_tokens, t_last, ended = 0, 0.0, False
    try:
        while True:
            try:
                out = await asyncio.wait_for(stream.next(), None if deadline is None else
                                             max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                stream.cancel()
                ended, final = True, _final(state, stream.request, "timeout", n_tokens, time.perf_counter())
                log.info("request %s: ended after its time limit of %g s (--timeout)", stream.request.id, timeout)
                rest = matcher.flush()
                if rest:
                    yield Piece(rest, [], None)
                yield final
                return
            now = time.perf_counter()
            if out.token_ids:
                if t_last:
                    state.metrics.itl.observe(now - t_last)
                else:
                    state.metrics.ttft.observe(now - stream.t_arrived)
                t_last = now
                n_tokens += len(out.token_ids)
            text = matcher.push(decoder.push(out.token_ids))
            if matcher.stopped:
                stream.cancel()
                ended, final = True, _final(state, stream.request, "stop", n_tokens, now)
                yield Piece(text, out.token_ids, out.logprobs)
                yield final
                return
            if out.finished:
                text += matcher.push(_decoder_rest(decoder)) + matcher.flush()
            if text or out.token_ids:
                yield Piece(text, out.token_ids, out.logprobs)
            if out.finished:
                # Text held back until the end may itself complete a stop string.
                reason = "stop" if matcher.stopped else stream.request.finish_reason
                ended = True
                yield _final(state, stream.request, reason, n_tokens, None)
                return
    finally:
        stream.cancel()  # no-op when the engine finished it
        if not ended:
            state.metrics.on_finished(_timings(stream.request, n_tokens, time.perf_counter()), cancelled=True)


def _decoder_rest(decoder: IncrementalDecoder) -> str:
    """Text still held back at the end (an incomplete character, shown as the tokenizer decodes it)."""
    tok = decoder.tokenizer
    return tok.decode(decoder.ids[decoder.prefix:])[len(tok.decode(decoder.ids[decoder.prefix:decoder.read])):]


def _timings(req, n_tokens: int, stopped_at: float | None) -> dict:
    # Ended here (stop string, time limit, client gone), the engine may hold a token more than was sent.
    t = req.timings() if stopped_at is None else req.timings(stopped_at, n_tokens)
    return Timings.of(t).model_dump(exclude_none=True)


def _final(state: ServerState, req, reason: str, n_tokens: int, stopped_at: float | None) -> Final:
    timings = _timings(req, n_tokens, stopped_at)
    n_prompt = req.n_prompt
    predicted = timings["predicted_n"]
    usage = {"prompt_tokens": n_prompt, "completion_tokens": predicted, "total_tokens": n_prompt + predicted}
    state.metrics.on_finished(timings)
    probe = None if req.probe_result is None else probe_body(req.probe.spec, req.probe_result)
    return Final(reason, usage, timings, probe)
