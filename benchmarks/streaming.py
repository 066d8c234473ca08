"""Streaming partial images (previews): what streaming costs through a real server, and what a preview costs.

    python benchmarks/streaming.py                       # the published run: results/cpu-tiny-streaming.{json,md}
    python benchmarks/streaming.py [--parts served,previews] [--served-families flux,wan]
        [--families flux,sd,sd3,sdxl,wan] [--reps 4] [--preview-reps 3] [--fit-reps 5] [--size WxH] [--steps N]
        [--video-size 416x240x17] [--execution-mode request] [--poll-ms 20] [--model-dir DIR]
        [--quick] [--out-dir DIR] [--name cpu-tiny-streaming]

Every model is a tiny random-weight one (`vllm_omni.testing.models.tiny_models`), built once into ``--model-dir``, and
every request runs at the model's default settings: its pipeline's default steps (Flux and SD3 28, SD, SDXL and Wan
50) and default size (tiny Flux 256x256, the others 64x64), unless ``--steps`` or ``--size`` say otherwise. Wan is
the exception: its pipeline's default, 832x480 with 81 frames, takes about 80 s per step with the tiny model on the
2-core CPU, so it runs at its default steps and ``--video-size`` (default 416x240x17: half of each side, 17 frames).

1. **Served** (``--parts served``): one real ``vllm serve MODEL --omni`` per family of ``--served-families`` (access
   log off), requests one at a time from this process over one keep-alive httpx connection, all with seed 0 and
   the same size and steps:

   - tiny Flux, ``POST /v1/images/generations`` (``response_format: b64_json``, PNG): ``non-streamed`` (one JSON
     answer), and ``stream: true`` with ``partial_images`` 0, 1 and 3 (server-sent events). The latency is to the
     final image: the whole JSON answer read, or the ``image_generation.completed`` event read; also the time to
     the first ``partial_image`` event and how many came.
   - tiny Wan, ``POST /v1/videos`` jobs with ``partial_images`` 0, 1 and 3: the time from the POST to the first
     ``GET /v1/videos/{id}`` (polled every ``--poll-ms``) that answers ``completed``; the largest ``preview_index``
     seen while polling says how many previews the job showed.

   Each variant is warmed up once; then each of the ``--reps`` reps runs every variant once, the order rotating
   per rep, so a shared machine's drift hits all alike. Reported: per variant the median latency, the median over
   the reps of each rep's ratio to the reference (non-streamed; ``partial_images`` 0) with its range, and the
   server's own execution time per request (``vllm_omni:request_phase_seconds{phase="execution"}``, read from
   ``/metrics`` between requests), which holds the previews' cost on the engine's thread.

2. **Previews** (``--parts previews``): for each family of ``--families``, a worker process of its own (spawned)
   drives the stage's real engine (`make_engine`, the engine an inline server runs) on its main thread: the one
   thread that runs torch ops there, as the server's engine thread is. Each rep runs three requests at the default
   settings, order rotating: ``none`` (``partial_images`` 0), ``latent_rgb`` and ``vae`` (``partial_images`` 3,
   with the stage's `Previews` set to that method; the server always uses ``latent_rgb``, the default). Every
   preview is timed inside the real run: `Previews.emit` (the RGB conversion and the hand-over; the x₀ estimate
   before it is a few elementwise ops) is wrapped with a timer, and the one-time `LatentProjection` fit (made at
   the first ``latent_rgb`` preview of the engine's life, in the warm-up) is timed apart and taken out of the
   preview that paid for it. The fit is also timed ``--fit-reps`` times on its own afterwards. Reported: one
   preview's median time as a fraction of the median ``none`` request; per rep, the 3 previews' total over that
   rep's ``none`` request (median over reps: the target's figure); the whole request with 3 previews over the one
   without (median over reps of each rep's ratio: the previews and whatever else they bring, with the noise).

The issue's target: previews cost under 10 % of the request at the default settings, for the default method
(``latent_rgb``), read here as the total of 3 previews. Nothing is asserted and the exit code says nothing about
speed. Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
from common import PROMPTS, publish
from prometheus_client.parser import text_string_to_metric_families
from step_batching import HERE, _device, cached_model

from vllm_omni.testing.processes.server import RemoteOmniServer

SPAWN = multiprocessing.get_context("spawn")
PROMPT = PROMPTS[0]
IMAGE_FAMILIES = ("flux", "sd", "sd3", "sdxl")
VIDEO_FAMILIES = ("wan",)
FAMILIES = IMAGE_FAMILIES + VIDEO_FAMILIES
SERVED_FAMILIES = ("flux", "wan")
IMAGE_VARIANTS = ("non-streamed", "stream, partial_images 0", "stream, partial_images 1", "stream, partial_images 3")
VIDEO_VARIANTS = (0, 1, 3)
METHODS = ("latent_rgb", "vae")
PREVIEW_VARIANTS = ("none", *METHODS)
PARTIAL_IMAGES = 3
DEFAULT_METHOD = "latent_rgb"
TARGET = 0.10
PHASE_METRIC = "vllm_omni:request_phase_seconds"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


def _ratios(reps: list[dict], variant, reference) -> dict:
    """Median, min and max over the reps of each rep's ``variant`` time over its ``reference`` time."""
    values = [rep[variant] / rep[reference] for rep in reps if rep.get(variant) and rep.get(reference)]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def _rotated(variants: tuple, rep: int) -> list:
    return [variants[(rep + i) % len(variants)] for i in range(len(variants))]


