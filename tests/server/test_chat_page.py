"""The chat page (`/`) in a headless Chromium, against a tiny-model server started with --api-key:
the page and its files need no key, the page asks for it once, an answer streams in with its timings
line (with the drafts accepted: the server speculates with n-grams), text is shown as text, API
errors show as messages, and the stop button ends a long answer with the slot freed. The tiny model
decodes greedily (temperature 0) without meeting its EOS."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from selenium.webdriver.common.by import By

from bench.browser import chromium, found, give_key_if_asked, send_chat
from bench.processes import wait_until
from tests.server.helpers import wait_idle

KEY = "page-key"


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    # One thread: the other core stays with the browser while the server streams at full speed.
    return start_server(["-m", str(tiny_model), "-c", "32768", "-np", "1", "-t", "1", "--spec-type", "ngram",
                         "--spec-draft-n-max", "3", "--spec-draft-p-min", "0", "--spec-ngram-size-n", "2"],
                        api_key=KEY)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium() as driver:
        yield driver
        driver.save_screenshot(str(tmp_path_factory.mktemp("screenshots") / "chat-page.png"))


@pytest.fixture
def page(server, browser):
    """The chat page, opened with the key already given (it is kept in the browser's storage)."""
    browser.get(server.url + "/")
    if not browser.execute_script("return localStorage.getItem('tandem-api-key')"):
        give_key_if_asked(browser, KEY)
    wait_until(lambda: found(browser, "#model option"), 20, "the model picker")
    return browser


def last_answer(browser):
    return found(browser, ".message.assistant")[-1]


def answer_text(browser) -> str:
    return last_answer(browser).find_element(By.CLASS_NAME, "text").get_attribute("textContent")


def test_the_page_and_its_files_need_no_key_but_the_api_does(server):
    for path in ("/", "/static/chat.js", "/static/api.js", "/static/pages.css"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert httpx.get(server.url + "/").headers["content-type"].startswith("text/html")
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/static/missing.js").status_code == 404


def test_the_page_asks_for_the_key_once(server, browser):
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    give_key_if_asked(browser, KEY)
    wait_until(lambda: found(browser, "#model option"), 20, "the model picker")
    assert browser.find_element(By.ID, "model").get_attribute("value") == server.client().get(
        "/v1/models").json()["data"][0]["id"]
    browser.refresh()
    wait_until(lambda: found(browser, "#model option"), 20, "the model picker after a reload")
    assert found(browser, "#key-form[hidden]") and found(browser, "#error[hidden]")


def test_an_answer_streams_in_with_its_timings_and_text_stays_text(page):
    text = "<script>window.injected = 1</script><b>the cat sat on the mat and the cat sat on the mat</b>"
    send_chat(page, text, temperature=0, max_tokens=48)
    wait_until(lambda: found(page, ".message.assistant .timings"), 30, "the timings line")
    timings = last_answer(page).find_element(By.CLASS_NAME, "timings").text
    drafts = re.fullmatch(r"PP [\d.]+ t/s \(\d+ tokens\) · TG [\d.]+ t/s \(48 tokens\) · drafts accepted (\d+)/(\d+)",
                          timings)
    assert drafts and int(drafts[1]) <= int(drafts[2]), timings
    assert answer_text(page)
    user = found(page, ".message.user .text")[-1]
    assert user.get_attribute("textContent") == text
    assert not found(page, "#history script, #history b")
    assert page.execute_script("return window.injected") is None
    assert not page.find_element(By.ID, "send").get_attribute("disabled")


def test_a_tool_call_shows_as_the_function_and_its_arguments(page):
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}}}]
    page.find_element(By.CSS_SELECTOR, "#tool-settings summary").click()
    page.find_element(By.ID, "tools").send_keys(json.dumps(tools))
    page.find_element(By.CSS_SELECTOR, "#tool-choice option[value='required'], #tool-choice option:nth-child(2)").click()
    try:
        send_chat(page, "Pick a colour.", temperature=0, max_tokens=400)
        wait_until(lambda: found(page, ".message.assistant .timings"), 60, "the timings line")
        call = last_answer(page).find_element(By.CLASS_NAME, "tool-call").get_attribute("textContent")
        shown = re.fullmatch(r"called pick\((.*)\)", call, re.S)
        assert shown and json.loads(shown[1]) in ({"colour": "red"}, {"colour": "blue"}), call
    finally:
        page.find_element(By.ID, "tools").clear()


def test_an_api_error_shows_as_a_message(page):
    send_chat(page, "hello", temperature=-1, max_tokens=8)
    wait_until(lambda: found(page, "#error:not([hidden])"), 20, "the error message")
    assert "temperature" in page.find_element(By.ID, "error").text


def test_stop_ends_a_long_answer_and_frees_the_slot(page, server):
    client = server.client()
    # The tiny model with n-gram drafts runs near 1,000 t/s: the answer must outlast a busy machine's
    # page polling, so it may run half a minute.
    send_chat(page, "tell me everything", temperature=0, max_tokens=30000)
    wait_until(lambda: len(answer_text(page)) > 20, 30, "the answer to stream in")
    assert any(s["is_processing"] for s in client.get("/slots").json())
    page.find_element(By.ID, "stop").click()
    wait_until(lambda: last_answer(page).find_elements(By.CLASS_NAME, "timings"), 10, "the stopped line")
    assert last_answer(page).find_element(By.CLASS_NAME, "timings").text == "stopped"
    wait_idle(client)
    assert not page.find_element(By.ID, "send").get_attribute("disabled")
