"""Engine: one model, one KV cache, a scheduler, and the thread that steps them.

`Engine.load()` validates and loads; `submit()` queues a request from any thread and returns at
once; outputs arrive through the request's `on_output` callback, called on the engine thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

import torch

from engine import kernels
from engine.batch import ForwardBatch
from engine.drafter import Drafter, SpecConfig, Span, load_drafter
from engine.errors import ConfigError, check_rules
from engine.footprint import DeviceUsage, measure
from engine.kv_cache import KV_DTYPES, KVCache, PagedKVCache, cache_for
from engine.model import Transformer
from engine.options import CompressRatios
from engine.pipeline.head import MirroredCache, PipelineError, RemoteStages, pipelined_forward
from engine.pipeline.ranks import Rank, join
from engine.pipeline.transport import Link
from engine.placement import Placement, is_device_name
from engine.preflight import Headers, describe_cache, read_headers
from engine.probe import ProbeCapture, ProbeSpec
from engine.quant import DTYPES, describe_formats, keeps_blocks
from engine.request import Draft, DraftLimits, Request, Status, StepOutput
from engine.sampling import SamplingParams, choose, logprob_entry, make_generator
from engine.scheduler import PlannedRow, Scheduler
from engine.speculative import Verdict, verify
from engine.tokenizer import Tokenizer
from engine.weights import ModelFiles

log = logging.getLogger("tandem.engine")
# Past spec.max_batch a request owes its draft the catch-up of the positions it commits; at this many
# owed positions the catch-up runs anyway, which bounds the hidden states kept per request.
CATCH_UP_CHUNK = 128


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path, or None / "default" for the embedded SmolLM2
    dtype: str = "f32"
    ctx_size: int = 4096  # total positions, split evenly across the slots (or shared: kv_unified)
    parallel: int = 1
    batch_size: int = 2048
    ubatch_size: int = 512
    cache_type: str | None = None  # K (and V unless cache_type_v says otherwise); None: the compute dtype
    cache_type_v: str | None = None
    kv_unified: bool = False
    threads: int | None = None
    chat_template: str | None = None
    spec: SpecConfig | None = None
    compress_ratios: CompressRatios | None = None  # overrides the model's (and the draft's, in list form)
    qsa_budget: int | None = None  # overrides the model's
    pipeline_parallel_size: int = 1  # processes the trunk's stages run in (engine/pipeline)
    pipeline_depth: int | None = None  # micro-batches a step splits into; None: one per stage
    pipeline_timeout: float = 8.0  # seconds the head waits for the stages' answer to one micro-batch
    # Where the trunk's layers and the draft run (engine/placement.py): one stage per device, the
    # layers split by count or in proportion (neither: as evenly as they go).
    devices: tuple[str, ...] = ("cpu",)
    layer_split: tuple[int, ...] | None = None
    tensor_split: tuple[float, ...] | None = None
    draft_device: str = "cpu"

    def __post_init__(self) -> None:
        kv_types = f"must be one of {', '.join(KV_DTYPES)}"
        check_rules([
            (self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {', '.join(DTYPES)}"),
            (self.cache_type is None or self.cache_type in KV_DTYPES, "cache_type", self.cache_type, kv_types),
            (self.cache_type_v is None or self.cache_type_v in KV_DTYPES, "cache_type_v", self.cache_type_v,
             kv_types),
            (not self.kv_unified or self.ctx_size >= PagedKVCache.PAGE_SIZE, "ctx_size", self.ctx_size,
             f"must be at least {PagedKVCache.PAGE_SIZE} with kv_unified"),
            (self.parallel >= 1, "parallel", self.parallel, "must be >= 1"),
            (self.ctx_size >= self.parallel, "ctx_size", self.ctx_size, f"must be at least parallel={self.parallel}"),
            (self.ubatch_size >= 1, "ubatch_size", self.ubatch_size, "must be >= 1"),
            (self.batch_size >= self.parallel, "batch_size", self.batch_size,
             f"must be at least parallel={self.parallel}"),
            (self.threads is None or self.threads >= 1, "threads", self.threads, "must be >= 1"),
            (len(self.devices) >= 1 and all(map(is_device_name, self.devices)), "devices", self.devices,
             "must be one or more of cpu, cuda:N"),
            (is_device_name(self.draft_device), "draft_device", self.draft_device, "must be cpu or cuda:N"),
            (self.pipeline_parallel_size >= 1, "pipeline_parallel_size", self.pipeline_parallel_size, "must be >= 1"),
            (self.pipeline_depth is None or self.pipeline_depth >= 1, "pipeline_depth", self.pipeline_depth,
             "must be >= 1"),
            (self.pipeline_timeout > 0, "pipeline_timeout", self.pipeline_timeout, "must be > 0"),
        ])

    @property
    def ctx_per_slot(self) -> int:
        """Positions one request may use: its share, or the whole pool when it is unified."""
        if self.kv_unified:
            return self.ctx_size // PagedKVCache.PAGE_SIZE * PagedKVCache.PAGE_SIZE
        return self.ctx_size // self.parallel

    @property
    def depth(self) -> int:
        """Micro-batches of a step in flight at once: one in one process, whose stages share it."""
        return self.pipeline_depth or self.pipeline_parallel_size if self.pipeline_parallel_size > 1 else 1

    @property
    def kv_types(self) -> tuple[str, str]:
        """(K, V) cache types. By default the cache holds what attention computes in, so no step
        converts a slot's whole prefix: f32, or bf16 with bf16 weights."""
        k = self.cache_type or ("bf16" if self.dtype == "bf16" else "f32")
        return k, self.cache_type_v or k


