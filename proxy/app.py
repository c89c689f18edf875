"""The proxy's FastAPI app: jobs, what runs, models, health, metrics, logs, config reload, and
the relay routes. Built around one Proxy object made at startup (see `lifespan`)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sqlite3
from dataclasses import dataclass

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.routing import Route

from proxy.activity import ACTIVITY_SIZE, Activity
from proxy.children import ChildRegistry, reap_leftovers
from proxy.config import ProxyConfig, ProxyConfigError, load_config
from proxy.controller import Controller, shutting_down
from proxy.cores import CorePlan
from proxy.events import Reload
from proxy.forward import send_api_error, send_error
from proxy.jobs import JobRequest, JobStatus, JobStore, JobType, Trigger
from proxy.logbus import BusHandler, LogBus
from proxy.metrics import ProxyMetrics
from proxy.model_state import ModelStatus
from proxy.passthrough import MODEL_PATHS, Completions, Upstream
from proxy.supervisor import Supervisor
from proxy.upstream import UpstreamClient
from server.http_errors import install_error_handlers
from server.protocol import ERROR_RESPONSES, APIError, is_open, validation_problems
from web.pages import install_pages

log = logging.getLogger("tandem.proxy")


@dataclass
class Proxy:
    config: ProxyConfig
    overrides: dict
    db: sqlite3.Connection
    store: JobStore
    controller: Controller
    supervisor: Supervisor
    bus: LogBus
    metrics: ProxyMetrics
    activity: Activity
    upstream: UpstreamClient

    @property
    def draining(self) -> bool:
        """SIGTERM or SIGINT came: new requests get 503, running ones finish."""
        return self.controller.draining

    async def drain(self) -> None:
        """Unloads every model as an unload job does, recorded in the job history as the
        shutdown's: its requests have the proxy's shutdown_drain_timeout (or the profile's
        drain_timeout) to finish, then those still
        running end with an in-band error event; its servers stop cleanly. Meanwhile new requests
        get 503 with Retry-After. Returns once every unload has ended."""
        self.controller.begin_drain()
        models = [name for name, m in self.controller.models.items() if m.status is not ModelStatus.unloaded
                  or m.pool.replicas]
        log.info("shutting down: draining %d model(s)", len(models))
        jobs = [await self.controller.submit(JobType.unload, name, Trigger.shutdown) for name in models]
        while any(job.id in self.controller.jobs for job in jobs):
            await asyncio.sleep(0.05)

    def cut_short(self) -> None:
        """A second signal: the requests still running end now, each with an in-band error event."""
        for m in self.controller.models.values():
            self.controller.effects.cancel_leases(m.pool.leases(), "the proxy is shutting down now (a second signal)")

    def reload(self) -> ProxyConfig:
        """Re-reads the config; raises ProxyConfigError (and changes nothing) when any profile is invalid."""
        config = load_config(self.config.path, self.overrides)
        self.config = config
        self.controller.post(Reload(config))
        log.info("config reloaded: %d profile(s)", len(config.profiles))
        return config


class Front:
    """The outermost ASGI app. It checks the API key ('Authorization: Bearer KEY' on everything but
    server.protocol.is_open), sends completions straight to the relay and everything else to FastAPI. The relay is raw
    ASGI and needs none of FastAPI's routing or middleware, which would also wrap every streamed chunk."""

    def __init__(self, api: FastAPI, key: str | None):
        self.api, self.expected = api, f"Bearer {key}".encode() if key else None
        self.relays = {("POST", path): Completions(path) for path in MODEL_PATHS}

    @property
    def state(self):
        return self.api.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)  # lifespan
            return
        if self.expected and not is_open(scope["path"]):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if given != self.expected:
                await send_error(send, 401, "invalid or missing API key (Authorization: Bearer KEY)")
                return
        if self.state.proxy.draining and not is_open(scope["path"]):
            await send_api_error(send, shutting_down())
            return
        relay = self.relays.get((scope["method"], scope["path"]))
        if relay is None:
            await self.api(scope, receive, send)
            return
        scope["app"] = self.api  # where the relay finds the Proxy
        await relay(scope, receive, send)


@contextlib.asynccontextmanager
async def start_proxy(config: ProxyConfig, overrides: dict | None = None):
    """Opens the state, settles what an earlier proxy process left behind, runs the controller."""
    state_dir = config.state_dir
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(state_dir / "proxy.db")
    db.execute("PRAGMA journal_mode=WAL")
    store, children = JobStore(db), ChildRegistry(db)
    for job in store.recover("the proxy stopped while this job was unfinished"):
        log.warning("job %s (%s %s) was %s by a proxy restart", job.id, job.type.value, job.model, job.status.value)
    await reap_leftovers(children)
    bus = LogBus()
    handler = BusHandler(bus, asyncio.get_running_loop())
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("tandem.proxy").addHandler(handler)
    supervisor = Supervisor(lambda event: controller.post(event), children, bus, state_dir / "logs",
                            config.settings.log_tail_lines, CorePlan() if config.settings.pin_cpus else None)
    controller = Controller(config, supervisor, store)
    upstream = UpstreamClient()
    proxy = Proxy(config, overrides or {}, db, store, controller, supervisor, bus, ProxyMetrics(), Activity(), upstream)
    run = asyncio.ensure_future(controller.run())
    try:
        yield proxy
    finally:
        run.cancel()
        controller.interrupt("the proxy shut down")
        log.info("shutting down: stopping %d server(s)", len(supervisor.processes))
        await supervisor.shutdown()
        upstream.close()
        logging.getLogger("tandem.proxy").removeHandler(handler)
        db.close()


