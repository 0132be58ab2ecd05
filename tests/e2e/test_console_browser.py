"""The web console in a real headless Chromium against the real server.

Signs in, creates a topic and a subscription, publishes from the console and
watches the backlog change in place, dead-letters a message through the API
and reprocesses it from the DLQ page, makes a client and rotates its secret.
Every page is checked with axe-core (no serious or critical violation) and
photographed into build/console-screenshots/ (README, "Web console").
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.chromium import launch
from tests.e2e.conftest import Server, base_env, cli

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "build" / "console-screenshots"
AXE_VERSION = "4.14.1"
AXE_CACHE = Path.home() / ".cache" / "fastpubsub" / f"axe-core-{AXE_VERSION}"

from selenium.common.exceptions import StaleElementReferenceException, TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="session")
def axe_source() -> str:
    """axe-core's script, fetched once with `npm pack` into a cache this test owns."""
    script = AXE_CACHE / "package" / "axe.min.js"
    if not script.exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is needed once to fetch axe-core (apt-get install npm)")
        AXE_CACHE.mkdir(parents=True, exist_ok=True)
        packed = subprocess.run(
            ["npm", "pack", f"axe-core@{AXE_VERSION}", "--pack-destination", str(AXE_CACHE), "--silent"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert packed.returncode == 0, packed.stderr
        with tarfile.open(AXE_CACHE / packed.stdout.strip().splitlines()[-1]) as archive:
            archive.extract("package/axe.min.js", AXE_CACHE, filter="data")
    return script.read_text()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    with launch(tmp_path / "chromium-profile") as driver:
        yield driver


def wait_for(driver: WebDriver, condition: Callable[[WebDriver], Any], timeout: float = 20) -> Any:
    """What `condition` returns once it is truthy. An element the page replaced between being found and
    being read (a form's answer loading, a figure redrawn in place) is looked up again, not a failure."""
    waiting = WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,))
    return waiting.until(condition)


def text_of(driver: WebDriver, css: str) -> str:
    """The text of the element `css` finds now, read from the page as it stands (never a replaced element)."""
    return str(wait_for(driver, lambda d: (d.find_element(By.CSS_SELECTOR, css).text,))[0])


def check_page(driver: WebDriver, axe: str, name: str) -> None:
    """No serious or critical axe-core violation on the page; a screenshot of it."""
    driver.execute_script(axe)
    result = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document, {resultTypes: ['violations']})"
        ".then(r => done(r.violations), e => done(String(e)));"
    )
    assert isinstance(result, list), result
    serious = [
        (v["id"], v["help"], [n["target"] for n in v["nodes"]])
        for v in result
        if v["impact"] in ("serious", "critical")
    ]
    assert serious == [], f"{name}: {serious}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    width = driver.get_window_size()["width"]
    driver.set_window_size(width, max(600, min(int(height) + 140, 4000)))
    driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


def fill(driver: WebDriver, css: str, text: str) -> None:
    field = driver.find_element(By.CSS_SELECTOR, css)
    field.clear()
    field.send_keys(text)


def submit(driver: WebDriver, css: str) -> None:
    button = driver.find_element(By.CSS_SELECTOR, css)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
    button.click()


def notice(driver: WebDriver, expected: str) -> str:
    """The page's notice once it says `expected` (the last page's may still be showing); else what it says."""

    def said(d: WebDriver) -> bool:
        return any(shown.text == expected for shown in d.find_elements(By.CSS_SELECTOR, ".notice"))

    with contextlib.suppress(TimeoutException):
        wait_for(driver, said)
    return text_of(driver, ".notice")


def shows(driver: WebDriver, expected: str, timeout: float = 20) -> bool:
    """Whether the page comes to say `expected` within `timeout`. A page read while the browser is still
    putting it up can come back empty on a busy machine, so the page is read again until it says it;
    a page that never does fails with where the browser is and what it shows."""

    def said(d: WebDriver) -> bool:
        return expected in d.page_source

    try:
        wait_for(driver, said, timeout=timeout)
    except TimeoutException:
        where = f"{driver.current_url} ({driver.title!r})"
        raise AssertionError(f"{expected!r} not shown at {where}: {driver.page_source[:2000]!r}") from None
    return True


