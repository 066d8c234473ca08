"""examples/observability/promql_subset.py, the PromQL the dashboard renderer evaluates: the forms it reads, those
it refuses, and Prometheus' results on hand-made scrapes."""

import importlib
import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "observability"


@pytest.fixture(scope="module")
def promql():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("promql_subset")
    finally:
        sys.path.remove(str(EXAMPLES))


SCRAPE_0 = """# TYPE x_seconds histogram
x_seconds_bucket{phase="a",le="1.0"} 0
x_seconds_bucket{phase="a",le="2.0"} 0
x_seconds_bucket{phase="a",le="+Inf"} 0
x_seconds_sum{phase="a"} 0
x_seconds_count{phase="a"} 0
# TYPE y counter
y_total{stage="0"} 10
y_total{stage="1"} 5
"""
SCRAPE_1 = """# TYPE x_seconds histogram
x_seconds_bucket{phase="a",le="1.0"} 2
x_seconds_bucket{phase="a",le="2.0"} 4
x_seconds_bucket{phase="a",le="+Inf"} 4
x_seconds_sum{phase="a"} 6
x_seconds_count{phase="a"} 4
# TYPE y counter
y_total{stage="0"} 14
y_total{stage="1"} 2
"""


@pytest.fixture
def scrapes(promql):
    return [(100.0, promql.parse_scrape(SCRAPE_0, "h:1")), (102.0, promql.parse_scrape(SCRAPE_1, "h:1"))]


def test_prometheus_results_on_two_scrapes(promql, scrapes):
    def at_1(expr):
        return {tuple(sorted(labels)): v for labels, v in promql.evaluate(promql.parse(expr), scrapes, 1).items()}

    window = "[$__rate_interval]"
    assert at_1(f"sum by (stage) (rate(y_total{window}))") == {(("stage", "0"),): 2.0, (("stage", "1"),): 1.0}
    assert at_1(f'sum(increase(y_total{{stage!="1", instance=~"h:.*"}}{window}))') == {(): 4.0}  # no reset
    assert at_1(f"sum by (phase) (rate(x_seconds_sum{window})) / sum by (phase) (rate(x_seconds_count{window}))") == {
        (("phase", "a"),): 1.5
    }
    # rank 2 of 4 ends the first bucket; rank 3.6 is 80 % into (1, 2]
    assert at_1(f"histogram_quantile(0.5, sum by (le, phase) (rate(x_seconds_bucket{window})))") == {
        (("phase", "a"),): 1.0
    }
    assert at_1(f"histogram_quantile(0.9, sum by (le) (rate(x_seconds_bucket{window})))") == {(): pytest.approx(1.8)}
    assert at_1('sum(y_total{stage="9"})') == {}  # an empty sum is no data
    zero = promql.evaluate(
        promql.parse(f"histogram_quantile(0.5, sum by (le) (rate(x_seconds_bucket{window})))"),
        [scrapes[0], (101.0, scrapes[0][1])],
        1,
    )
    assert math.isnan(zero[frozenset()])  # no observations in the window


@pytest.mark.parametrize(
    "expr",
    [
        "sum(rate(y_total[5m]))",  # a window other than $__rate_interval
        "avg by (stage) (y_total)",
        "rate(y_total[$__rate_interval])",  # not aggregated
        "sum(y_total) * 2",
        "sum by (stage) (y_total) / on (stage) sum by (stage) (y_total)",
        "histogram_quantile(0.5, sum by (phase) (rate(x_seconds_bucket[$__rate_interval])))",  # no le
        "histogram_quantile(0.5, sum by (le) (x_seconds_bucket))",  # no rate
        'sum(y_total{stage=~"$nope"})',
    ],
)
def test_anything_else_is_refused(promql, expr):
    with pytest.raises(promql.UnsupportedExpression):
        promql.parse(promql.substitute(expr, {}))


def test_the_dashboard_is_in_the_subset_and_its_variables_take_all(promql):
    dashboard = promql.load_dashboard()
    assert promql.variables(dashboard) == {"instance": ".*", "stage": ".*", "api": "images"}
    for expr in promql.expressions(dashboard):
        assert promql.metric_names(expr) and "$" not in expr.replace("$__rate_interval", "")
