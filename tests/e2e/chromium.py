"""Headless Chromium for the browser tests, leaving nothing behind in /tmp.

Chromium puts its profile in `--user-data-dir` (the test's folder), but the
folders holding its singleton socket and scratch files
(`org.chromium.Chromium.*`) go to TMPDIR, and were left there. The driver,
and the browser it starts, get a folder of their own as TMPDIR, removed when
the browser has quit. (Not one inside the test's folder: the socket's path
would be longer than a Unix socket's may be, and Chromium would not start.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")

if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "no Chromium and chromedriver on PATH (apt-get install chromium chromium-driver)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402


@contextlib.contextmanager
def launch(folder: Path, *, javascript: bool = True, window: str = "1280,900") -> Iterator[WebDriver]:
    """A headless Chromium with its profile in `folder`, quit (and its temporary files gone) after."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={folder}",
        f"--window-size={window}",
    ):
        options.add_argument(flag)
    if not javascript:
        options.add_experimental_option("prefs", {"profile.managed_default_content_settings.javascript": 2})
    with tempfile.TemporaryDirectory(prefix="fastpubsub-chromium-") as temporary:
        service = webdriver.ChromeService(CHROMEDRIVER, env={**os.environ, "TMPDIR": temporary})
        driver = webdriver.Chrome(options=options, service=service)
        try:
            yield driver
        finally:
            driver.quit()