def backlog_cell(driver: WebDriver, subscription: str) -> str:
    return text_of(driver, f'td[data-figure="backlog"][data-subscription="{subscription}"]')


@pytest.fixture
def secured_server(database_url: str, run_server: Callable[..., Server]) -> Server:
    key = re.search(r"^new_secret=(\S+)$", cli(base_env(database_url), "generate-secret-key"), re.M)
    assert key is not None
    # One worker, sampling every second: the charts have something to show within the test.
    settings = {"auth_enabled": "true", "auth_secret_key": key.group(1), "console_sample_seconds": "1"}
    env = base_env(database_url, **settings)
    return run_server(env, workers=1)


def credentials(server: Server, name: str, scopes: str) -> tuple[str, str]:
    out = cli(server.env, "create-client", name, scopes, "true")
    client_id = re.search(r"^client_id=(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    secret = re.search(r"^client_secret=(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    return client_id, secret


def test_console_from_sign_in_to_dead_letters_and_secrets(
    secured_server: Server, browser: WebDriver, axe_source: str
) -> None:
    server, driver = secured_server, browser
    admin_id, admin_secret = credentials(server, "console admin", "*")
    # Closed however the test ends: a client left open is an unclosed socket warning in a later test.
    with server.client() as api:
        token = api.post("/oauth/token", json={"client_id": admin_id, "client_secret": admin_secret})
        api.headers["Authorization"] = f"Bearer {token.json()['access_token']}"

        # Signing in: the console asks first, and the keyboard reaches the form.
        driver.get(f"{server.url}/console")
        wait_for(driver, lambda d: "/console/login" in d.current_url)
        check_page(driver, axe_source, "01-sign-in")
        driver.find_element(By.TAG_NAME, "body").send_keys(Keys.TAB)
        assert driver.switch_to.active_element.text == "Skip to content"
        fill(driver, "#client_id", admin_id)
        fill(driver, "#client_secret", "wrong")
        submit(driver, "form button[type=submit]")
        assert (
            "invalid client credentials"
            in wait_for(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".error")).text
        )
        fill(driver, "#client_secret", admin_secret)
        driver.find_element(By.CSS_SELECTOR, "#client_secret").send_keys(Keys.ENTER)
        wait_for(driver, lambda d: d.find_element(By.TAG_NAME, "h1").text == "Overview")
        cookies = {c["name"]: c for c in driver.get_cookies()}
        assert cookies["fastpubsub_console_token"]["httpOnly"] is True
        assert cookies["fastpubsub_console_token"]["sameSite"] == "Strict"
        assert driver.execute_script("return document.cookie") == ""  # nothing readable by scripts

        # A topic and a subscription, made from the console.
        fill(driver, "#topic-id", "orders")
        submit(driver, "section[aria-labelledby=new-topic] button")
        assert notice(driver, "Topic created.") == "Topic created."
        fill(driver, "#subscription-id", "emails")
        submit(driver, "section[aria-labelledby=subscribe-heading] button")
        assert notice(driver, "Subscription created.") == "Subscription created."
        assert api.get("/subscriptions/emails").json()["topic_id"] == "orders"

        # Publish from the console: the backlog shows it; a publish elsewhere shows without a reload.
        driver.get(f"{server.url}/console/topics/orders")
        assert backlog_cell(driver, "emails") == "0"
        fill(driver, "#payload", '{"order": 1, "note": "<b>not markup</b>"}')
        submit(driver, "section[aria-labelledby=publish-heading] button")
        assert notice(driver, "Published.") == "Published."
        assert backlog_cell(driver, "emails") == "1"
        assert api.post("/topics/orders/messages", json=[{"order": 2}]).status_code == 204
        wait_for(driver, lambda d: backlog_cell(d, "emails") == "2", timeout=30)
        check_page(driver, axe_source, "03-topic")

        driver.get(f"{server.url}/console")
        assert backlog_cell(driver, "emails") == "2"
        check_page(driver, axe_source, "02-overview")

        # The policy edited in the console: one attempt, then the DLQ.
        driver.get(f"{server.url}/console/subscriptions/emails")
        assert "<b>not markup</b>" in driver.find_element(By.ID, "peek").text  # shown as text, not markup
        fill(driver, "#max_delivery_attempts", "1")
        submit(driver, "section[aria-labelledby=policy-heading] button")
        assert notice(driver, "Subscription updated.") == "Subscription updated."
        assert api.get("/subscriptions/emails").json()["max_delivery_attempts"] == 1
        check_page(driver, axe_source, "04-subscription")

        # Dead-letter one message through the API, reprocess it from the DLQ page.
        leased = api.get(
            "/subscriptions/emails/messages", params={"consumer_id": "w", "batch_size": 1}
        ).json()["data"]
        assert api.post("/subscriptions/emails/nacks", json=[leased[0]["id"]]).status_code == 204
        assert api.get("/subscriptions/emails/metrics").json()["dlq"] == 1
        driver.get(f"{server.url}/console/subscriptions/emails/dlq")
        assert shows(driver, "delivery failed once (the limit is 1)")
        check_page(driver, axe_source, "05-dead-letters")
        box = driver.find_element(By.CSS_SELECTOR, f'input[name=id][value="{leased[0]["id"]}"]')
        box.send_keys(Keys.SPACE)  # by keyboard
        assert box.is_selected()
        submit(driver, "main form button[type=submit]")
        assert (
            notice(driver, "The selected dead letters are deliverable again.")
            == "The selected dead letters are deliverable again."
        )
        metrics = api.get("/subscriptions/emails/metrics").json()
        assert (metrics["dlq"], metrics["available"]) == (0, 2)

        # A client made in the console, then its secret rotated.
        driver.get(f"{server.url}/console/clients")
        fill(driver, "#client-name", "reporting")
        fill(driver, "#client-scopes", "topics:read")
        submit(driver, "section[aria-labelledby=new-client] button")
        new_id = wait_for(driver, lambda d: d.find_element(By.ID, "new-client-id")).text
        first_secret = driver.find_element(By.ID, "new-client-secret").text
        check_page(driver, axe_source, "07-client-secret")
        driver.get(f"{server.url}/console/clients")
        check_page(driver, axe_source, "06-clients")
        submit(driver, f'form[action="/console/clients/{new_id}/secret"] button')
        new_secret = wait_for(driver, lambda d: d.find_element(By.ID, "new-client-secret")).text
        assert new_secret
        assert new_secret != first_secret
        assert shows(driver, "earlier tokens no longer work")
        old = httpx.post(
            f"{server.url}/oauth/token", json={"client_id": new_id, "client_secret": first_secret}
        )
        assert old.status_code == 401
        fresh = httpx.post(
            f"{server.url}/oauth/token", json={"client_id": new_id, "client_secret": new_secret}
        )
        assert fresh.status_code == 201

        # Narrow screens: nothing wider than the window but the tables, which scroll in their own box.
        driver.set_window_size(390, 844)
        driver.get(f"{server.url}/console/topics/orders")
        assert driver.execute_script(
            "return document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        )
        check_page(driver, axe_source, "08-topic-narrow")


def test_console_reads_with_javascript_off_and_says_how_to_make_clients_with_auth_off(
    database_url: str, run_server: Callable[..., Server], tmp_path: Path, axe_source: str
) -> None:
    server = run_server(base_env(database_url), workers=1)
    with server.client() as api:
        api.post("/topics", json={"id": "events"})
        api.post("/subscriptions", json={"id": "audit", "topic_id": "events"})
        api.post("/topics/events/messages", json=[{"n": 1}, {"n": 2}])
    with launch(tmp_path / "profile-no-js", javascript=False) as driver:
        driver.get(f"{server.url}/console")
        assert backlog_cell(driver, "audit") == "2"
        driver.get(f"{server.url}/console/subscriptions/audit")
        assert driver.find_element(By.CSS_SELECTOR, '[data-figure="available"]').text == "2"
        driver.get(f"{server.url}/console/clients")
        note = driver.find_element(By.CSS_SELECTOR, "main .note").text
        assert "fastpubsub create-client" in note
        assert driver.find_elements(By.ID, "client-name") == []
    with launch(tmp_path / "profile-js") as with_js:
        with_js.get(f"{server.url}/console/clients")
        check_page(with_js, axe_source, "09-clients-auth-off")
