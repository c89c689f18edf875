"""The routes that relay to servers: those whose body names the model (completions, and the
tokenizer endpoints a client needs to build exact prompts: a slot per request, queued when all are
busy, loading the model when it autoloads) and /upstream/{model}/{path} (straight to a replica, no
slot: for /props, /slots, /metrics)."""
from __future__ import annotations

import asyncio
import json
from urllib.parse import parse_qsl, urlencode

from proxy.forward import ClientGone, DisconnectWatch, read_body, relay, send_api_error, send_error
from server.protocol import COMPLETION_PATHS, APIError, body_problem

BODY_LIMIT = 32 * 2**20
MODEL_PATHS = COMPLETION_PATHS + ("/tokenize", "/detokenize", "/apply-template", "/v1/messages/count_tokens")


def model_of(body: bytes) -> tuple[str | None, str | None]:
    """(model, None) or (None, why the body names no model)."""
    problem = body_problem(body)
    if problem:
        return None, problem
    try:
        data = json.loads(body)
    except ValueError:
        return None, "the request body is not valid JSON"
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str) or not model:
        return None, "model: required (the name of a configured profile; GET /v1/models lists them)"
    return model, None


async def _body(receive, send) -> bytes | None:
    """The request's body; None when the client left, or when it was too large (answered 413)."""
    try:
        body = await read_body(receive, BODY_LIMIT)
    except ClientGone:
        return None
    if body is None:
        await send_error(send, 413, f"request body larger than {BODY_LIMIT} bytes")
    return body


class Completions:
    """Raw ASGI endpoint for one path of MODEL_PATHS; the running Proxy is the app's `state.proxy`."""

    def __init__(self, path: str):
        self.path = path

    async def __call__(self, scope, receive, send) -> None:
        p = scope["app"].state.proxy
        body = await _body(receive, send)
        if body is None:
            return
        model, problem = model_of(body)
        if problem:
            await send_error(send, 400, problem)
            return
        watch = DisconnectWatch(receive)
        lease = None
        try:
            try:
                lease = await p.controller.acquire(model)
            except APIError as e:
                watch.disarm()
                # an unknown name is not a label: clients could otherwise grow /metrics without bound
                p.metrics.on_request(model if model in p.controller.models else "(unknown)", e.status, None)
                await send_api_error(send, e)
                return
            replica = lease.replica
            outcome = await relay(scope, send, watch, p.upstream, replica.port, self.path, body,
                                  why_cancelled=lambda: lease.cancel_reason)
            p.metrics.on_request(model, outcome.status, outcome.timings)
            if outcome.timings:
                p.activity.record(model, outcome.timings)
            p.controller.release(lease, outcome.failure)
            lease = None
        except asyncio.CancelledError:
            if not (watch.fired or (lease is not None and lease.cancel_reason)):
                raise  # the proxy itself is stopping
            asyncio.current_task().uncancel()  # handled: the client left, or was told why it was cut off
        finally:
            watch.close()
            if lease is not None:
                p.controller.release(lease)


class Upstream:
    """/upstream/{model}/{path}?replica=N: a replica's own endpoint. No slot is taken, so a
    monitoring call never waits behind generation."""

    async def __call__(self, scope, receive, send) -> None:
        p = scope["app"].state.proxy
        model, path = scope["path_params"]["model"], "/" + scope["path_params"]["path"]
        body = await _body(receive, send)
        if body is None:
            return
        query = parse_qsl(scope.get("query_string", b"").decode(), keep_blank_values=True)
        wanted = next((v for k, v in query if k == "replica"), None)
        m = p.controller.models.get(model)
        if m is None:
            e = p.controller.unknown_model(model)
            await send_error(send, e.status, e.message, e.type)
            return
        live = [r for r in m.pool.replicas if r.serving]
        if wanted is not None:
            live = [r for r in live if str(r.index) == wanted]
        if not live:
            which = f" replica {wanted}" if wanted is not None else ""
            await send_error(send, 503, f"model {model!r}{which} has no running server ({m.status.value})")
            return
        replica = min(live, key=lambda r: (r.busy, r.index))
        scope = {**scope, "query_string": urlencode([(k, v) for k, v in query if k != "replica"]).encode()}
        watch = DisconnectWatch(receive)
        try:
            await relay(scope, send, watch, p.upstream, replica.port, path, body)
        except asyncio.CancelledError:
            if not watch.fired:
                raise
            asyncio.current_task().uncancel()
        finally:
            watch.close()
