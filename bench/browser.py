"""A headless Chromium driven by Selenium, for the page tests and bench.screenshots: the OS's own
browser and driver (Debian's `chromium` and `chromium-driver`, built together), with a fresh profile
that is removed when the driver quits."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from bench.processes import wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def chromium(width: int = 1280, height: int = 860) -> Iterator[webdriver.Chrome]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not found: install them with "
                           f"`apt-get install -y chromium chromium-driver`")
    profile = tempfile.mkdtemp(prefix="tandem-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS + [f"--user-data-dir={profile}", f"--window-size={width},{height}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def found(driver: webdriver.Chrome, css: str) -> list:
    """The elements matching `css` now (none is not an error: callers poll)."""
    return driver.find_elements(By.CSS_SELECTOR, css)


def give_key_if_asked(driver: webdriver.Chrome, key: str, timeout: float = 10) -> None:
    """Answers the page's API key form, once it shows (a page asks when a call is refused)."""
    wait_until(lambda: found(driver, "#key-form:not([hidden])"), timeout, "the API key form")
    driver.find_element(By.ID, "api-key").send_keys(key, Keys.ENTER)


def send_chat(driver: webdriver.Chrome, text: str, temperature: float, max_tokens: int) -> None:
    """Sends `text` from the chat page with these settings; the answer streams into the last
    `.message.assistant`, whose `.timings` line appears when it ends."""
    for field, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()
