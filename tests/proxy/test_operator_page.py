"""The proxy's pages in a headless Chromium, with the proxy's API key set: the operator page (`/ui`)
loads and unloads a model with its buttons and shows the jobs, their durations and a failed load's
reason; the chat page on the proxy's port picks a model, shows its output as text however much it
looks like markup, sends the whole conversation, and cancels a load in progress; the chart's
/activity holds what the servers reported. The servers are tests/proxy/fake_server.py: they start
at once and answer a script, or never get ready."""
from __future__ import annotations

import re

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from bench.browser import chromium, found, give_key_if_asked, send_chat
from bench.processes import wait_until
from tests.proxy.conftest import fake_profile

KEY = "operator-key"
REPLY = "<script>window.injected = 1</script> <b>bold</b> <img src=x onerror=window.injected=2>"


@pytest.fixture(scope="module")
def proxy(make_proxy):
    p = make_proxy({"fake": fake_profile("serve"), "broken": fake_profile("killed"),
                    "echo": fake_profile("serve", env={"FAKE_REPLY": REPLY}, autoload=True),
                    "slow": fake_profile("slow", autoload=True)}, api_key=KEY)
    p.client.headers["authorization"] = f"Bearer {KEY}"
    return p


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium() as driver:
        yield driver
        driver.save_screenshot(str(tmp_path_factory.mktemp("screenshots") / "operator-page.png"))


def open_page(browser, url: str, ready_css: str):
    browser.get(url)
    if not browser.execute_script("return localStorage.getItem('tandem-api-key')"):
        give_key_if_asked(browser, KEY)
    wait_until(lambda: found(browser, ready_css), 20, f"{ready_css} on {url}")
    return browser


def model_state(browser, model: str) -> str:
    cells = found(browser, f'#models tr[data-model="{model}"] td.status')
    return cells[0].text if cells else ""


def job_rows(browser, model: str, type_: str) -> list[list[str]]:
    """The job table's rows for `model` and `type_`, newest first, as their cells' texts."""
    # Read in one go: the page rebuilds the job table at every refresh.
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#jobs tbody tr')].map(r => [...r.cells].map(c => c.innerText))")
    return [r for r in rows if r[1:3] == [type_, model]]


def test_the_pages_need_no_key_the_api_does_and_activity_checks_its_limit(proxy):
    for path in ("/", "/ui", "/static/operator.js", "/static/chat.js"):
        assert httpx.get(proxy.url + path).status_code == 200, path
    assert httpx.get(proxy.url + "/activity").status_code == 401
    for limit in ("0", "1001", "x"):
        r = proxy.client.get("/activity", params={"limit": limit})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("limit: "), r.text


def test_the_pages_ask_for_the_key_once(proxy, browser):
    browser.get(proxy.url + "/ui")
    browser.execute_script("localStorage.clear()")
    open_page(browser, proxy.url + "/ui", '#models tr[data-model="fake"]')
    open_page(browser, proxy.url + "/", "#model option")
    assert found(browser, "#key-form[hidden]") and found(browser, "#error[hidden]")


def test_load_and_unload_buttons_run_jobs_shown_with_their_durations(proxy, browser):
    open_page(browser, proxy.url + "/ui", '#models tr[data-model="fake"]')
    assert model_state(browser, "fake") == "unloaded"
    browser.find_element(By.CSS_SELECTOR, '#models tr[data-model="fake"] button.load').click()
    wait_until(lambda: model_state(browser, "fake") == "ready", 30, "fake to turn ready")
    wait_until(lambda: job_rows(browser, "fake", "load") and job_rows(browser, "fake", "load")[0][4] == "succeeded",
               10, "the load job to show as succeeded")
    assert re.fullmatch(r"\d+\.\d s", job_rows(browser, "fake", "load")[0][5])
    replicas = browser.find_element(By.CSS_SELECTOR, '#models tr[data-model="fake"]').find_elements(By.TAG_NAME, "td")
    assert replicas[2].text == "1 / 1" and replicas[3].text == "0 / 1"
    browser.find_element(By.CSS_SELECTOR, '#models tr[data-model="fake"] button.unload').click()
    wait_until(lambda: model_state(browser, "fake") == "unloaded", 30, "fake to unload")
    wait_until(lambda: job_rows(browser, "fake", "unload") and job_rows(browser, "fake", "unload")[0][4] == "succeeded",
               10, "the unload job to show as succeeded")
    assert proxy.replicas("fake") == []


