"""The FastAPI app: edge checks (auth, body size, draining), error shapes, and the endpoints
that are not completions. The model loads in a thread once the app is up, so /health answers
503 meanwhile."""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from server.edge import EdgeMiddleware
from server.http_errors import install_error_handlers
from server.metrics import EngineGauges
from server.chat_prompt import render_chat, renders_tools
from server.llama_api import router as llama_router
from server.messages_api import router as messages_router
from server.openai_api import get_state, router
from server.responses_api import router as responses_router
from server.protocol import (ERROR_RESPONSES, IGNORED_FIELDS, NEUTRAL_FIELDS, APIError, ApplyTemplateRequest,
                             DetokenizeRequest, TokenizeRequest, error_body)
from server.state import ServerState
from web.pages import install_pages

log = logging.getLogger("tandem.server")


def build_info() -> str:
    try:
        return f"tandem {importlib.metadata.version('tandem')}"
    except importlib.metadata.PackageNotFoundError:
        return "tandem (source tree)"


def create_app(state: ServerState, on_load_failure: Callable[[BaseException], None] = lambda e: None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.runner.load_in_background(asyncio.get_running_loop(), on_load_failure)
        yield
        await asyncio.to_thread(state.runner.stop)

    app = FastAPI(title="tandem", version=build_info(), lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", responses=ERROR_RESPONSES)
    app.state.tandem = state
    app.add_middleware(EdgeMiddleware, state=state)
    app.include_router(router)
    app.include_router(llama_router)
    app.include_router(responses_router)
    app.include_router(messages_router)

    install_error_handlers(app, "this server")
    install_pages(app, {"/": "chat.html"})

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse(error_body(503, "Server is shutting down"), status_code=503)
        if state.runner.load_error is not None:
            return JSONResponse(error_body(500, f"Model failed to load: {state.runner.load_error}"), status_code=500)
        if not state.runner.ready:
            return JSONResponse(error_body(503, "Loading model"), status_code=503)
        if state.runner.engine.failure is not None:
            return JSONResponse(error_body(500, f"Engine failed: {state.runner.engine.failure}"), status_code=500)
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        s = get_state(request)
        engine = s.runner.engine
        mc = engine.model.config
        n_ctx = engine.config.ctx_per_slot
        return {"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": 0, "owned_by": "tandem",
            "context_length": n_ctx,
            "meta": {"n_ctx": n_ctx, "n_ctx_total": engine.config.ctx_size, "n_ctx_train": mc.max_position_embeddings,
                     "n_vocab": mc.vocab_size, "n_params": mc.num_parameters(), "dtype": engine.config.dtype},
        }]}

    @app.get("/props")
    async def props(request: Request):
        s = get_state(request)
        engine, c = s.runner.engine, s.runner.engine.config
        spec = c.spec
        return {
            "model_alias": s.model_name, "model_path": str(engine.files.path), "n_ctx": c.ctx_size,
            "total_slots": c.parallel, "kv_unified": c.kv_unified, "dtype": c.dtype,
            # Defaults that yielded to the flags given, and why (engine/preflight.py).
            "adapted": list(c.adapted),
            # Threads the engine steps with now: fewer while other processes keep its cores busy.
            "threads": engine.threads,
            "stream_interval_ms": s.settings.stream_interval * 1000,
            "weight_formats": engine.weight_formats,
            # What block weights multiply: "q8" (8-bit, integer dot products) or "f32", as --activations resolved.
            "activations": engine.activations,
            "cache_type_k": c.kv_types[0], "cache_type_v": c.kv_types[1],
            "default_generation_settings": {"n_ctx": c.ctx_per_slot, "params": {
                "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "n_predict": -1}},
            "build_info": build_info(),
            "speculative": {"type": spec.type if spec else None, "n_max": spec.n_max if spec else 0,
                            "n_min": spec.n_min if spec else 0, "p_min": spec.p_min if spec else 0.0,
                            "draft_model": spec.draft_model if spec else None,
                            "max_batch": spec.max_batch if spec else 0, "width": spec.width if spec else 1,
                            "p_sibling": spec.p_sibling if spec else 0.0, "pacing": spec.pacing if spec else False},
            "chat_template": engine.tokenizer.chat_template or "",
            # What an answer can be held to (engine/sched/grammar.py) and how tools reach the model
            # (server/chat_prompt.py): rendered by its template, or described in its system message.
            "constrained_decoding": {"library": "llguidance", "grammar": "gbnf", "json_schema": True,
                                     "response_format": ["text", "json_object", "json_schema"]},
            # A request's top-level fields that are accepted and ignored on purpose (server.protocol): any
            # other field tandem does not read is refused.
            "ignored_fields": {"any_value": list(IGNORED_FIELDS), "only_this_value": NEUTRAL_FIELDS},
            "tools": {"call_format": "hermes", "template_renders_tools": renders_tools(engine.tokenizer),
                      "tool_choice": ["none", "auto", "required", "function"]},
            "compress_ratios": list(engine.model.config.layer_ratios),
            # Each trunk layer's mixer: full_attention, or linear_attention (a recurrent state per slot).
            "layer_types": list(engine.model.config.kinds),
            "qsa_budget": engine.model.config.qsa_budget,
            # Where the model runs (engine/placement.py); one process steps one micro-batch at a time.
            "devices": [usage.as_dict() for usage in engine.devices],
            "stages": len(engine.placement.layer_split), "pipeline_depth": c.depth,
            "draft_device": c.draft_device,
            # The rank the draft runs in: this process's (0), or its own, the last (--spec-draft-rank).
            "draft_rank": c.world - 1 if c.draft_rank else 0 if spec else None,
            # Each stage's process (rank 0 is this one; -pp puts one stage in each), device and layers.
            "pipeline_stages": [{"rank": s if c.pipeline_parallel_size > 1 else 0, "device": device,
                                 "layers": [layers.start, layers.stop]}
                                for s, (device, layers) in enumerate(zip(engine.placement.devices,
                                                                        engine.placement.stage_ranges()))],
        }

    @app.get("/slots")
    async def slots(request: Request):
        s = get_state(request)
        speculative = s.runner.engine.config.spec is not None
        return [{"id": i.id, "id_task": i.id_task, "n_ctx": i.n_ctx, "is_processing": i.is_processing,
                 "speculative": speculative, "n_prompt_tokens": i.n_prompt_tokens, "n_cached": i.n_cached,
                 "next_token": {"n_decoded": i.n_decoded},
                 "draft_n": i.draft_n, "draft_n_accepted": i.draft_n_accepted,
                 **({} if i.state_snapshots is None else {"state_snapshots": i.state_snapshots})}
                for i in s.runner.engine.slots_info()]

    @app.get("/metrics")
    async def metrics(request: Request):
        s = get_state(request)
        engine = s.runner.engine
        infos = engine.slots_info()
        cached = [i.n_cached for i in infos]
        gauges = EngineGauges(steps=engine.stats.steps, busy_slots=engine.stats.busy_slots,
                              preemptions=engine.stats.preemptions,
                              processing=sum(i.is_processing for i in infos), deferred=engine.num_waiting,
                              kv_tokens=sum(cached), kv_capacity=engine.cache.capacity, n_tokens_max=max(cached),
                              drafted_at=list(engine.stats.drafted_at), accepted_at=list(engine.stats.accepted_at),
                              siblings_kept=engine.stats.siblings_kept)
        return PlainTextResponse(s.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        state = get_state(request)
        state.check_model(body.model)
        tokenizer = state.runner.engine.tokenizer
        ids = await state.prompts.ids(body.content, body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": tokenizer.decode([t])} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        state = get_state(request)
        state.check_model(body.model)
        engine = state.runner.engine
        vocab = engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})")
        return {"content": engine.tokenizer.decode(body.tokens)}

    @app.post("/apply-template")
    async def apply_template(body: ApplyTemplateRequest, request: Request):
        state = get_state(request)
        state.check_model(body.model)
        return {"prompt": render_chat(state.runner.engine.tokenizer, body.messages)}

    return app
