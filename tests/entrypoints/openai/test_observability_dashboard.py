"""examples/observability/vllm_omni_dashboard.json against the shared Flux server: every metric a panel queries is
in its ``/metrics`` (with the type the query assumes; a histogram with samples once a request ran), and the
matplotlib renderer evaluates every panel from two real scrapes and writes its PNG."""

import importlib
import re
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "observability"
AUTH = {"Authorization": "Bearer sk-test"}  # the shared servers' key (conftest.py)
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def examples():
    """``(promql_subset, render_dashboard)``, imported from the example's folder as its script imports them."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("promql_subset"), importlib.import_module("render_dashboard")
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def scrapes(flux_server):
    """Two ``(time, /metrics text)`` of the shared Flux server, each after an image request."""
    taken = []
    for seed in (1, 2):
        body = {"prompt": "a red cube", "size": "32x32", "num_inference_steps": 2, "seed": seed}
        answer = httpx.post(flux_server.url_for("v1", "images", "generations"), json=body, headers=AUTH, timeout=300)
        assert answer.status_code == 200, answer.text
        taken.append((float(len(taken)), httpx.get(flux_server.url_for("metrics"), timeout=60).text))
    return taken


def declared(text: str) -> dict[str, str]:
    """``{family name as exposed: type}`` from the ``# TYPE`` lines (a counter's name ends in ``_total``)."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def test_every_metric_the_dashboard_queries_is_served(examples, scrapes):
    promql, _ = examples
    text = scrapes[-1][1]
    types, sampled = declared(text), {name for name, _ in promql.parse_scrape(text)}
    queried = set()
    for expr in promql.expressions(promql.load_dashboard()):
        names = promql.metric_names(expr)  # refuses an expression outside the renderer's forms
        assert names == set(re.findall(r"vllm_omni:[A-Za-z0-9_:]+", expr)), expr
        queried |= names
    missing = []
    for name in sorted(queried):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name.endswith(HISTOGRAM_SERIES) and types.get(base) == "histogram":
            if name not in sampled:  # every histogram the dashboard reads has observed the requests
                missing.append(f"{name} (declared, no samples after two requests)")
        elif types.get(name) != ("counter" if name.endswith("_total") else "gauge"):
            missing.append(f"{name} (type {types.get(name) or types.get(base)})")
    assert not missing, f"queried by the dashboard but not served as queried: {missing}"
    assert len(queried) >= 20


def test_the_renderer_draws_every_panel_from_two_scrapes(examples, scrapes, tmp_path):
    promql, renderer = examples
    dashboard = promql.load_dashboard()
    parsed = [(t, promql.parse_scrape(text, instance="127.0.0.1:8000")) for t, text in scrapes]
    drawn = {}
    for panel in promql.panels(dashboard):
        for target in panel.get("targets", []):
            expr = promql.substitute(target["expr"], promql.variables(dashboard))
            drawn[expr] = promql.series(expr, target.get("legendFormat", ""), parsed)
    completed = drawn[next(expr for expr in drawn if "image_generation_requests_total" in expr)]
    assert completed["completed"] == [(1.0, 1.0)]  # one request completed between the scrapes, one second apart
    phases = next(series for expr, series in drawn.items() if expr.startswith("sum by (phase)"))
    assert {"parse", "queue", "execution", "encoding"} <= set(phases) and phases["execution"][0][1] > 0
    out = renderer.render(dashboard, parsed, tmp_path / "dashboard.png")
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
