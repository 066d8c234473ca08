"""Draw the panels of ``vllm_omni_dashboard.json`` with matplotlib from scrapes of a running server's ``/metrics``.

This is not Grafana: no Grafana server could be installed where the docs' picture was made, so this script stands in
for one. It scrapes ``/metrics`` every ``--interval`` seconds while it sends the server image requests, evaluates
each panel's PromQL between consecutive scrapes (promql_subset.py: only the forms the dashboard uses; anything else is
refused), and lays the panels out by their ``gridPos``::

    python examples/observability/render_dashboard.py --url http://127.0.0.1:8000 --out dashboard.png
"""

from __future__ import annotations

import argparse
import itertools
import math
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from promql_subset import (
    DASHBOARD,
    Scrape,
    expressions,
    load_dashboard,
    panels,
    parse,
    parse_scrape,
    series,
    substitute,
    variables,
)

# --- drawing ---------------------------------------------------------------------------------------------------

_BG, _PANEL, _TEXT, _GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"


def render(dashboard: dict, scrapes: list[tuple[float, Scrape]], out: str | Path) -> Path:
    """Draw every panel from ``scrapes`` (``(unix time, parse_scrape(...))``, two at least) into the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(scrapes) < 2:
        raise ValueError("two scrapes at least: a rate needs a window")
    values = variables(dashboard)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels(dashboard))
    unit_w, unit_h, header = 0.8, 0.34, 0.9
    fig_w, height = 24 * unit_w, rows * unit_h + header
    fig = plt.figure(figsize=(fig_w, height), facecolor=_BG)
    span = f"{scrapes[-1][0] - scrapes[0][0]:.0f} s, {len(scrapes)} scrapes"
    fig.text(
        0.01,
        1 - 0.35 / height,
        f"{dashboard['title']}: matplotlib rendering of the Grafana dashboard's panels "
        f"from scrapes of real servers' /metrics ({span}); not a Grafana screenshot",
        color=_TEXT,
        fontsize=13,
        va="center",
    )
    for panel in panels(dashboard):
        g = panel["gridPos"]
        left, top, width = g["x"] * unit_w, header + g["y"] * unit_h, g["w"] * unit_w  # inches from the top left
        title = substitute(panel.get("title", ""), values)
        if panel["type"] == "row":
            fig.text(
                left / fig_w + 0.004, 1 - (top + unit_h / 2) / height, title, color=_TEXT, fontsize=12, weight="bold"
            )
            continue
        bottom = height - top - g["h"] * unit_h
        fig.patches.append(
            plt.Rectangle(
                ((left + 0.04) / fig_w, (bottom + 0.04) / height),
                (width - 0.08) / fig_w,
                (g["h"] * unit_h - 0.08) / height,
                transform=fig.transFigure,
                facecolor=_PANEL,
                edgecolor=_GRID,
                zorder=-1,
            )
        )
        fig.text((left + 0.15) / fig_w, 1 - (top + 0.22) / height, title, color=_TEXT, fontsize=10, va="center")
        pad_left, pad_bottom = (0.2, 0.15) if panel["type"] in ("stat", "piechart") else (0.65, 0.5)
        ax = fig.add_axes(
            (
                (left + pad_left) / fig_w,
                (bottom + pad_bottom) / height,
                (width - pad_left - 0.2) / fig_w,
                (g["h"] * unit_h - pad_bottom - 0.45) / height,
            ),
            facecolor=_PANEL,
        )
        ax.tick_params(colors=_TEXT, labelsize=7)
        for side in ax.spines.values():
            side.set_color(_GRID)
        drawn = {}
        for target in panel["targets"]:
            drawn.update(series(substitute(target["expr"], values), target.get("legendFormat", ""), scrapes))
        _DRAW.get(panel["type"], _draw_timeseries)(ax, panel, drawn)
    fig.savefig(out, dpi=80, facecolor=_BG)
    plt.close(fig)
    return Path(out)


def _no_data(ax) -> None:
    ax.axis("off")
    ax.text(0.5, 0.5, "No data", color=_TEXT, ha="center", va="center", transform=ax.transAxes, fontsize=11)


def _finite(points):
    return [(t, v) for t, v in points if math.isfinite(v)]


def _draw_timeseries(ax, panel: dict, drawn: dict) -> None:
    drawn = {name: _finite(points) for name, points in drawn.items() if _finite(points)}
    if not drawn:
        return _no_data(ax)
    for name, points in sorted(drawn.items()):
        ax.plot(
            *zip(*points, strict=True),
            marker="o" if len(points) == 1 else None,
            markersize=3,
            linewidth=1.4,
            label=name,
        )
    ax.grid(color=_GRID, linewidth=0.5)
    ax.set_xlabel("seconds", color=_TEXT, fontsize=7)
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    ax.set_ylabel("" if unit == "short" else unit, color=_TEXT, fontsize=7)
    legend = ax.legend(fontsize=6, loc="upper left", ncol=2, facecolor=_PANEL, edgecolor=_GRID, labelcolor=_TEXT)
    legend.get_frame().set_alpha(0.8)


def _last(points) -> float | None:
    finite = _finite(points)
    return finite[-1][1] if finite else None


def _draw_stat(ax, panel: dict, drawn: dict) -> None:
    last = [v for v in map(_last, drawn.values()) if v is not None]
    if not last:
        return _no_data(ax)
    ax.axis("off")
    ax.text(0.5, 0.45, f"{sum(last):g}", color="#73bf69", ha="center", va="center", transform=ax.transAxes, fontsize=30)


def _draw_piechart(ax, panel: dict, drawn: dict) -> None:
    last = {name: v for name, v in ((n, _last(p)) for n, p in drawn.items()) if v}
    if not last:
        return _no_data(ax)
    names = sorted(last)
    ax.pie(
        [last[n] for n in names],
        labels=names,
        autopct="%1.0f%%",
        textprops={"color": _TEXT, "fontsize": 7},
        wedgeprops={"width": 0.45},
    )


def _draw_heatmap(ax, panel: dict, drawn: dict) -> None:
    import numpy as np

    bounds = sorted(drawn, key=float)
    times = sorted({t for points in drawn.values() for t, _ in points})
    if not bounds or not times:
        return _no_data(ax)
    cumulative = np.array([[dict(drawn[le]).get(t, 0.0) for t in times] for le in bounds])
    cells = np.diff(cumulative, axis=0, prepend=0.0)  # per bucket, no longer cumulative
    ax.imshow(
        cells,
        aspect="auto",
        origin="lower",
        cmap="Oranges",
        interpolation="nearest",
        extent=(times[0] - 0.5, times[-1] + 0.5, -0.5, len(bounds) - 0.5),
    )
    ax.set_yticks(range(len(bounds)), [f"≤{float(le):g}".replace("inf", "+Inf") for le in bounds])
    ax.set_xlabel("seconds", color=_TEXT, fontsize=7)


_DRAW = {"stat": _draw_stat, "piechart": _draw_piechart, "heatmap": _draw_heatmap}


# --- scraping a server under load ------------------------------------------------------------------------------


def scrape_under_load(args: argparse.Namespace) -> list[tuple[float, Scrape]]:
    """``--scrapes`` rounds ``--interval`` s apart, each scraping every ``--url`` (labelled ``instance`` with its
    host:port, as Prometheus does), while ``--concurrency`` clients per server send image requests, the k-th
    starting k intervals in so that batches grow over the window; each request names the next of the server's
    ``/v1/models`` in turn (the model, then its LoRA adapters)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    stop, lock, threads = threading.Event(), threading.Lock(), []

    def client(url: str, models, k: int) -> None:
        if stop.wait(k * args.interval):
            return
        while not stop.is_set():
            with lock:
                model = next(models)
            body = {"model": model, "prompt": "a red cube on a table", "size": args.size}
            body["num_inference_steps"] = args.steps
            httpx.post(f"{url}/v1/images/generations", json=body, headers=headers, timeout=600)

    for url in args.url:
        listed = httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"]
        models = itertools.cycle([model["id"] for model in listed])
        threads += [
            threading.Thread(target=client, args=(url, models, k), daemon=True) for k in range(args.concurrency)
        ]
    for thread in threads:
        thread.start()
    scrapes = []
    try:
        for _ in range(args.scrapes):
            scrape = {}
            for url in args.url:
                text = httpx.get(f"{url}/metrics", headers=headers, timeout=60).text
                scrape.update(parse_scrape(text, instance=urlsplit(url).netloc))
            scrapes.append((time.time(), scrape))
            time.sleep(args.interval)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return scrapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", help="a server's base URL (repeat for several; default :8000)")
    parser.add_argument("--api-key", default=None, help="the servers' --api-key")
    parser.add_argument("--dashboard", default=str(DASHBOARD))
    parser.add_argument("--scrapes", type=int, default=12)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes")
    parser.add_argument("--concurrency", type=int, default=4, help="clients per server")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="dashboard.png")
    args = parser.parse_args(argv)
    args.url = args.url or ["http://127.0.0.1:8000"]
    dashboard = load_dashboard(args.dashboard)
    for expr in expressions(dashboard):
        parse(expr)  # refuse before sending anything
    print(render(dashboard, scrape_under_load(args), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