@dataclass
class SlotInfo:
    """A snapshot of one slot for /slots (read from any thread)."""
    id: int
    n_ctx: int
    is_processing: bool
    id_task: str | None
    n_prompt_tokens: int
    n_cached: int  # positions whose K/V the slot holds
    n_decoded: int
    draft_n: int  # drafted and accepted tokens of the slot's current request
    draft_n_accepted: int


@dataclass
class EngineStats:
    """Counters since start, written on the engine thread and read anywhere."""
    steps: int = 0  # forward passes
    busy_slots: int = 0  # sum over steps of the slots in the step
    preemptions: int = 0  # requests paused for want of KV room, to resume later
    # Per draft position i (0-based): how often a draft reached it, and how often it was accepted.
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    siblings_kept: int = 0  # steps whose kept path ended in a sibling rather than the chain's draft

    def count_drafts(self, drafted: int, accepted: int) -> None:
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted


@dataclass
class Engine:
    config: EngineConfig
    files: ModelFiles
    model: Transformer
    tokenizer: Tokenizer
    cache: KVCache
    scheduler: Scheduler
    eos_ids: frozenset[int]
    _inbox: "queue.SimpleQueue" = field(default_factory=queue.SimpleQueue)
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _stopping: bool = False
    drafter: Drafter | None = None  # when speculation is on
    # Per request, the committed span its drafter has not caught up on yet, and the slot it lies in.
    _owed: dict[Request, tuple[int, Span]] = field(default_factory=dict)
    stats: EngineStats = field(default_factory=EngineStats)
    devices: list[DeviceUsage] = field(default_factory=list)  # what each device holds, as loaded
    remote: RemoteStages | None = None  # stages 1.. in worker processes (-pp)
    placement: Placement | None = None  # the whole model's, remote stages included

    @property
    def failure(self) -> str | None:
        """Why the engine can serve nothing more (a pipeline stage was lost), else None."""
        return self.remote.failure if self.remote is not None else None
    weight_formats: dict[str, int] = field(default_factory=dict)  # the target's tensors per format, as loaded

    @classmethod
    def load(cls, config: EngineConfig, headers: Headers | None = None, rank: Rank | None = None,
             describe_loss=lambda rank, error: None) -> "Engine":
        """headers: `read_headers(config)` when the caller has already checked them (the server
        does before it listens; reading a GGUF file's headers takes seconds). rank: the head's,
        with -pp (ranks.Rank); it meets the workers once its own stage is loaded. describe_loss:
        RemoteStages' account of a lost stage."""
        if config.threads:
            torch.set_num_threads(config.threads)
        if headers is None:
            headers = read_headers(config)  # every config error is raised here, before weights are read
        files, mc = headers.files, headers.model
        if config.ctx_per_slot > mc.max_position_embeddings:
            log.warning("ctx per slot %d exceeds the model's trained context %d",
                        config.ctx_per_slot, mc.max_position_embeddings)
        tokenizer = Tokenizer.load(files, config.chat_template)
        t0 = time.perf_counter()
        # Build (or find) the CPU kernels now, not in the first request's forward: the server
        # reports healthy only after load, and a first build takes about a minute.
        log.info("CPU kernels: %s", "ready" if kernels.available() else "unavailable, torch's ops instead")
        stages = headers.placement.stage_ranges()
        # A pipeline head builds stage 0 and reads only its tensors; RemoteStages stands for the rest.
        placement = headers.placement if rank is None else headers.placement.first_stage()
        tensors = files.load_tensors(stages[0] if rank is not None else None, keep_blocks=keeps_blocks(config.dtype))
        model = Transformer(mc, tensors, config.dtype,
                            max_positions=max(config.ctx_per_slot, mc.max_position_embeddings), placement=placement)
        drafter = None
        if config.spec is not None:
            drafter = load_drafter(config.spec, model, tensors, config.dtype, config.parallel, config.ctx_per_slot,
                                   headers.draft_ratios, placement.draft_device)
        del tensors
        log.info("loaded %s (%s, %s) in %.1f s", files.path, mc.family, config.dtype, time.perf_counter() - t0)
        formats = model.weight_formats()
        log.info("weights: %s", describe_formats(formats))
        cache = cache_for(config, mc.num_kv_heads, mc.head_dim, model.specs, placement.layer_devices())
        slots = f"1 unified pool of {cache.capacity} positions for {config.parallel} slots" if config.kv_unified \
            else f"{config.parallel} slots x {config.ctx_per_slot} ctx"
        log.info("KV cache: %s", describe_cache(model.specs, slots, cache.nbytes, cache.kpool_nbytes))
        if drafter is not None and drafter.cached is not None:  # a draft model, placed on its device
            devices = measure(model, cache, placement.draft_device, drafter.cached.model, drafter.cached.cache)
        else:
            devices = measure(model, cache)
        log.info("%d stage(s), pipeline depth %d, %d process(es)", len(stages), config.depth,
                 config.pipeline_parallel_size)
        for usage in devices:
            log.info("device %s", usage.describe())
        eos = set(mc.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        margin = 1 if drafter is not None and drafter.needs_hidden else 0
        remote = None
        if rank is not None:
            log.info("pipeline: this head (rank 0) runs stage 0, layers %s; %s", _layer_span(stages[0]),
                     "; ".join(f"rank {r} stage {r}, layers {_layer_span(s)} on {headers.placement.devices[r]}"
                               for r, s in enumerate(stages) if r))
            link = Link(0, rank.world, mc.hidden_size, model.compute_dtype, join(rank, headers.placement, 0))
            remote = RemoteStages(link, config.pipeline_timeout, placement.devices[0], describe_loss)
            model.stages.append(remote)  # after the local stage, before the final norm
        scheduler = Scheduler(config.parallel, config.ctx_per_slot, config.batch_size, config.ubatch_size,
                              MirroredCache(cache, remote.queued) if remote is not None else cache,
                              reuse_margin=margin, draft_max=config.spec.verify_rows if config.spec else 0)
        return cls(config, files, model, tokenizer, cache, scheduler, frozenset(eos), drafter=drafter, devices=devices,
                   remote=remote, placement=headers.placement,
                   weight_formats={fmt: use.tensors for fmt, use in formats.items()})

    # -- any thread ---------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output, *, request_id: str | None = None,
               cache_prompt: bool = True, slot_id: int | None = None, probe: ProbeSpec | None = None,
               draft_limits: DraftLimits | None = None) -> Request:
        """Queue a request; the caller has validated it fits (see check_prompt), its probe
        (check_probe) and its draft limits (SpecConfig.request_limits; None: the server's). A probe
        that needs q before the last prompt token runs the prompt whole."""
        capture = None if probe is None else ProbeCapture.start(probe, self.model.config.num_layers, len(prompt_ids))
        spec = self.config.spec
        req = Request(request_id or uuid.uuid4().hex, list(prompt_ids), params, on_output,
                      cache_prompt=cache_prompt and not (probe is not None and probe.recomputes), slot_id=slot_id,
                      generator=make_generator(params.seed), probe=capture,
                      draft_limits=draft_limits or (spec.limits if spec is not None else None))
        self._inbox.put(("add", req))
        self._wake.set()
        return req

    def cancel(self, request: Request) -> None:
        self._inbox.put(("cancel", request))
        self._wake.set()

    def check_prompt(self, n_prompt: int, max_tokens: int | None) -> None:
        """Raise ConfigError unless a prompt of n_prompt tokens and max_tokens (None: as many as fit)
        fit one slot."""
        ctx = self.config.ctx_per_slot
        if n_prompt < 1:
            raise ConfigError("prompt: must contain at least one token")
        if n_prompt >= ctx:
            raise ConfigError(f"prompt has {n_prompt} tokens: the slot context is {ctx} (leave room to generate)")
        if max_tokens is not None and n_prompt + max_tokens > ctx:
            raise ConfigError(f"max_tokens={max_tokens}: the prompt's {n_prompt} tokens plus max_tokens exceed "
                              f"the slot context {ctx} (at most {ctx - n_prompt})")

    def check_probe(self, probe: ProbeSpec, n_prompt: int) -> None:
        """Raise ConfigError unless the probe fits this model and a prompt of n_prompt tokens. Under
        -pp only the head's own stage can be probed: its workers' layers send back hidden states only."""
        probe.check(self.model.config.num_layers, n_prompt)
        if self.remote is not None:
            own = self.placement.stage_ranges()[0]
            rule = f"probes need a single process: under -pp only the head's layers {own.start}..{own.stop - 1} can be probed"
            check_rules([(layer in own, "attention_probe.layers", layer, rule)
                         for layer in probe.layer_indices(self.placement.num_layers)])

    def room_after(self, n_prompt: int) -> int:
        """The most tokens a request with an n_prompt-token prompt can generate."""
        return self.config.ctx_per_slot - n_prompt

    def slots_info(self) -> list[SlotInfo]:
        out = []
        for slot in self.scheduler.slots:
            req = slot.request  # one read: the engine thread may swap it meanwhile
            out.append(SlotInfo(slot.id, self.config.ctx_per_slot, req is not None, req.id if req else None,
                                len(req.prompt_ids) if req else 0, len(slot.cached_ids),
                                len(req.output_ids) if req else 0, req.draft_n if req else 0,
                                req.draft_n_accepted if req else 0))
        return out

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.remote is not None and (self._thread is None or not self._thread.is_alive()):
            self.remote.close()

    def generate(self, prompt_ids: list[int], params: SamplingParams, **kwargs):
        """Yield the StepOutputs of one request; steps inline when no engine thread runs."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(prompt_ids, params, outputs.put, **kwargs)
        while True:
            if self._thread is None and outputs.empty():
                self._drain_inbox()
                self.step()
                continue
            out = outputs.get()
            yield out
            if out.finished:
                return

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                self._keepalive()
                continue
            try:
                self.step()
            except Exception:  # a bug outside the guarded parts (planning): fail what is in flight
                log.exception("engine step failed; finishing the running requests with an error")
                self._fail_all()

    def _keepalive(self) -> None:
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
                self._owed.pop(req, None)
                self._finish(req, "cancelled")

    def step(self) -> None:
        """One engine step: plan the rows, run them in one forward, then apply each row's result
        to its request (tokens verified, emitted, committed), then draft for the next step. A
        failure fails only the requests it touched: the forward's, or one row's, or one draft's."""
        plan = self.scheduler.plan(time.perf_counter())
        self.stats.preemptions += len(plan.preempted)
        if not plan.rows:
            return
        self.stats.steps += 1
        self.stats.busy_slots += len(plan.rows)
        try:
            out = self._forward(plan.rows)
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
        if self.drafter is not None:
            self._draft([s for s in spans if s is not None and s.request.status is Status.RUNNING],
                        [p.request for p in plan.rows if p.request.status is Status.FINISHED])

    def _draft(self, spans: list[Span], finished: list[Request]) -> None:
        """Drafts for the next step, batched; when the batch fails, each request drafts alone so
        that only the one that fails loses its stream. Past spec.max_batch decoding requests no
        request drafts, and a drafter with a cache catches up later, in one forward: when the
        request drafts again, owes CATCH_UP_CHUNK positions, or finishes (`finished`: this step's),
        so that its slot's prefix serves a next turn as it did before (all but the last step's span)."""
        limit = self.config.spec.max_batch
        busy = bool(limit) and sum(not s.request.prefilling for s in spans) > limit
        if self._owed:  # a preempted request's slot was emptied: it resumes from 0 and owes nothing
            self._owed = {req: owed for req, owed in self._owed.items()
                          if req.status is Status.RUNNING or req in finished}
        ready = [self._owed.pop(req)[1] for req in finished if req in self._owed]
        for span in spans:
            try:
                merged = self._with_owed(span)
                if busy:
                    merged.room = 0
                    if self.drafter.cached is not None and merged.end - merged.start < CATCH_UP_CHUNK:
                        # A view of this step's hidden states would keep all of them alive.
                        owed = merged if merged is not span else replace(span, hidden=span.hidden.clone())
                        self._owed[span.request] = span.request.slot, owed
                        continue
            except Exception:  # e.g. out of device memory for the kept states: this request only
                log.exception("request %s failed keeping its draft catch-up", span.request.id)
                self._fail(span.request)
                continue
            ready.append(merged)
        if not ready:
            return
        spans = ready
        try:
            drafts = self.drafter.draft(spans)
        except Exception:
            log.exception("drafting failed for a batch of %d; drafting each alone", len(spans))
            drafts = {}
            for span in spans:
                try:
                    drafts.update(self.drafter.draft([span]))
                except Exception:
                    log.exception("request %s failed drafting", span.request.id)
                    self._fail(span.request)
        for req, draft in drafts.items():
            req.draft = draft

    def _with_owed(self, span: Span) -> Span:
        """The span, preceded by the positions its request owes the drafter where they lead up to
        it in the same slot (a preempted request resumes by recomputing, and owes nothing before)."""
        slot, owed = self._owed.pop(span.request, (None, None))
        if owed is None or slot != span.request.slot or owed.end != span.start:
            return span
        return replace(span, start=owed.start, hidden=torch.cat([owed.hidden, span.hidden]))

    def _forward(self, rows: list[PlannedRow]) -> "StepResult":
        probes = [p.request.probe if p.request.probe is not None
                  and p.request.probe.wants(p.row.start, len(p.row.tokens)) else None for p in rows]
        batch = ForwardBatch.build([p.row for p in rows], probes if any(probes) else None)
        if self.remote is not None:
            hidden = pipelined_forward(self.model, self.config.depth, batch, self.cache)
        else:
            hidden = self.model(batch, self.cache)
        for p in rows:
            probe = p.request.probe
            if probe is not None and not probe.done and p.row.start + len(p.row.tokens) >= probe.n_prompt:
                p.request.probe_result = probe.result()
        starts = batch.row_starts()
        index, firsts = [], []
        for p, start in zip(rows, starts):
            firsts.append(len(index))
            end = start + len(p.row.tokens)
            index.extend(range(end - p.num_logits, end))
        logits = self.model.logits(hidden[torch.tensor(index)]) if index else None
        return StepResult(hidden, logits, starts, firsts, time.perf_counter())

    def _apply(self, p: PlannedRow, out: "StepResult", i: int) -> Span | None:
        """What row i of the step gives its request; the span the drafter should see, if any."""
        req, tokens, at = p.request, p.row.tokens, out.firsts[i]
        kept = None  # the row's tokens committed, by index, where they are not its first ones
        if p.decodes:
            verdict = self._verify(req, out.logits[at:at + len(tokens)])
            rows = torch.tensor(verdict.rows)
            if verdict.rows[-1] != verdict.accepted:  # a sibling was kept: its K/V moves to its place
                kept = rows
                self.stats.siblings_kept += 1
                self.cache.move(req.slot, p.row.start + verdict.rows[-1], p.row.start + verdict.accepted)
            self.scheduler.commit(req, [tokens[r] for r in verdict.rows])
            self._emit(req, verdict.tokens, out.logits[at + rows], out.now)
        else:
            self.scheduler.commit(req, tokens)
            if p.samples:
                self._emit(req, [choose(out.logits[at], req.params, req.all_ids, req.generator)],
                           out.logits[at:at + 1], out.now)
        if self.drafter is None or req.status is not Status.RUNNING:
            return None
        start = out.starts[i]
        hidden = out.hidden[start:start + req.num_computed - p.row.start] if kept is None else out.hidden[start + kept]
        return Span(req, p.row.start, req.num_computed, hidden, room=self.config.ctx_per_slot - req.num_computed - 1)

    def _verify(self, req: Request, logits: torch.Tensor) -> Verdict:
        """Which of the request's drafts the target keeps (logits: [1 + drafts, vocab], one per
        verified position), and the token it adds after them."""
        draft, req.draft = req.draft, Draft()
        verdict = verify(draft, logits, req.params, req.all_ids, req.generator)
        if draft.tokens:
            req.draft_n += len(draft.tokens)
            req.draft_n_accepted += verdict.accepted
            self.stats.count_drafts(len(draft.tokens), verdict.accepted)
        return verdict

    def _emit(self, req: Request, tokens: list[int], logits: torch.Tensor, now: float) -> None:
        """Append the step's tokens to the request up to a stop, then deliver them."""
        if not req.t_first_token:
            req.t_first_token = now
        params, new, reason = req.params, [], None
        for token in tokens:
            if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
                reason = "stop"
                break
            new.append(token)
            if len(req.output_ids) + len(new) >= params.max_tokens:
                reason = "length"
                break
        # The newest token is written at num_computed next step; the slot must have room for it.
        if reason is None and req.num_computed + 1 >= self.config.ctx_per_slot:
            reason = "length"
        req.output_ids.extend(new)
        logprobs = None
        if params.logprobs is not None:
            logprobs = [logprob_entry(row, t, params.logprobs) for row, t in zip(logits, new)]
        if reason:
            self._finish(req, reason, new, logprobs)
        else:
            req.on_output(StepOutput(req, new, False, logprobs))

    def _fail(self, req: Request) -> None:
        self._owed.pop(req, None)
        if req.status is not Status.FINISHED:
            self._finish(req, "error")

    def _finish(self, req: Request, reason: str, tokens: list[int] | None = None,
                logprobs: list[dict] | None = None) -> None:
        """End the request, free its slot, and deliver its last output (with `tokens`, if any)."""
        req.finish_reason, req.status, req.t_finished = reason, Status.FINISHED, time.perf_counter()
        self.scheduler.release(req)
        req.on_output(StepOutput(req, tokens or [], True, logprobs))


@dataclass
class StepResult:
    """One forward's output, indexed by the plan's rows."""
    hidden: torch.Tensor  # [N, H] every token's hidden state after the final norm
    logits: torch.Tensor | None  # [L, vocab] the positions that need them (PlannedRow.num_logits each)
    starts: list[int]  # each row's first token in `hidden`
    firsts: list[int]  # each row's first position in `logits`
    now: float


def _layer_span(layers: range) -> str:
    return f"{layers.start}..{layers.stop - 1}"
