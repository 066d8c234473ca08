"""The playground page at ``/`` and ``/playground``: served without the API key by a real server, off with
``--disable-playground``, self-contained, and driven end to end in a real headless Chromium."""

import os
import re
import shutil

import httpx
import pytest
from fastapi.testclient import TestClient
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args
from vllm_omni.entrypoints.openai.app import build_app

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-test"  # the shared servers' (conftest.py)
PAGES = ("/", "/playground")
GENERATION_TIMEOUT_S = 300
"""Generous: CI is a busy 2-core machine; the wait ends as soon as the page says it is done."""


@pytest.fixture
def server(flux_server):
    return flux_server


@pytest.mark.parametrize("path", PAGES)
def test_the_page_is_served_without_the_api_key(server, path):
    response = httpx.get(server.base_url + path, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    for element in ('<form id="form"', 'id="api-key"', 'id="prompt"', 'id="partial-images"', 'id="generate"'):
        assert element in response.text


def test_the_api_still_needs_the_key(server):
    assert httpx.get(server.url_for("v1", "models"), timeout=60).status_code == 401
    keyed = httpx.get(server.url_for("v1", "models"), headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert keyed.status_code == 200


def test_the_page_fetches_nothing_from_elsewhere(server):
    page = httpx.get(server.base_url + "/", timeout=60).text
    assert not re.search(r"https?://", page)
    # No stylesheet, script, font or image from anywhere: everything is inline, the API is reached by relative URLs.
    assert not re.search(r"<script[^>]*\bsrc=|@import|url\(", page)
    assert re.findall(r"\b(?:src|href|action)=\"([^\"]*)\"", page) == ["data:,"]  # the empty favicon
    api_urls = re.findall(r"const (?:IMAGES|VIDEOS|AUDIO)_URL = \"([^\"]*)\"", page)
    assert api_urls == ["v1/images/generations", "v1/videos", "v1/audio/generate"]


@pytest.mark.parametrize(("flags", "status"), [((), 200), (("--disable-playground",), 404)])
def test_disable_playground_takes_the_page_away(tiny_flux, flags, status):
    parser = make_serve_parser("vllm serve")
    args, explicit = parse_serve_args(parser, [tiny_flux, "--api-key", API_KEY, *flags])
    model, stages, serving = build_serve_config(parser, args, explicit)
    client = TestClient(build_app(model, stages, serving, on_fatal=print))  # no `with`: the model does not load
    for path in PAGES:
        assert client.get(path).status_code == status
    assert client.get("/v1/models").status_code == 401  # the API is there either way


def _fill(browser, field_id: str, text: str) -> None:
    field = browser.find_element(By.ID, field_id)
    field.clear()
    field.send_keys(text)


def _finished_state(browser) -> str:
    """Wait until the page's run is over (``done`` or ``error``, never a fixed sleep) and return that state."""
    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, GENERATION_TIMEOUT_S).until(
        lambda _: status.get_attribute("data-state") in ("done", "error")
    )
    return status.get_attribute("data-state")


@pytest.mark.browser
def test_a_browser_streams_partial_images_then_shows_the_image(server, browser, tmp_path):
    browser.get(server.url_for("playground"))
    _fill(browser, "api-key", API_KEY)
    _fill(browser, "prompt", "a lighthouse on a cliff at sunset, oil painting")
    _fill(browser, "size", "256x256")
    _fill(browser, "steps", "8")
    _fill(browser, "seed", "7")
    _fill(browser, "partial-images", "2")
    browser.find_element(By.ID, "generate").click()

    state = _finished_state(browser)
    assert state == "done", browser.find_element(By.ID, "error").text
    status = browser.find_element(By.ID, "status")
    assert int(status.get_attribute("data-partials")) >= 1
    final = browser.find_element(By.ID, "final-image-0")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", final) == 256
    assert "batch size 1" in browser.find_element(By.ID, "results").text

    screenshot = tmp_path / "playground.png"
    assert browser.save_screenshot(str(screenshot))
    if os.environ.get("PLAYGROUND_SCREENSHOT"):  # how docs/images/playground.png is made
        shutil.copyfile(screenshot, os.environ["PLAYGROUND_SCREENSHOT"])


@pytest.mark.browser
def test_a_browser_shows_the_api_error_of_a_wrong_key(server, browser):
    browser.get(server.base_url + "/")
    _fill(browser, "api-key", "sk-wrong")
    browser.find_element(By.ID, "generate").click()

    assert _finished_state(browser) == "error"
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed() and "Missing or invalid API key" in error.text


@pytest.fixture
def video_server(wan_server):
    return wan_server


@pytest.mark.browser
def test_a_browser_runs_a_video_job_into_the_video_element(video_server, browser):
    browser.get(video_server.base_url + "/")
    _fill(browser, "api-key", API_KEY)
    Select(browser.find_element(By.ID, "mode")).select_by_value("video")
    _fill(browser, "prompt", "a cat running")
    _fill(browser, "size", "32x32")
    _fill(browser, "steps", "2")
    _fill(browser, "partial-images", "1")
    browser.find_element(By.ID, "generate").click()

    state = _finished_state(browser)
    assert state == "done", browser.find_element(By.ID, "error").text
    assert browser.find_element(By.ID, "progress").get_attribute("value") == "100"
    player = browser.find_element(By.ID, "final-video")
    assert player.is_displayed() and player.get_attribute("src").startswith("blob:")
    # The MP4 the job made: played by the <video> element, or offered for download where Chromium lacks H.264.
    playable = browser.execute_script("return arguments[0].readyState >= 1", player)
    link = browser.find_element(By.CSS_SELECTOR, "#summary a")
    assert playable or "cannot play" in browser.find_element(By.ID, "summary").text
    assert link.get_attribute("download").endswith(".mp4")
