"""Engine: one model, one KV cache, a scheduler, and the thread that steps them.

`Engine.load()` validates and loads; `submit()` queues a request from any thread and returns at
once; outputs arrive through the request's `on_output` callback, called on the engine thread.
A step is: drain the inbox, plan (engine.sched), forward, apply each row's result to its request,
then hand the committed spans to speculation (engine.spec.runner).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

import torch

from engine.admission import Admission
from engine.forward import StepResult, forward
from engine.loader import load_parts
from engine.model.probe import ProbeCapture, ProbeSpec
from engine.pipeline.draft_rank import RemoteDrafter
from engine.pipeline.head import PipelineError, RemoteStages
from engine.pipeline.ranks import Rank
from engine.preflight import Headers, read_headers
from engine.sched.grammar import Constraint, Grammars
from engine.sched.request import Draft, Request, Status, StepOutput
from engine.sched.sampling import SamplingParams, choose, logprob_entry, make_generator
from engine.sched.scheduler import PlannedRow
from engine.settings import DraftLimits, EngineConfig
from engine.spec.acceptance import verify
from engine.spec.drafter import Drafter, Span
from engine.spec.runner import DraftRunner
from engine.stats import EngineStats, SlotInfo, slot_infos
from engine.threads import CoreShare

log = logging.getLogger("tandem.engine")


class Engine:
    def __init__(self, config: EngineConfig, headers: Headers, rank: Rank | None = None,
                 describe_loss=lambda rank, error: None):
        """Use Engine.load."""
        parts = load_parts(config, headers, rank, describe_loss)
        self.config, self.files, self.model, self.tokenizer = config, parts.files, parts.model, parts.tokenizer
        self.cache, self.scheduler, self.eos_ids = parts.cache, parts.scheduler, parts.eos_ids
        self.devices, self.remote, self.placement = parts.devices, parts.remote, parts.placement
        self.weight_formats = parts.weight_formats
        self.activations = parts.activations
        head = self.placement.stage_ranges()[0] if self.remote is not None else None
        mc = self.model.config
        self.admission = Admission(config.ctx_per_slot, self.placement.num_layers, head,
                                   frozenset(i for i in range(mc.num_layers) if mc.is_recurrent(i)))
        self.drafting = None if parts.drafter is None else DraftRunner(parts.drafter, config.spec.max_batch, self._fail,
                                                                         pacing=config.spec.pacing)
        self.grammars = Grammars(self.tokenizer.hf, self.model.config.vocab_size, self.eos_ids)
        self.stats = EngineStats()
        self.threads = config.threads or torch.get_num_threads()  # what the engine thread steps with now
        self.cores = CoreShare(config.threads)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def load(cls, config: EngineConfig, headers: Headers | None = None, rank: Rank | None = None,
             describe_loss=lambda rank, error: None) -> "Engine":
        """headers: `read_headers(config)` when the caller has already checked them (the server
        does before it listens; reading a GGUF file's headers takes seconds). rank: the head's,
        with -pp (ranks.Rank). describe_loss: RemoteStages' account of a lost stage."""
        if config.threads:
            torch.set_num_threads(config.threads)
        if headers is None:
            headers = read_headers(config)  # every config error is raised here, before weights are read
        return cls(headers.config, headers, rank, describe_loss)

    @property
    def drafter(self) -> Drafter | None:
        """The drafter when speculation is on, else None."""
        return self.drafting.drafter if self.drafting is not None else None

    @property
    def failure(self) -> str | None:
        """Why the engine can serve nothing more (a pipeline stage was lost), else None."""
        return self.remote.failure if self.remote is not None else None

    # -- any thread ---------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output, *, request_id: str | None = None,
               cache_prompt: bool = True, pinned_slot: int | None = None, probe: ProbeSpec | None = None,
               draft_limits: DraftLimits | None = None, constraint: Constraint | None = None) -> Request:
        """Queue a request; the caller has validated it fits (self.admission.check_prompt), its
        probe (check_probe) and its draft limits (SpecConfig.request_limits; None: the server's). A probe
        that needs q before the last prompt token runs the prompt whole. constraint: a fresh matcher
        of self.grammars that the request's tokens follow."""
        capture = None if probe is None else ProbeCapture.start(probe, self.model.config.num_layers, len(prompt_ids))
        spec = self.config.spec
        req = Request(request_id or uuid.uuid4().hex, prompt_ids, params, on_output,
                      cache_prompt=cache_prompt and not (probe is not None and probe.recomputes),
                      pinned_slot=pinned_slot, generator=make_generator(params.seed), probe=capture,
                      draft_limits=draft_limits or (spec.limits if spec is not None else None),
                      constraint=constraint)
        self._inbox.put(("add", req))
        self._wake.set()
        return req

    def cancel(self, request: Request) -> None:
        self._inbox.put(("cancel", request))
        self._wake.set()

    def slots_info(self) -> list[SlotInfo]:
        return slot_infos(self.scheduler, self.config.ctx_per_slot, self.cache.recurrent)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def busy(self) -> bool:
        """Whether a request was submitted and has not finished (a caller stepping an engine with
        no thread steps while this holds)."""
        return not self._inbox.empty() or self.scheduler.has_work()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():
            for link in (self.remote, self.drafter):
                if isinstance(link, (RemoteStages, RemoteDrafter)):
                    link.close()

    def generate(self, prompt_ids: list[int], params: SamplingParams, **kwargs):
        """Yield the StepOutputs of one request; steps inline when no engine thread runs."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(prompt_ids, params, outputs.put, **kwargs)
        while True:
            if self._thread is None and outputs.empty():
                self.step()
                continue
            out = outputs.get()
            yield out
            if out.finished:
                return

    # -- engine thread (or the one caller that steps an engine with no thread) -----------------

    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self.cores.rest()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                self._keepalive()
                continue
            self._fit_threads()
            try:
                self.step()
            except Exception:  # a bug outside the guarded parts (planning): fail what is in flight
                log.exception("engine step failed; finishing the running requests with an error")
                self._fail_all()

    def _fit_threads(self) -> None:
        """Step with as many threads as the cores other processes leave (engine.threads)."""
        wanted = self.cores.threads(self.threads)
        if wanted != self.threads:
            torch.set_num_threads(wanted)
            log.info("stepping with %d thread(s), was %d: the cores other processes leave this one", wanted,
                     self.threads)
            self.threads = wanted

    def _keepalive(self) -> None:
        if isinstance(self.drafter, RemoteDrafter):
            self.drafter.keepalive()
        if self.remote is None:
            return
        try:
            self.remote.keepalive()
        except PipelineError as e:
            log.error("%s; failing every request", e)

    def _fail_all(self) -> None:
        for req in self.scheduler.running + list(self.scheduler.waiting):
            self._fail(req)

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            kind, req = self._inbox.get()
            if kind == "add":
                self.scheduler.add(req)
            elif req.status is not Status.FINISHED:
                self._finish(req, "cancelled")

    def step(self) -> None:
        """One engine step: take what was submitted or cancelled, plan the rows, run them in one
        forward, then apply each row's result to its request (tokens verified, emitted,
        committed), then draft for the next step. A failure fails only the requests it touched:
        the forward's, or one row's, or one draft's. Called on the engine thread, or by a caller
        that steps an engine it never started (tests, draft training)."""
        self._drain_inbox()
        plan = self.scheduler.plan(time.perf_counter())
        self.stats.preemptions += len(plan.preempted)
        if not plan.rows:
            return
        self.stats.steps += 1
        self.stats.busy_slots += len(plan.rows)
        drafted = [bool(p.request.draft.tokens) for p in plan.rows] if self.drafting is not None else []
        start = time.perf_counter()
        try:
            out = forward(self.model, self.cache, plan.rows, self.config.depth if self.remote is not None else None)
        except PipelineError as e:  # nothing can run any more: fail what is in flight, and what comes
            log.error("%s; failing every request", e)
            self._fail_all()
            return
        except Exception:
            log.exception("forward failed; failing the %d request(s) in this step", len(plan.rows))
            for p in plan.rows:
                self._fail(p.request)
            return
        spans = []
        for i, p in enumerate(plan.rows):
            try:
                spans.append(self._apply(p, out, i))
            except Exception:
                log.exception("request %s failed in its step", p.request.id)
                self._fail(p.request)
        if self.drafting is not None:
            # A step's time is a request's own only where it ran alone.
            seconds = time.perf_counter() - start if len(plan.rows) == 1 else None
            for p, had in zip(plan.rows, drafted):
                if p.decodes and p.request.status is Status.RUNNING:
                    self.drafting.observe(p.request, p.row.start, seconds, had, p.request.num_computed - p.row.start)
            self.drafting.after_step([s for s in spans if s is not None and s.request.status is Status.RUNNING],
                                     [p.request for p in plan.rows if p.request.status is Status.FINISHED])

    def _apply(self, p: PlannedRow, out: StepResult, i: int) -> Span | None:
        """What row i of the step gives its request; the span the drafter should see, if any."""
        req, tokens, at = p.request, p.row.tokens, out.firsts[i]
        kept = None  # the row's tokens committed, by index, where they are not its first ones
        start = out.starts[i]
        if p.decodes:
            draft, req.draft = req.draft, Draft()
            verdict = verify(draft, out.logits[at:at + len(tokens)], req.params, req.token_ids, req.generator,
                             req.constraint)
            if draft.drafted:
                req.count_drafts(draft.drafted, verdict.accepted)
                self.stats.count_drafts(draft.drafted, verdict.accepted)
            if verdict.rows[-1] != verdict.accepted:  # a sibling was kept: its K/V moves to its place
                kept = torch.tensor(verdict.rows)
                self.stats.siblings_kept += 1
                self.scheduler.kv.move(req.slot, p.row.start + verdict.rows[-1], p.row.start + verdict.accepted)
            self.scheduler.commit(req, [tokens[r] for r in verdict.rows],
                                  self._hidden_kept(out, [start + r for r in verdict.rows]))
            self._emit(req, verdict.tokens, out.logits, [at + r for r in verdict.rows], out.now)
        else:
            self.scheduler.commit(req, tokens, self._hidden_kept(out, [start + len(tokens) - 1]))
            if p.samples:
                self._emit(req, [choose(out.logits[at], req.params, req.token_ids, req.generator, req.constraint)],
                           out.logits, [at], out.now)
        if self.drafting is None or req.status is not Status.RUNNING:
            return None
        hidden = out.hidden[start:start + req.num_computed - p.row.start] if kept is None else out.hidden[start + kept]
        # A draft fits the slot's room, and stops where the answer must (a verify step emits its
        # kept drafts and one token more), as llama-server caps it by n_predict.
        room = min(self.config.ctx_per_slot - req.num_computed - 1, req.params.max_tokens - req.n_output - 1)
        if req.resume_hidden is not None:  # it resumed a snapshot: its hidden state pairs with the first token
            hidden, req.resume_hidden = torch.cat([req.resume_hidden[None], hidden]), None
            return Span(req, p.row.start - 1, req.num_computed, hidden, room=room)
        return Span(req, p.row.start, req.num_computed, hidden, room=room)

    def _hidden_kept(self, out: StepResult, tokens: list[int]) -> torch.Tensor | None:
        """The hidden states at the step's `tokens` (a row's committed ones, or a prompt chunk's last),
        where the scheduler keeps them for a snapshot (Scheduler.keep_hidden); a copy, not a view of
        the whole step's."""
        return out.hidden[torch.tensor(tokens)] if self.scheduler.keep_hidden else None

    def _emit(self, req: Request, tokens: list[int], logits: torch.Tensor, rows: list[int], now: float) -> None:
        """Append the step's tokens to the request up to a stop, then deliver them; logits[rows[j]]
        gave token j. The rows are read only for logprobs: a gather of whole vocabulary rows for
        every token cost the served loop 5% of its time."""
        new, reason = req.take(tokens, self.eos_ids, self.config.ctx_per_slot, now)
        if req.constraint is not None:
            req.constraint.advance(new)
            if reason is None and req.constraint.done:
                reason = "stop"
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = [logprob_entry(logits[row], t, req.params.logprobs) for row, t in zip(rows, new)]
        if reason:
            self._finish(req, reason, new, logprobs)
        else:
            req.on_output(StepOutput(req, new, False, logprobs))

    def _fail(self, req: Request) -> None:
        if req.status is not Status.FINISHED:
            self._finish(req, "error")

    def _finish(self, req: Request, reason: str, tokens: list[int] | None = None,
                logprobs: list[dict] | None = None) -> None:
        """End the request, free its slot, and deliver its last output (with `tokens`, if any)."""
        req.finish(reason)
        self.scheduler.release(req)
        if self.drafting is not None and reason in ("cancelled", "error"):
            self.drafting.forget(req)
        req.on_output(StepOutput(req, tokens or [], True, logprobs))