def create_app(config: ProxyConfig, overrides: dict | None = None) -> Front:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with start_proxy(config, overrides) as proxy:
            app.state.proxy = proxy
            yield

    app = FastAPI(title="tandem proxy", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  responses=ERROR_RESPONSES)
    app.router.routes.append(Route("/upstream/{model}/{path:path}", Upstream(),  # raw ASGI: see proxy.forward
                                   methods=["GET", "POST", "PUT", "DELETE"]))

    def proxy_of(request: Request) -> Proxy:
        return request.app.state.proxy

    install_error_handlers(app, "the proxy")
    install_pages(app, {"/": "chat.html", "/ui": "operator.html"})

    @app.get("/health")
    async def health(request: Request):
        if proxy_of(request).draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.post("/jobs", status_code=202)
    async def submit_job(request: Request):
        try:  # JSON whatever the content type says: `curl -d` sends form encoding
            body = JobRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise APIError(400, "; ".join(validation_problems(e.errors()))) from e
        return await proxy_of(request).controller.submit(body.type, body.model)

    @app.get("/jobs")
    async def list_jobs(request: Request, model: str | None = None, status: JobStatus | None = None,
                        limit: int = 100):
        return proxy_of(request).store.list(model, status, max(1, min(limit, 10_000)))

    @app.get("/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        p = proxy_of(request)
        job = p.controller.jobs.get(job_id) or p.store.get(job_id)
        if job is None:
            raise APIError(404, f"job {job_id!r} not found", "not_found_error")
        return job

    @app.delete("/jobs/{job_id}")
    async def cancel_job(job_id: str, request: Request):
        """Cancels a queued job, or a running load (answered once the servers it started are stopped).
        A running unload cannot be undone (409): its servers are already draining or stopping."""
        return await proxy_of(request).controller.cancel(job_id)

    @app.get("/jobs/{job_id}/log")
    async def job_log(job_id: str, request: Request):
        """The output of the servers a load job started (they keep writing to it while they run)."""
        p = proxy_of(request)
        path = p.config.state_dir / "logs" / f"{job_id}.log"
        if not re.fullmatch(r"[0-9a-f]{32}", job_id) or not path.is_file():
            raise APIError(404, f"job {job_id!r} has no log (only load jobs that started a server have one)",
                           "not_found_error")
        return PlainTextResponse(path.read_text(errors="replace"))

    @app.get("/running")
    async def running(request: Request):
        return {"models": proxy_of(request).controller.running()}

    @app.get("/v1/models")
    async def models(request: Request):
        p = proxy_of(request)
        data = []
        for name, profile in sorted(p.config.profiles.items()):
            m = p.controller.models.get(name)
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "tandem",
                         "status": {"value": m.status.value if m else "unloaded"},
                         "meta": {"model": profile.model, "n_ctx": profile.ctx_size, "parallel": profile.parallel,
                                  "replicas": len(profile.replicas), "autoload": profile.autoload,
                                  "group": profile.group}})
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics(request: Request):
        p = proxy_of(request)
        counts = {s.value: n for s, n in p.store.counts().items()}
        models = [m.snapshot() for m in p.controller.models.values()]
        return PlainTextResponse(p.metrics.render(models, counts), media_type="text/plain; version=0.0.4")

    @app.get("/activity")
    async def activity(request: Request, limit: int = Query(200, ge=1, le=ACTIVITY_SIZE)):
        """The last `limit` requests relayed, oldest first, with their speed from the server's `timings`."""
        return proxy_of(request).activity.recent(limit)

    @app.get("/logs/stream")
    async def logs(request: Request, model: str | None = None):
        bus = proxy_of(request).bus

        async def lines():
            sub = bus.subscribe(model)
            try:
                while True:
                    yield f"data: {json.dumps((await sub.next()).as_dict())}\n\n"
            finally:
                bus.unsubscribe(sub)
        return StreamingResponse(lines(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})

    @app.post("/config/reload")
    async def reload(request: Request):
        try:
            config = proxy_of(request).reload()
        except ProxyConfigError as e:
            raise APIError(400, str(e)) from e
        return {"profiles": sorted(config.profiles)}

    return Front(app, config.settings.api_key)
