"""The PromQL that the dashboard's panels are written in, evaluated over scrapes of ``/metrics`` (for
render_dashboard.py; not Prometheus). Only these forms are read; any other expression is refused
(`UnsupportedExpression`), so that a panel changed beyond them fails the dashboard's test instead of being drawn
wrong::

    EXPR := AGG | AGG "/" AGG | "histogram_quantile(" NUMBER "," AGG ")"
    AGG  := "sum" ["by (" LABELS ")"] "(" (RANGE | SEL) ")"
    RANGE := ("rate" | "increase") "(" SEL "[$__rate_interval])"
    SEL  := NAME ["{" LABEL ("=" | "!=" | "=~") STRING, ... "}"]

``$__rate_interval`` is the time between two consecutive scrapes; ``increase`` is not extrapolated; a counter that
went down was reset; a templating variable whose current value is "All" takes its ``allValue`` (``.*``), any other
its current value. Sums, divisions and histogram_quantile follow Prometheus (an empty sum is no data, 0/0 is NaN).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

DASHBOARD = Path(__file__).with_name("vllm_omni_dashboard.json")
Labels = frozenset  # of (label, value) pairs
Scrape = dict  # (sample name, Labels) -> value

_TOKEN = re.compile(
    r'\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<str>"[^"\\]*")|(?P<window>\[\$__rate_interval\])|(?P<op>=~|!=|[(){},=/])'
    r"|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*))"
)


class UnsupportedExpression(ValueError):
    """An expression outside the forms this module evaluates (see the module's docstring)."""


# --- the dashboard ---------------------------------------------------------------------------------------------


def load_dashboard(path: str | Path = DASHBOARD) -> dict:
    return json.loads(Path(path).read_text())


def variables(dashboard: dict) -> dict[str, str]:
    """Each templating variable's value as this renderer substitutes it: "All" as its ``allValue``."""
    values = {}
    for var in dashboard.get("templating", {}).get("list", []):
        current = var.get("current", {}).get("value")
        current = current[0] if isinstance(current, list) and len(current) == 1 else current
        values[var["name"]] = var.get("allValue", ".*") if current == "$__all" else current
    return values


def substitute(text: str, values: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        if match[1] == "__rate_interval":
            return match[0]
        if match[1] not in values:
            raise UnsupportedExpression(f"unknown variable ${match[1]} in {text!r}")
        return values[match[1]]

    return re.sub(r"\$(\w+)", value, text)


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def expressions(dashboard: dict) -> list[str]:
    """Every target's ``expr``, variables substituted."""
    values = variables(dashboard)
    return [substitute(target["expr"], values) for panel in panels(dashboard) for target in panel.get("targets", [])]


# --- the PromQL subset -----------------------------------------------------------------------------------------


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr.rstrip()):
        match = _TOKEN.match(expr, pos)
        if match is None or match.end() == pos:
            raise UnsupportedExpression(f"cannot read {expr[pos:]!r} in {expr!r}")
        tokens.append(next((kind, text) for kind, text in match.groupdict().items() if text is not None))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, expr: str):
        self.expr, self.tokens, self.pos = expr, _tokens(expr), 0

    def refuse(self, wanted: str):
        got = self.tokens[self.pos][1] if self.pos < len(self.tokens) else "the end"
        raise UnsupportedExpression(f"expected {wanted}, got {got!r} in {self.expr!r}")

    def take(self, kind: str, text: str | None = None) -> str:
        if self.pos < len(self.tokens):
            got_kind, got = self.tokens[self.pos]
            if got_kind == kind and text in (None, got):
                self.pos += 1
                return got
        self.refuse(text or kind)

    def peek(self, text: str) -> bool:
        return self.pos < len(self.tokens) and self.tokens[self.pos][1] == text

    def parse(self) -> tuple:
        if self.peek("histogram_quantile"):
            self.take("name")
            self.take("op", "(")
            q = float(self.take("num"))
            self.take("op", ",")
            node = self.agg()
            if "le" not in (node[1] or ()) or node[2][0] != "range" or not node[2][2][1].endswith("_bucket"):
                raise UnsupportedExpression(
                    f"histogram_quantile needs sum by (le, ...) (rate(..._bucket)): {self.expr!r}"
                )
            self.take("op", ")")
            node = ("quantile", q, node)
        else:
            node = self.agg()
            if self.peek("/"):
                self.take("op", "/")
                node = ("div", node, self.agg())
        if self.pos != len(self.tokens):
            self.refuse("the end")
        return node

    def agg(self) -> tuple:
        self.take("name", "sum")
        by = None
        if self.peek("by"):
            self.take("name")
            self.take("op", "(")
            by = [self.take("name")]
            while self.peek(","):
                self.take("op", ",")
                by.append(self.take("name"))
            self.take("op", ")")
            by = tuple(by)
        self.take("op", "(")
        if self.peek("rate") or self.peek("increase"):
            function = self.take("name")
            self.take("op", "(")
            inner = ("range", function, self.selector())
            self.take("window")
            self.take("op", ")")
        else:
            inner = self.selector()
        self.take("op", ")")
        return ("sum", by, inner)

    def selector(self) -> tuple:
        name, matchers = self.take("name"), []
        if name in ("sum", "rate", "increase", "histogram_quantile", "by"):
            raise UnsupportedExpression(f"{name} where a metric was expected in {self.expr!r}")
        if self.peek("{"):
            self.take("op", "{")
            while not self.peek("}"):
                label = self.take("name")
                if not any(self.peek(op) for op in ("=", "!=", "=~")):
                    self.refuse("=, != or =~")
                op = self.take("op")
                matchers.append((label, op, self.take("str")[1:-1]))
                if not self.peek("}"):
                    self.take("op", ",")
            self.take("op", "}")
        return ("sel", name, tuple(matchers))


