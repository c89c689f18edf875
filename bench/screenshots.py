"""python -m bench.screenshots [--out docs]: screenshots of the browser pages, for the docs.

Starts a server on the default model with its MTP draft (real answers, drafts accepted shown) and
a proxy on a tiny random model (configs/tiny/llama.json: quick to load and unload), drives the
chat page of the server and the operator page of the proxy in a headless Chromium
(bench.browser), and writes chat-page.png and operator-page.png."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from bench.browser import chromium, found, send_chat
from bench.processes import ROOT, ProxyProcess, ServerProcess, wait_until
from engine.cli.tiny import tiny_config, write_tiny_model

WIDTH, CHAT_HEIGHT, OPERATOR_HEIGHT = 1100, 760, 1060  # the operator page shows whole
QUESTIONS = ("Hello! What can you do?", "Write a haiku about speculative decoding.")


def chat_page(driver, url: str, out: Path) -> None:
    driver.get(url + "/")
    wait_until(lambda: found(driver, "#model option"), 30, "the chat page's model picker")
    for question in QUESTIONS:
        answers = len(found(driver, ".message.assistant .timings"))
        send_chat(driver, question, temperature=0, max_tokens=64)
        wait_until(lambda: len(found(driver, ".message.assistant .timings")) > answers, 120, "an answer")
    driver.save_screenshot(str(out / "chat-page.png"))


def operator_page(driver, proxy: ProxyProcess, out: Path) -> None:
    driver.set_window_size(WIDTH, OPERATOR_HEIGHT)
    driver.get(proxy.url + "/ui")
    wait_until(lambda: found(driver, '#models tr[data-model="tiny"]'), 30, "the operator page")
    for model in ("tiny", "broken"):
        driver.find_element(By.CSS_SELECTOR, f'#models tr[data-model="{model}"] button.load').click()
    wait_until(lambda: found(driver, '#models tr[data-model="tiny"] td.status.ready'), 180, "tiny to load")
    for n in range(12):
        r = proxy.client.post("/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 16 + 24 * n, "temperature": 0,
            "messages": [{"role": "user", "content": "word " * (40 * n + 8)}]})
        r.raise_for_status()
    Select(driver.find_element(By.ID, "log-model")).select_by_value("tiny")
    wait_until(lambda: driver.find_element(By.ID, "chart").get_attribute("data-requests") == "12", 10, "the chart")
    wait_until(lambda: driver.find_element(By.ID, "log").text, 10, "the log")
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(out / "operator-page.png"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.screenshots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for the PNG files (default: docs)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-screenshots-") as tmp:
        tmp = Path(tmp)
        model = write_tiny_model(tiny_config(), tmp / "tiny", seed=0)
        server_args = ["-m", str(model), "-c", "4096", "-np", "1"]
        server = ServerProcess(["-m", "default", "--dtype", "int8", "--spec-type", "draft-mtp", "-md", "default"],
                               tmp / "server.log")
        proxy = ProxyProcess(tmp / "proxy", {
            "tiny": {"args": [*server_args, "-t", "1"], "health_timeout": 180},
            "broken": {"args": ["-m", str(tmp / "no-such-model"), "-t", "1"], "health_timeout": 60}})
        try:
            server.wait_ready()
            proxy.start()
            with chromium(WIDTH, CHAT_HEIGHT) as driver:
                chat_page(driver, server.url, args.out)
                operator_page(driver, proxy, args.out)
        finally:
            server.kill()
            proxy.kill_all()
    print(f"wrote {args.out / 'chat-page.png'} and {args.out / 'operator-page.png'}")


if __name__ == "__main__":
    main()
