"""Swagger UI in a real headless Chromium: it renders from the server's own assets,
"Authorize" obtains a token with OAuth2 client credentials, and "Try it out" then
calls a protected endpoint with it."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.chromium import launch
from tests.e2e.conftest import Server, base_env, cli

pytestmark = [pytest.mark.browser, pytest.mark.slow]

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    with launch(tmp_path / "chromium", window="1400,1000") as driver:
        yield driver


def chromium_leftovers() -> set[Path]:
    temporary = Path(tempfile.gettempdir())
    return {*temporary.glob("org.chromium.*"), *temporary.glob(".org.chromium.*")}


def test_chromium_leaves_no_temporary_files_behind(tmp_path: Path) -> None:
    before = chromium_leftovers()
    with launch(tmp_path / "chromium") as driver:
        driver.get("about:blank")
        temporary = Path(driver.service.env["TMPDIR"])  # type: ignore[attr-defined]
        kept = [path.name for path in temporary.iterdir()]
        assert any(name.startswith("org.chromium.") for name in kept), kept  # (where they went)
    assert not temporary.exists()
    assert chromium_leftovers() - before == set()


@pytest.fixture
def secured_server(database_url: str, run_server: Callable[..., Server]) -> Server:
    key = re.search(r"^new_secret=(\S+)$", cli(base_env(database_url), "generate-secret-key"), re.M)
    assert key is not None
    return run_server(base_env(database_url, auth_enabled="true", auth_secret_key=key.group(1)))


def visible(driver: WebDriver, css: str, timeout: float = 20) -> WebElement:
    element: WebElement = WebDriverWait(driver, timeout).until(
        ec.visibility_of_element_located((By.CSS_SELECTOR, css))
    )
    return element


def click(driver: WebDriver, css: str) -> None:
    element = visible(driver, css)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
    element.click()


def test_authorize_with_client_credentials_then_try_an_endpoint(
    secured_server: Server, browser: WebDriver
) -> None:
    out = cli(secured_server.env, "create-client", "docs reader", "topics:read", "true")
    client_id = re.search(r"^client_id=(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    secret = re.search(r"^client_secret=(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    with secured_server.client() as http:
        assert http.get("/topics").status_code == 401  # the endpoint below really needs the token

    browser.get(f"{secured_server.url}/docs")
    # The page only renders if swagger-ui-bundle.js came from this server.
    visible(browser, "#operations-topics-list_topics")
    assert "fastpubsub" in browser.title

    click(browser, "button.btn.authorize")
    visible(browser, ".modal-ux")
    browser.find_element(By.CSS_SELECTOR, "input[data-name='clientId']").send_keys(client_id)
    browser.find_element(By.CSS_SELECTOR, "input[data-name='clientSecret']").send_keys(secret)
    click(browser, ".modal-ux .auth-btn-wrapper button.authorize")
    # Swagger UI swaps the Authorize button for Logout once the token endpoint answered.
    try:
        WebDriverWait(browser, 20).until(
            lambda d: any(
                b.text == "Logout" for b in d.find_elements(By.CSS_SELECTOR, ".modal-ux button.auth")
            )
        )
    except TimeoutException:
        modal = browser.find_element(By.CSS_SELECTOR, ".modal-ux").get_attribute("innerHTML")
        pytest.fail(f"no token after Authorize; the dialog shows:\n{modal}")
    errors = browser.find_elements(By.CSS_SELECTOR, ".modal-ux .errors")
    assert not [e.text for e in errors if e.text.strip()]
    click(browser, ".modal-ux button.btn-done, .modal-ux button.close-modal")

    click(browser, "#operations-topics-list_topics .opblock-summary")
    click(browser, "#operations-topics-list_topics button.try-out__btn")
    click(browser, "#operations-topics-list_topics button.execute")
    status = visible(
        browser, "#operations-topics-list_topics .live-responses-table tr.response .response-col_status"
    )
    assert status.text.strip().startswith("200"), status.text
    body = visible(
        browser, "#operations-topics-list_topics .live-responses-table tr.response .response-col_description"
    )
    assert '"data"' in body.text
