"""`python -m bench.proxy_soak`: bench.soak's clients through a proxy on the shipped profiles, while
the operator's day happens to it: a swap cancelled, the proxy restarted, a server killed.

    python -m bench.proxy_soak [--minutes 10] [--clients 16] [--model smollm2] [--swap-to smollm2-mtp]
                               [--json FILE]

Starts `python -m proxy` on a free loopback port and a fresh state directory, with the profiles of
configs/profiles/ and the settings of configs/proxy.yaml (groups, queue limit, CPU pinning), loads
`--model`, and runs bench.soak's clients against it, naming the model in each request. Meanwhile:
- at a quarter of the time, a load of `--swap-to` (the same exclusive group), cancelled once it has
  unloaded the model: the model must be serving again (a restore job);
- at half, SIGTERM on the proxy: it must drain, exit 0 and leave no server running; then it is
  started again on the same port and state directory, and the next request autoloads the model;
- at three quarters, SIGKILL on the model's server: the proxy must start it again.
Reported: bench.soak's tally (lost and other 5xx: none allowed; cut streams and 503s each with
their reason), what each event took, and the job history the proxy kept.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import yaml

from bench.processes import ROOT, ProxyProcess, alive, wait_until
from bench.soak import Tally, soak

READY_TIMEOUT = 180.0  # a model's load, or a restart, on a busy machine


def shipped_proxy(root: Path) -> ProxyProcess:
    """A proxy with the shipped profiles and settings, on its own port and state directory."""
    profiles: dict = {}
    for path in sorted((ROOT / "configs" / "profiles").glob("*.yaml")):
        profiles.update(yaml.safe_load(path.read_text()))
    shipped = yaml.safe_load((ROOT / "configs" / "proxy.yaml").read_text())
    proxy = ProxyProcess(root, profiles, shipped.get("groups"))
    own = yaml.safe_load((root / "proxy.yaml").read_text())
    kept = {k: v for k, v in shipped.items() if k not in ("host", "port", "state_dir", "profiles")}
    (root / "proxy.yaml").write_text(yaml.safe_dump({**kept, **own}))
    return proxy


def serving(proxy: ProxyProcess, model: str) -> list[dict]:
    return [r for r in proxy.replicas(model) if r["state"] == "ready"]


# The events block while they wait on the proxy and its processes: each runs in a thread of its own
# (operate), beside the clients on the event loop.

def cancel_swap(proxy: ProxyProcess, model: str, swap_to: str) -> dict:
    load = proxy.client.post("/jobs", json={"type": "load", "model": swap_to}).json()
    wait_until(lambda: not proxy.replicas(model), READY_TIMEOUT, f"{model!r} to make way for {swap_to!r}", 0.2)
    time.sleep(2)  # the new model's server is starting
    t0 = time.monotonic()
    cancelled = proxy.client.delete(f"/jobs/{load['id']}").json()
    wait_until(lambda: serving(proxy, model), READY_TIMEOUT, f"{model!r} to be loaded back", 0.2)
    return {"event": f"load of {swap_to!r} cancelled after it unloaded {model!r}",
            "answer": cancelled.get("message"), "serving_again_after_s": round(time.monotonic() - t0, 1)}


def stop_proxy(proxy: ProxyProcess) -> tuple[int, list[int]]:
    """SIGTERM, as an operator stops it: its exit code, and the servers it started still running."""
    servers = proxy.descendants()
    proxy.proc.send_signal(signal.SIGTERM)
    code = proxy.proc.wait(READY_TIMEOUT)
    return code, [pid for pid in servers if alive(pid)]


def restart_proxy(proxy: ProxyProcess, model: str) -> dict:
    t0 = time.monotonic()
    code, left = stop_proxy(proxy)
    drained = time.monotonic() - t0
    proxy.start()
    wait_until(lambda: serving(proxy, model), READY_TIMEOUT, f"{model!r} to autoload after the restart", 0.2)
    return {"event": "SIGTERM on the proxy, then started again", "exit_code": code, "drained_s": round(drained, 1),
            "servers_left_running": left, "serving_again_after_s": round(time.monotonic() - t0, 1)}


def kill_server(proxy: ProxyProcess, model: str) -> dict:
    [replica] = serving(proxy, model)
    t0 = time.monotonic()
    os.kill(replica["pid"], signal.SIGKILL)
    wait_until(lambda: any(r["pid"] != replica["pid"] for r in serving(proxy, model)), READY_TIMEOUT,
               f"{model!r} to be restarted", 0.2)
    return {"event": f"SIGKILL on {model!r}'s server (pid {replica['pid']})",
            "serving_again_after_s": round(time.monotonic() - t0, 1)}


async def operate(proxy: ProxyProcess, model: str, swap_to: str, seconds: float, events: list[dict]) -> None:
    """The three events at a quarter, a half and three quarters of the time; each one's outcome (or
    its failure) goes into `events`."""
    start = time.monotonic()
    for at, event, args in ((0.25, cancel_swap, (proxy, model, swap_to)), (0.5, restart_proxy, (proxy, model)),
                            (0.75, kill_server, (proxy, model))):
        await asyncio.sleep(max(0.0, start + at * seconds - time.monotonic()))
        began = time.monotonic() - start
        try:
            outcome = await asyncio.to_thread(event, *args)
        except Exception as e:  # noqa: BLE001 - an event that failed is reported, and the soak goes on
            outcome = {"event": "failed", "error": f"{type(e).__name__}: {e}"}
        events.append({"at_s": round(began, 1), **outcome})
        print(json.dumps(events[-1]), flush=True)


async def run(proxy: ProxyProcess, tally: Tally, a: argparse.Namespace, events: list[dict]) -> None:
    seconds = 60 * a.minutes
    await asyncio.gather(soak(proxy.url, tally, a.clients, seconds, a.max_words, a.model),
                         operate(proxy, a.model, a.swap_to, seconds, events))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.proxy_soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--model", default="smollm2", help="a profile of configs/profiles/")
    ap.add_argument("--swap-to", default="smollm2-mtp", help="a profile in the model's exclusive group")
    ap.add_argument("--max-words", type=int, default=400, help="longest prompt, in words")
    ap.add_argument("--json", type=Path, help="write the summary here")
    a = ap.parse_args()
    proxy = shipped_proxy(Path(tempfile.mkdtemp(prefix="proxy-soak-")))
    events: list[dict] = []
    try:
        proxy.start()
        load = proxy.job("load", a.model, timeout=READY_TIMEOUT)
        assert load["status"] == "succeeded", load
        tally = Tally(f"proxy {a.model}")
        print(f"{a.clients} clients for {a.minutes} min through the proxy at {proxy.url} (logs in {proxy.root})",
              flush=True)
        asyncio.run(run(proxy, tally, a, events))
        history = [f"{j['type']} {j['model']} ({j['trigger']}): {j['status']}: {j.get('message') or ''}"
                   for j in reversed(proxy.client.get("/jobs").json())]
        exit_code, left = stop_proxy(proxy)
    finally:
        proxy.kill_all()
    summary = {**tally.summary(), "events": events, "final_exit_code": exit_code, "servers_left_running": left,
               "jobs": history, "logs": str(proxy.root)}
    print(json.dumps(summary, indent=1), flush=True)
    if a.json:
        a.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