def parse(expr: str) -> tuple:
    """The expression's tree; `UnsupportedExpression` for anything outside the subset."""
    return _Parser(expr).parse()


def metric_names(expr: str) -> set[str]:
    """The sample names ``expr`` reads (a histogram's as ``_bucket``, ``_sum`` or ``_count``)."""

    def walk(node):
        if node[0] == "sel":
            yield node[1]
        for child in node[1:]:
            if isinstance(child, tuple) and child and isinstance(child[0], str):
                yield from walk(child)

    return set(walk(parse(expr)))


def parse_scrape(text: str, instance: str | None = None) -> Scrape:
    """``{(sample name, labels): value}`` of one ``/metrics`` answer, read by prometheus_client's own parser;
    ``instance``: the label Prometheus adds to each sample of a target (its host:port)."""
    from prometheus_client.parser import text_string_to_metric_families

    target = {"instance": instance} if instance else {}
    return {
        (sample.name, frozenset((sample.labels | target).items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _matches(labels: dict, matchers) -> bool:
    for label, op, value in matchers:
        got = labels.get(label, "")
        if (
            (op == "=" and got != value)
            or (op == "!=" and got == value)
            or (op == "=~" and not re.fullmatch(value, got))
        ):
            return False
    return True


def evaluate(node: tuple, scrapes: list[tuple[float, Scrape]], i: int) -> dict[Labels, float]:
    """The instant vector of ``node`` at scrape ``i`` (``i >= 1``: a range reaches back to scrape ``i - 1``)."""
    kind = node[0]
    if kind == "sel":
        return {
            labels: v
            for (name, labels), v in scrapes[i][1].items()
            if name == node[1] and _matches(dict(labels), node[2])
        }
    if kind == "range":
        now, before = evaluate(node[2], scrapes, i), evaluate(node[2], scrapes, i - 1)
        seconds = scrapes[i][0] - scrapes[i - 1][0]
        grew = {
            labels: v - before[labels] if v >= before[labels] else v for labels, v in now.items() if labels in before
        }
        return grew if node[1] == "increase" else {labels: d / seconds for labels, d in grew.items()}
    if kind == "sum":
        groups: dict[Labels, float] = defaultdict(float)
        for labels, v in evaluate(node[2], scrapes, i).items():
            held = dict(labels)
            groups[frozenset((label, held.get(label, "")) for label in node[1] or ())] += v
        return dict(groups)
    if kind == "div":
        top, bottom = evaluate(node[1], scrapes, i), evaluate(node[2], scrapes, i)
        return {labels: _divide(v, bottom[labels]) for labels, v in top.items() if labels in bottom}
    if kind == "quantile":
        buckets: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
        for labels, v in evaluate(node[2], scrapes, i).items():
            buckets[frozenset(p for p in labels if p[0] != "le")].append((float(dict(labels)["le"]), v))
        return {labels: _quantile(node[1], sorted(b)) for labels, b in buckets.items()}
    raise UnsupportedExpression(kind)


def _divide(a: float, b: float) -> float:
    return a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative ``(upper bound, count)`` buckets, +Inf last."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    b = next(index for index, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    start, below = (0.0, 0.0) if b == 0 else buckets[b - 1]
    in_bucket = buckets[b][1] - below
    return start + (buckets[b][0] - start) * ((rank - below) / in_bucket if in_bucket else 0.0)


def series(expr: str, legend: str, scrapes: list[tuple[float, Scrape]]) -> dict[str, list[tuple[float, float]]]:
    """``{legend: [(seconds since the first scrape, value)]}`` of one target over the scrapes."""
    node, out = parse(expr), defaultdict(list)
    for i in range(1, len(scrapes)):
        for labels, v in evaluate(node, scrapes, i).items():
            held = dict(labels)
            name = (
                re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m, held=held: held.get(m[1], ""), legend) if legend else str(held)
            )
            out[name].append((scrapes[i][0] - scrapes[0][0], v))
    return dict(out)