# Part 1: through a real server.


def execution_seconds(client: httpx.Client, api: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's ``execution`` phase for ``api`` (images, videos), now."""
    seconds = count = 0.0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("api") != api or labels.get("phase") != "execution":
                continue
            if sample.name == f"{PHASE_METRIC}_sum":
                seconds = sample.value
            elif sample.name == f"{PHASE_METRIC}_count":
                count = sample.value
    return seconds, count


def image_request(client: httpx.Client, variant: str, base: dict) -> dict:
    """One Images API request: its latency to the final image, to the first partial image, the partial images."""
    body = dict(base, response_format="b64_json")
    if variant != "non-streamed":
        body |= {"stream": True, "partial_images": int(variant.rsplit(" ", 1)[1])}
    started = time.perf_counter()
    if variant == "non-streamed":
        response = client.post("/v1/images/generations", json=body)
        response.read()
        final = time.perf_counter() - started
        if response.status_code != 200 or not response.json()["data"][0].get("b64_json"):
            raise RuntimeError(f"{variant}: {response.status_code} {response.text[:300]}")
        return {"final_s": final, "first_partial_s": None, "partials": 0}
    final = first = None
    partials = 0
    with client.stream("POST", "/v1/images/generations", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{variant}: {response.status_code} {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if event["type"] == "image_generation.partial_image":
                partials += 1
                first = first if first is not None else time.perf_counter() - started
            elif event["type"] == "image_generation.completed":
                final = time.perf_counter() - started
            elif event["type"] == "error":
                raise RuntimeError(f"{variant}: {event['error']}")
    if final is None:
        raise RuntimeError(f"{variant}: the stream ended without its image")
    return {"final_s": final, "first_partial_s": first, "partials": partials}


def video_request(client: httpx.Client, partial_images: int, base: dict, poll_s: float) -> dict:
    """One Videos API job: the time from its POST to the poll that sees it completed, and its previews."""
    started = time.perf_counter()
    created = client.post("/v1/videos", json=dict(base, partial_images=partial_images))
    if created.status_code != 200:
        raise RuntimeError(f"POST /v1/videos: {created.status_code} {created.text[:300]}")
    video_id, previews, polls = created.json()["id"], -1, 0
    while True:
        job = client.get(f"/v1/videos/{video_id}").json()
        polls += 1
        if job["status"] == "completed":
            done = time.perf_counter() - started
            break
        if job["status"] == "failed":
            raise RuntimeError(f"video job {video_id} failed: {job.get('error')}")
        if job.get("preview_index") is not None:
            previews = max(previews, job["preview_index"])
        time.sleep(poll_s)
    client.delete(f"/v1/videos/{video_id}")
    return {"final_s": done, "previews_seen": previews + 1, "polls": polls}


def serve(model: str, family: str, args, log_dir: str) -> RemoteOmniServer:
    server_args = ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    server_args += ["--execution-mode", args.execution_mode, "--max-num-seqs", "1"]
    log_path = os.path.join(log_dir, f"{family}.log")
    try:
        return RemoteOmniServer(model, server_args, log_path=log_path).__enter__()
    except RuntimeError:
        with open(log_path) as f:
            raise RuntimeError(f"the {family} server did not start; its log ends:\n{f.read()[-3000:]}") from None


def measure_served(model: str, family: str, args, log_dir: str) -> dict:
    """Every variant of the family's API, warmed up once, then ``--reps`` reps, the order rotating per rep."""
    video = family in VIDEO_FAMILIES
    base: dict = {"prompt": PROMPT, "seed": 0}
    if video:
        width, height, frames = args.video_shape
        base |= {"size": f"{width}x{height}", "num_frames": frames}
    elif args.size:
        base["size"] = args.size
    if args.steps:
        base["num_inference_steps"] = args.steps
    variants, api = (VIDEO_VARIANTS, "videos") if video else (IMAGE_VARIANTS, "images")
    server = serve(model, family, args, log_dir)
    samples: dict = {v: [] for v in variants}
    reps: list[dict] = []
    try:
        with httpx.Client(base_url=server.base_url, timeout=1800) as client:

            def one(variant) -> dict:
                before = execution_seconds(client, api)
                if video:
                    sample = video_request(client, variant, base, args.poll_ms / 1000)
                else:
                    sample = image_request(client, variant, base)
                after = execution_seconds(client, api)
                sample["execution_s"] = after[0] - before[0] if after[1] - before[1] == 1 else None
                return sample

            for variant in variants:
                one(variant)
            for rep in range(args.reps):
                times = {}
                for variant in _rotated(variants, rep):
                    sample = one(variant)
                    samples[variant].append(sample)
                    times[variant] = sample["final_s"]
                reps.append(times)
                print(f"  {family} rep {rep + 1}/{args.reps}: {_fmt_times(times)}", flush=True)
    finally:
        server.stop()
    reference = variants[0]
    rows = []
    for variant in variants:
        got = samples[variant]
        row = {
            "variant": variant if not video else f"partial_images {variant}",
            "final_ms_p50": _ms(_median([s["final_s"] for s in got])),
            "final_ms_each": [_ms(s["final_s"]) for s in got],
            "ratio_to_reference": _ratios(reps, variant, reference),
            "execution_ms_p50": _ms(_median([s["execution_s"] for s in got if s["execution_s"] is not None])),
        }
        if video:
            row["previews_seen"] = [s["previews_seen"] for s in got]
            row["polls_p50"] = _median([s["polls"] for s in got])
        else:
            firsts = [s["first_partial_s"] for s in got if s["first_partial_s"] is not None]
            row["first_partial_ms_p50"] = _ms(_median(firsts))
            row["partials_received"] = [s["partials"] for s in got]
        rows.append(row)
    return {
        "family": family,
        "api": "POST /v1/videos (polled)" if video else "POST /v1/images/generations",
        "request": base,
        "reference": rows[0]["variant"],
        "rows": rows,
        "server_exit_code": server.returncode,
    }


def _fmt_times(times: dict) -> str:
    return ", ".join(f"{k}: {1000 * v:.0f} ms" for k, v in times.items())


# Part 2: the previews, timed inside real runs of the stage's engine (in a worker process).


def preview_worker(model: str, family: str, config: dict) -> dict:
    """A spawned process: the family's engine, driven on this process's main thread (the only one that runs torch
    ops here); ``config``: reps, fit_reps, steps, size, video_shape, execution_mode."""
    os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")  # as the server's runner does: no loading thread pool
    import torch

    from vllm_omni.config import OmniDiffusionConfig, resolve_stage_configs
    from vllm_omni.diffusion.engine.modes import make_engine
    from vllm_omni.diffusion.features import previews as previews_module
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams

    fits: list[float] = []

    class TimedProjection(previews_module.LatentProjection):
        """The fit, timed (`Previews.images` builds it through the module's name)."""

        def __init__(self, vae, video: bool):
            started = time.perf_counter()
            super().__init__(vae, video)
            fits.append(time.perf_counter() - started)

    previews_module.LatentProjection = TimedProjection
    knobs = {"max_num_seqs": 1, "execution_mode": config["execution_mode"]}
    if config["execution_mode"] == "request":
        knobs["request_batch_max_wait_ms"] = 0.0
    stage = resolve_stage_configs(global_knobs=knobs)[0]
    loading = time.perf_counter()
    engine = make_engine(OmniDiffusionConfig.from_stage(model, stage))
    load_s = time.perf_counter() - loading
    previews = engine.role.previews
    if previews is None:
        raise RuntimeError(f"{family}: the engine makes no previews")
    card = engine.runner.card

    emitted: list[tuple[float, float]] = []
    """This request's previews: (seconds in `Previews.emit`, of which the fit)."""
    emit = previews.emit

    def timed_emit(request, clean) -> None:
        fitted, started = sum(fits), time.perf_counter()
        emit(request, clean)
        emitted.append((time.perf_counter() - started, sum(fits) - fitted))

    previews.emit = timed_emit

    fields: dict = {"seed": 0}
    if card.output == "video":
        fields["width"], fields["height"], fields["num_frames"] = config["video_shape"]
    elif config["size"]:
        fields["width"], fields["height"] = (int(v) for v in config["size"].split("x"))
    if config["steps"]:
        fields["num_inference_steps"] = config["steps"]
    count = 0

    def run(variant: str) -> dict:
        nonlocal count
        count += 1
        partial_images = 0 if variant == "none" else PARTIAL_IMAGES
        if variant != "none":
            previews.method = variant
        params = engine.admission.admit(OmniDiffusionSamplingParams(**fields, partial_images=partial_images)).params
        received: list = []
        emitted.clear()
        started = time.perf_counter()
        future = engine.add_request(
            f"{family}-{count}", PROMPT, params, on_preview=received.append if partial_images else None
        )
        while not future.done():
            engine.step(0.05)
        elapsed = time.perf_counter() - started
        output = future.result()
        expected = len(previews_module.preview_steps(params.num_inference_steps, partial_images))
        if len(received) != expected or len(emitted) != expected:
            raise RuntimeError(f"{family} {variant}: {len(received)} previews made, {expected} expected")
        return {
            "request_s": elapsed,
            "exec_ms": output.metrics.exec_ms,
            "previews_s": [seconds - fit for seconds, fit in emitted],
            "fit_s": sum(fit for _, fit in emitted),
            "params": params,
        }

    warm = {variant: run(variant) for variant in PREVIEW_VARIANTS}  # the first latent_rgb preview fits the map
    reps = []
    for rep in range(config["reps"]):
        reps.append({variant: run(variant) for variant in _rotated(PREVIEW_VARIANTS, rep)})
    with torch.inference_mode():
        for _ in range(config["fit_reps"]):
            TimedProjection(engine.runner.pipeline.vae, card.output == "video")
    params = warm["none"]["params"]
    try:
        engine.close()
        engine.shutdown()
    except Exception:  # noqa: BLE001 - the process ends here anyway
        pass

    request = _median([rep["none"]["request_s"] for rep in reps])
    result = {
        "family": family,
        "pipeline": card.pipeline_name,
        "execution_mode": config["execution_mode"],
        "size": f"{params.width}x{params.height}" + (f"x{params.num_frames}" if card.output == "video" else ""),
        "steps": params.num_inference_steps,
        "default_size": "x".join(str(v) for v in reversed(card.default_size)) if card.default_size else None,
        "default_steps": card.default_steps,
        "load_s": round(load_s, 3),
        "previews_per_request": len(previews_module.preview_steps(params.num_inference_steps, PARTIAL_IMAGES)),
        "request_ms": _ms(request),
        "request_ms_each": [_ms(rep["none"]["request_s"]) for rep in reps],
        "fit_ms_first": _ms(warm[DEFAULT_METHOD]["fit_s"]),
        "fit_ms": _ms(_median(fits[1:])),
        "fit_ms_each": [_ms(f) for f in fits],
        "methods": {},
    }
    for method in METHODS:
        each = [s for rep in reps for s in rep[method]["previews_s"]]
        preview = _median(each)
        totals = [sum(rep[method]["previews_s"]) / rep["none"]["request_s"] for rep in reps]
        slowdown = [rep[method]["request_s"] / rep["none"]["request_s"] for rep in reps]
        result["methods"][method] = {
            "preview_ms": _ms(preview),
            "preview_ms_each": [_ms(s) for s in each],
            "preview_over_request": round(preview / request, 4) if preview and request else None,
            "previews_total_over_request": round(statistics.median(totals), 4) if totals else None,
            "previews_total_over_request_each": [round(t, 4) for t in totals],
            "request_with_previews_ms": _ms(_median([rep[method]["request_s"] for rep in reps])),
            "request_with_over_without": round(statistics.median(slowdown), 3) if slowdown else None,
            "request_with_over_without_range": [round(min(slowdown), 3), round(max(slowdown), 3)] if slowdown else None,
        }
    fit = result["fit_ms"] or result["fit_ms_first"]
    result["fit_over_request"] = round(fit / result["request_ms"], 4) if fit and result["request_ms"] else None
    return result


def measure_previews(model: str, family: str, args) -> dict:
    config = {
        "reps": args.preview_reps,
        "fit_reps": args.fit_reps,
        "steps": args.steps,
        "size": args.size,
        "video_shape": args.video_shape,
        "execution_mode": args.execution_mode,
    }
    with ProcessPoolExecutor(max_workers=1, mp_context=SPAWN) as pool:
        return pool.submit(preview_worker, model, family, config).result()


# Output.


def _cell(value, fmt: str = "{:.0f}") -> str:
    return "–" if value is None else fmt.format(value)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def _range(ratio: dict) -> str:
    if ratio["median"] is None:
        return "–"
    return f"**{ratio['median']:.3f}** ({ratio['min']:.2f}–{ratio['max']:.2f})"


def tables(result: dict) -> str:
    lines: list[str] = []
    c = result["config"]
    for served in result["served"]:
        video = served["family"] in VIDEO_FAMILIES
        given = served["request"]
        request = ", ".join(f"{k} {v}" for k, v in given.items() if k != "prompt")
        unset = [name for name, key in (("size", "size"), ("steps", "num_inference_steps")) if key not in given]
        if unset:
            request += f", the model's default {' and '.join(unset)}"
        lines += [
            f"**Served, tiny {served['family']}** ({served['api']}; {request}; {c['reps']} reps, variants rotating):",
            "",
        ]
        if video:
            lines += [
                "| variant | to completion p50 (ms) | ÷ partial_images 0, median (range) | server execution p50 (ms) "
                "| previews seen while polling |",
                "|---|---|---|---|---|",
            ]
            for row in served["rows"]:
                lines.append(
                    f"| {row['variant']} | {_cell(row['final_ms_p50'])} | {_range(row['ratio_to_reference'])} "
                    f"| {_cell(row['execution_ms_p50'])} | {', '.join(map(str, row['previews_seen']))} |"
                )
        else:
            lines += [
                "| variant | to the final image p50 (ms) | ÷ non-streamed, median (range) "
                "| first partial image p50 (ms) | server execution p50 (ms) | partial images received |",
                "|---|---|---|---|---|---|",
            ]
            for row in served["rows"]:
                lines.append(
                    f"| {row['variant']} | {_cell(row['final_ms_p50'])} | {_range(row['ratio_to_reference'])} "
                    f"| {_cell(row['first_partial_ms_p50'])} | {_cell(row['execution_ms_p50'])} "
                    f"| {', '.join(map(str, row['partials_received']))} |"
                )
        lines.append("")
    if result["previews"]:
        lines += [
            f"**Previews at the default settings** (in-run timings, {c['execution_mode']} mode, {c['preview_reps']} "
            f"reps; {PARTIAL_IMAGES} previews per request):",
            "",
            "| family | size, steps | request (ms) | fit, once (ms) | latent_rgb preview (ms) | ÷ request "
            "| vae preview (ms) | ÷ request |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in result["previews"]:
            rgb, vae = p["methods"]["latent_rgb"], p["methods"]["vae"]
            lines.append(
                f"| {p['family']} | {p['size']}, {p['steps']} | {_cell(p['request_ms'])} "
                f"| {_cell(p['fit_ms'], '{:.1f}')} ({_pct(p['fit_over_request'])}) "
                f"| {_cell(rgb['preview_ms'], '{:.2f}')} | {_pct(rgb['preview_over_request'])} "
                f"| {_cell(vae['preview_ms'], '{:.1f}')} | {_pct(vae['preview_over_request'])} |"
            )
        lines += [
            "",
            f"| family | {PARTIAL_IMAGES} × latent_rgb ÷ request | {PARTIAL_IMAGES} × vae ÷ request "
            f"| request with {PARTIAL_IMAGES} latent_rgb ÷ without | with {PARTIAL_IMAGES} vae ÷ without "
            f"| target: {PARTIAL_IMAGES} × {DEFAULT_METHOD} < {100 * TARGET:.0f} % |",
            "|---|---|---|---|---|---|",
        ]
        for p, target in zip(result["previews"], result["targets"], strict=True):
            rgb, vae = p["methods"]["latent_rgb"], p["methods"]["vae"]

            def slowdown(m: dict) -> str:
                low, high = m["request_with_over_without_range"] or (None, None)
                if m["request_with_over_without"] is None:
                    return "–"
                return f"{m['request_with_over_without']:.3f} ({low:.2f}–{high:.2f})"

            verdict = "–" if target["pass"] is None else ("met" if target["pass"] else "**missed**")
            lines.append(
                f"| {p['family']} | **{_pct(rgb['previews_total_over_request'])}** "
                f"| {_pct(vae['previews_total_over_request'])} | {slowdown(rgb)} | {slowdown(vae)} | {verdict} |"
            )
        lines.append("")
    lines.append(
        f"{result['device']}; tiny random-weight models, float32; default settings unless noted (Wan: its default "
        f"steps at {c['video_size']}); run took {result.get('wall_s', 0):.0f} s. Ratios: medians over the reps of "
        "each rep's ratio (range in brackets)."
    )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="served,previews", help="comma-separated: served, previews")
    parser.add_argument(
        "--served-families", default=",".join(SERVED_FAMILIES), help="served part: flux (images), wan (videos)"
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help="previews part: families, comma-separated")
    parser.add_argument("--reps", type=int, default=4, help="served part: reps of every variant, rotating")
    parser.add_argument("--preview-reps", type=int, default=3, help="previews part: reps of none, latent_rgb, vae")
    parser.add_argument("--fit-reps", type=int, default=5, help="previews part: LatentProjection fits timed alone")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the model's default)")
    parser.add_argument("--size", help="WxH of the image families (default: the model's default)")
    parser.add_argument("--video-size", default="416x240x17", help="WxHxFRAMES of Wan (its default is too slow here)")
    parser.add_argument("--execution-mode", default="request", choices=("request", "step"))
    parser.add_argument("--poll-ms", type=float, default=20.0, help="served videos: how often a job is polled")
    parser.add_argument(
        "--model-dir", default=os.path.join(os.path.dirname(HERE), ".tiny-models"), help="tiny models, built once"
    )
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"), help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default="cpu-tiny-streaming")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke defaults: flux and wan only, 1 rep, 1 fit, 4 steps, 64x64 images, 32x32x5 videos",
    )
    if parser.parse_known_args(argv)[0].quick:  # only changes defaults: explicit options still win
        parser.set_defaults(
            families="flux,wan", reps=1, preview_reps=1, fit_reps=1, steps=4, size="64x64", video_size="32x32x5"
        )
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    args.served_families = [f for f in args.served_families.split(",") if f]
    args.families = [f for f in args.families.split(",") if f]
    if unknown := set(args.parts) - {"served", "previews"}:
        parser.error(f"unknown parts {sorted(unknown)}")
    if unknown := set(args.served_families) - set(SERVED_FAMILIES):
        parser.error(f"unknown served families {sorted(unknown)}; choose from {', '.join(SERVED_FAMILIES)}")
    if unknown := set(args.families) - set(FAMILIES):
        parser.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    try:
        args.video_shape = tuple(int(v) for v in args.video_size.split("x"))
        assert len(args.video_shape) == 3
    except (ValueError, AssertionError):
        parser.error("--video-size must be WxHxFRAMES, such as 416x240x17")
    if min(args.reps, args.preview_reps) < 1:
        parser.error("--reps and --preview-reps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    wanted = dict.fromkeys(
        [
            *(args.served_families if "served" in args.parts else []),
            *(args.families if "previews" in args.parts else []),
        ]
    )
    models = {family: cached_model(args.model_dir, family) for family in wanted}
    print(f"[{time.perf_counter() - started:.1f} s] models in {args.model_dir}", flush=True)
    served, previews = [], []
    with tempfile.TemporaryDirectory(prefix="streaming-bench-") as log_dir:
        if "served" in args.parts:
            for family in args.served_families:
                print(f"[{time.perf_counter() - started:.1f} s] served: {family}", flush=True)
                served.append(measure_served(models[family], family, args, log_dir))
    if "previews" in args.parts:
        for family in args.families:
            print(f"[{time.perf_counter() - started:.1f} s] previews: {family}", flush=True)
            previews.append(measure_previews(models[family], family, args))
            p = previews[-1]
            print(
                f"  request {p['request_ms']} ms, fit {p['fit_ms']} ms, latent_rgb "
                f"{p['methods']['latent_rgb']['preview_ms']} ms, vae {p['methods']['vae']['preview_ms']} ms",
                flush=True,
            )
    targets = [
        {
            "family": p["family"],
            "target": f"{PARTIAL_IMAGES} {DEFAULT_METHOD} previews / request < {TARGET:g}",
            "value": p["methods"][DEFAULT_METHOD]["previews_total_over_request"],
            "pass": None
            if p["methods"][DEFAULT_METHOD]["previews_total_over_request"] is None
            else p["methods"][DEFAULT_METHOD]["previews_total_over_request"] < TARGET,
        }
        for p in previews
    ]
    result = {
        "name": args.name,
        "device": _device(),
        "cpus": os.cpu_count(),
        "config": {
            "parts": args.parts,
            "served_families": args.served_families,
            "families": args.families,
            "reps": args.reps,
            "preview_reps": args.preview_reps,
            "fit_reps": args.fit_reps,
            "steps": args.steps,
            "size": args.size,
            "video_size": args.video_size,
            "execution_mode": args.execution_mode,
            "poll_ms": args.poll_ms,
            "partial_images": PARTIAL_IMAGES,
            "default_method": DEFAULT_METHOD,
            "quick": args.quick,
        },
        "served": served,
        "previews": previews,
        "targets": targets,
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    publish(result, tables(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
