"""Servers shared by this folder's modules, one per configuration for the whole run (each start is a model load
and a warm-up). Their key is ``sk-test``; a test on a shared server reads its counters as deltas. And the headless
Chromium that the playground tests drive."""

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from vllm_omni.testing.processes.server import RemoteOmniServer

SHARED_ARGS = ("--api-key", "sk-test")


@pytest.fixture(scope="session")
def flux_server(tiny_flux):
    """The tiny Flux with ``--max-num-seqs 2`` (the chat, playground and edit tests)."""
    with RemoteOmniServer(tiny_flux, [*SHARED_ARGS, "--max-num-seqs", "2"]) as server:
        server.model = tiny_flux
        yield server
    assert server.returncode == 0


@pytest.fixture(scope="session")
def wan_server(tiny_wan):
    """The tiny Wan (text-to-video) at its defaults (the chat and playground tests)."""
    with RemoteOmniServer(tiny_wan, list(SHARED_ARGS)) as server:
        server.model = tiny_wan
        yield server
    assert server.returncode == 0


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Headless, as root, on a closed network: no sandbox (root), no GPU, and none of Chromium's own calls home.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,820",
)


@pytest.fixture
def browser(tmp_path):
    """A headless Chromium (admin/test_playground.py; the audio API's playground test)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    # Both paths given: Selenium does not go looking for (or downloading) a browser or a driver.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()
