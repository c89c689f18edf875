"""`python -m proxy --config configs/proxy.yaml`: one port for many models.

Validates the config (every problem at once, exit code 2), then serves. SIGHUP (or POST
/config/reload) re-reads the profiles; SIGTERM or Ctrl-C drains every model, stops every server the
proxy started and exits 0 (ProxyServer).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import uvicorn

from proxy.app import create_app
from proxy.config import ProxyConfigError, load_config
from server.logs import LOG_FORMATS, LOG_LEVELS, UVICORN_LOG_OPTIONS, setup_logging

log = logging.getLogger("tandem.proxy")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m proxy", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/proxy.yaml", help="proxy YAML (it names the profile files)")
    p.add_argument("--host", help="listen address (default from the config: 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default from the config: 8082)")
    p.add_argument("--state-dir", help="job records, child records and server logs")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every API call "
                                     "(/health, /openapi.json and /docs stay open)")
    p.add_argument("--drain-timeout", type=float, dest="shutdown_drain_timeout",
                   help="seconds running requests get to finish after SIGTERM (default from the config's "
                        "shutdown_drain_timeout, else each profile's drain_timeout)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="least severe log level written")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="text, or json: one object per line")
    p.add_argument("--check", action="store_true", help="validate the config, list the profiles, and exit")
    return p


class ProxyServer(uvicorn.Server):
    """uvicorn plus SIGHUP for a config reload, and a drain on SIGTERM or SIGINT: the models unload
    as unload jobs do (their requests finish within --drain-timeout, or each profile's drain_timeout,
    or end with an in-band error event), then uvicorn stops and the proxy exits 0. A second signal ends the
    running requests at once."""

    _drain: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload)

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's: it would raise the signal again once stopped, and the proxy would exit -15.
        proxy = getattr(self.config.app.state, "proxy", None)
        if proxy is None or not self.started:
            self.should_exit = True
        elif self._drain is None:
            log.info("signal %d: draining before exit (a second signal ends the running requests)", sig)
            self._drain = asyncio.get_event_loop().create_task(proxy.drain())
            self._drain.add_done_callback(lambda _: setattr(self, "should_exit", True))
        else:
            proxy.cut_short()

    def _reload(self) -> None:
        try:
            self.config.app.state.proxy.reload()
        except ProxyConfigError as e:
            log.error("config reload refused; the old config stays:\n%s", e)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    setup_logging(a.log_level, a.log_format)
    overrides = {k: v for k, v in (("host", a.host), ("port", a.port), ("state_dir", a.state_dir),
                                   ("api_key", a.api_key), ("shutdown_drain_timeout", a.shutdown_drain_timeout))
                 if v is not None}
    try:
        config = load_config(a.config, overrides)
    except ProxyConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.check:
        for name, p in sorted(config.profiles.items()):
            print(f"{name}: model {p.model}, {len(p.replicas)} replica(s), ctx {p.ctx_size}, parallel {p.parallel}")
        return 0
    s = config.settings
    # proxy_headers off: it is for deployments behind another proxy, and costs time on every request.
    server = ProxyServer(uvicorn.Config(create_app(config, overrides), host=s.host, port=s.port,
                                        timeout_graceful_shutdown=5, lifespan="on", proxy_headers=False,
                                        **UVICORN_LOG_OPTIONS))
    log.info("proxy on http://%s:%d, %d profile(s), state in %s", s.host, s.port, len(config.profiles),
             config.state_dir)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