def test_a_model_that_cannot_start_shows_its_failed_job_and_reason(proxy, browser):
    open_page(browser, proxy.url + "/ui", '#models tr[data-model="broken"]')
    browser.find_element(By.CSS_SELECTOR, '#models tr[data-model="broken"] button.load').click()
    wait_until(lambda: job_rows(browser, "broken", "load") and job_rows(browser, "broken", "load")[0][4] == "failed",
               30, "the load job to fail")
    job = proxy.client.get("/jobs", params={"model": "broken"}).json()[0]
    assert job["error"] and job_rows(browser, "broken", "load")[0][6] == job["error"]
    models = {m["id"]: m["status"]["value"] for m in proxy.client.get("/v1/models").json()["data"]}
    wait_until(lambda: model_state(browser, "broken") == models["broken"], 5, "the model's state as the API gives it")


def test_the_proxys_chat_page_shows_model_output_as_text_and_the_chart_counts_it(proxy, browser):
    open_page(browser, proxy.url + "/", '#model option[value="echo"]')
    Select(browser.find_element(By.ID, "model")).select_by_value("echo")
    send_chat(browser, "hi", temperature=0.5, max_tokens=16)
    wait_until(lambda: found(browser, ".message.assistant .timings"), 30, "the answer's timings line")
    answer = found(browser, ".message.assistant")[-1]
    assert answer.find_element(By.CLASS_NAME, "text").get_attribute("textContent") == REPLY
    assert answer.find_element(By.CLASS_NAME, "timings").text.startswith("PP 300.0 t/s (1 token) · TG 30.0 t/s")
    assert not found(browser, "#history script, #history b, #history img")
    assert browser.execute_script("return window.injected") is None
    wait_until(lambda: browser.find_element(By.ID, "model-status").text == "ready", 10, "the autoloaded model's state")
    send_chat(browser, "and again", temperature=0.5, max_tokens=16)
    wait_until(lambda: len(found(browser, ".message.assistant .timings")) == 2, 30, "the second answer")
    # the fake server counts the messages it was sent as prompt tokens: the whole history went
    assert found(browser, ".message.assistant .timings")[-1].text.startswith("PP 300.0 t/s (3 tokens)")

    activity = proxy.client.get("/activity", params={"limit": 5}).json()
    assert activity[-1]["model"] == "echo" and activity[-1]["predicted_per_second"] == 30.0
    open_page(browser, proxy.url + "/ui", "#chart[data-requests]")
    assert int(browser.find_element(By.ID, "chart").get_attribute("data-requests")) == len(
        proxy.client.get("/activity").json())


def test_the_chat_page_cancels_a_load_in_progress_and_says_why_the_request_ended(proxy, browser):
    open_page(browser, proxy.url + "/", '#model option[value="slow"]')
    Select(browser.find_element(By.ID, "model")).select_by_value("slow")
    send_chat(browser, "hi", temperature=0.5, max_tokens=16)
    wait_until(lambda: browser.find_element(By.ID, "model-status").text == "loading", 10, "the autoload to start")
    browser.find_element(By.ID, "cancel-load").click()
    wait_until(lambda: found(browser, "#error:not([hidden])"), 30, "the waiting request's error")
    [load] = [j for j in proxy.client.get("/jobs", params={"model": "slow"}).json() if j["type"] == "load"]
    assert load["status"] == "cancelled" and load["id"] in browser.find_element(By.ID, "error").text
    wait_until(lambda: browser.find_element(By.ID, "model-status").text == "unloaded", 10, "the model to unload")
    assert not browser.find_element(By.ID, "cancel-load").is_displayed()
