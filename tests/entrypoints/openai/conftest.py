"""Servers shared by this folder's modules, one per configuration for the whole run (each start is a model load
and a warm-up). Their key is ``sk-test``; a test on a shared server reads its counters as deltas."""

import pytest

from vllm_omni.testing.server import RemoteOmniServer

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
