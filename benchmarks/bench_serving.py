"""Drive a running vllm-omni server over HTTP and report throughput, latency and what the server saw.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 \
        [--concurrency 4 | --request-rate 10] [--num-requests 64] \
        [--shapes 32x32:4,64x64:4:0.5] [--warmup 4] [--json out.json] [--task image|video|edit]
    python benchmarks/bench_serving.py --task edit --concurrency 4 --shapes 64x64:4 [--strength 0.75] [--mask] \
        --offline-model DIR   # served edits against the offline batch-4 ceiling: efficiency

Closed loop (``--concurrency C``: C clients, each sends its next request when
the previous one is answered) or open loop (``--request-rate R``: Poisson
arrivals at R requests/s, on a schedule fixed by ``--seed``). ``--shapes`` is a
weighted mix of ``WxH:STEPS[:WEIGHT]``.

``--task image`` (default) posts to ``/v1/images/generations``; latency is the
HTTP round trip. ``--task video`` creates jobs with ``POST /v1/videos`` (shapes
``WxHxFRAMES:STEPS``, e.g. ``32x32x5:20``; without ``xFRAMES`` the model's
default frame count) and polls ``GET /v1/videos/{id}`` every ``--poll-ms``;
latency is submit → seen completed (the MP4 is not downloaded). ``--task edit``
posts image-to-image edits to ``/v1/images/edits`` (multipart, as OpenAI's
clients send them): a fixed noise image of the shape's size
(``common.edit_image``, a PNG encoded once), ``--strength`` (default 0.75), and
with ``--mask`` OpenAI's mask of the centre square (inpainting); latency is the
HTTP round trip.

``--offline-model DIR`` (closed loop, one shape) then measures the ceiling of the
same work with ``bench_offline.py --thread best`` (the stock pipeline called
in-process with batches of C = ``--concurrency``; for edits its stock
image-to-image or inpainting variant, ``from_pipe``, with lists of C images and
generators) while the server idles, and reports ``efficiency`` = served images/s
÷ ceiling images/s. ``--offline-model`` is the served model's folder (``--model``
stays the requests' model field).

Besides client-side numbers, the server's own queue wait (mean, and a p90
estimated from the histogram buckets like Prometheus' histogram_quantile) and
executed batch sizes come from the difference of its ``/metrics`` before and
after the run (the ``task`` label of ``--task``), and its peak RSS from
``process_resident_memory_bytes`` sampled during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Callable

import aiohttp
from common import EDIT_STRENGTH, PROMPTS, Shape, edit_image, edit_mask, emit, openai_mask_png, png_bytes
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` keyed by (name, sorted labels)."""
    async with session.get(f"{base_url}/metrics") as response:
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    """How much ``name`` grew over the run, summed over the samples carrying ``labels`` (so over replicas)."""
    return sum(
        value - before.get(key, 0.0)
        for key, value in after.items()
        if key[0] == name and labels.items() <= dict(key[1]).items()
    )


def histogram_quantile(q: float, before: dict, after: dict, name: str, **labels) -> float | None:
    """The ``q`` quantile of histogram ``name`` over the run (after − before, summed over replicas), interpolated
    linearly inside its bucket as Prometheus' ``histogram_quantile`` does; ``None`` without observations."""
    bounds = {dict(key[1])["le"] for key in after if key[0] == f"{name}_bucket"}
    buckets = sorted((float(le), _delta(before, after, f"{name}_bucket", **labels, le=le)) for le in bounds)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):  # Prometheus answers the highest finite bound
                return lower
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


def server_view(before: dict, after: dict, task: str = "image") -> dict:
    """Queue wait and executed batch sizes during the run, from the server's histograms (``task`` label)."""
    labels = {"stage": "0", "task": task}
    batches = _delta(before, after, "vllm_omni:batch_num_requests_count", **labels)
    requests = _delta(before, after, "vllm_omni:batch_num_requests_sum", **labels)
    waits = _delta(before, after, "vllm_omni:request_queue_time_seconds_count", **labels)
    wait_s = _delta(before, after, "vllm_omni:request_queue_time_seconds_sum", **labels)
    exec_s = _delta(before, after, "vllm_omni:batch_execution_time_seconds_sum", **labels)
    p90_wait_s = histogram_quantile(0.9, before, after, "vllm_omni:request_queue_time_seconds", **labels)
    by_replica = {
        dict(key[1])["replica"]: 0.0
        for key in after
        if key[0] == "vllm_omni:batch_num_requests_sum" and "replica" in dict(key[1])
    }
    by_replica = {
        r: int(_delta(before, after, "vllm_omni:batch_num_requests_sum", **labels, replica=r)) for r in by_replica
    }
    histogram, below = {}, 0.0
    for le in ("1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0"):
        cumulative = _delta(before, after, "vllm_omni:batch_num_requests_bucket", **labels, le=le)
        if cumulative - below:
            histogram[f"<={int(float(le))}"] = int(cumulative - below)
        below = cumulative
    return {
        "executed_batches": int(batches),
        "mean_batch_size": round(requests / batches, 3) if batches else None,
        "batch_size_histogram": histogram,
        "mean_queue_wait_ms": round(1000 * wait_s / waits, 3) if waits else None,
        "p90_queue_wait_ms_est": round(1000 * p90_wait_s, 3) if p90_wait_s is not None else None,
        "mean_batch_exec_ms": round(1000 * exec_s / batches, 2) if batches else None,
        "requests_by_replica": {r: n for r, n in sorted(by_replica.items(), key=lambda item: int(item[0])) if n},
    }


async def _rss_sampler(session, base_url: str, peak: list[float], stop: asyncio.Event, interval_s: float) -> None:
    while not stop.is_set():
        samples = await scrape(session, base_url)
        peak[0] = max(peak[0], samples.get(("process_resident_memory_bytes", ()), 0.0))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)  # a scrape costs the server ~2 ms of its loop


async def run_benchmark(
    base_url: str,
    *,
    shapes: list[Shape],
    num_requests: int,
    concurrency: int | None = None,
    request_rate: float | None = None,
    warmup: int = 2,
    api_key: str | None = None,
    model: str | None = None,
    seed: int = 0,
    progress: bool = True,
    task: str = "image",
    poll_ms: float = 20.0,
    rss_interval_s: float | None = 2.0,
    on_window: Callable[[str], None] | None = None,
    strength: float = EDIT_STRENGTH,
    mask: bool = False,
) -> dict:
    """``rss_interval_s``: how often the server's RSS is sampled during the run (``None``: never, e.g. when
    scraping would skew a CPU measurement). ``on_window("start")`` / ``on_window("end")`` are called right
    before the first and right after the last measured request (warm-up and ``/metrics`` scrapes outside).
    ``strength`` and ``mask``: the edits' (``task="edit"``)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, not {task!r}")
    # The edits' files, encoded before the run: one input image (and mask) per size.
    uploads = {
        (s.width, s.height): (
            png_bytes(edit_image(s.width, s.height)),
            openai_mask_png(edit_mask(s.width, s.height)) if mask else None,
        )
        for s in (shapes if task == "edit" else ())
    }
    rng = random.Random(seed)
    plan = rng.choices(shapes, weights=[s.weight for s in shapes], k=num_requests)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:

        async def send_image(i: int, shape: Shape) -> dict:
            body = {
                "prompt": PROMPTS[i % len(PROMPTS)],
                "size": f"{shape.width}x{shape.height}",
                "num_inference_steps": shape.steps,
                "seed": seed + i,
                "response_format": "b64_json",
            }
            if model:
                body["model"] = model
            return await post_images("generations", shape, json=body)

        async def send_edit(i: int, shape: Shape) -> dict:
            form = aiohttp.FormData()
            for name, value in (
                ("prompt", PROMPTS[i % len(PROMPTS)]),
                ("size", f"{shape.width}x{shape.height}"),
                ("num_inference_steps", shape.steps),
                ("strength", strength),
                ("seed", seed + i),
                ("response_format", "b64_json"),
                *((("model", model),) if model else ()),
            ):
                form.add_field(name, str(value))
            image, mask_png = uploads[shape.width, shape.height]
            form.add_field("image", image, filename="image.png", content_type="image/png")
            if mask_png is not None:
                form.add_field("mask", mask_png, filename="mask.png", content_type="image/png")
            return await post_images("edits", shape, data=form)

        async def post_images(route: str, shape: Shape, **body) -> dict:
            """One Images API request: its status, latency and image count (and error)."""
            started = time.perf_counter()
            async with session.post(f"{base_url}/v1/images/{route}", **body) as response:
                payload = await response.json()
            latency = time.perf_counter() - started
            images = len(payload.get("data", [])) if response.status == 200 else 0
            result = {"status": response.status, "latency_s": latency, "images": images, "shape": str(shape)}
            if response.status != 200:
                result["error"] = payload.get("error")
            return result

        async def send_video(i: int, shape: Shape) -> dict:
            body = {
                "prompt": PROMPTS[i % len(PROMPTS)],
                "size": f"{shape.width}x{shape.height}",
                "num_inference_steps": shape.steps,
                "seed": seed + i,
            }
            if shape.frames is not None:
                body["num_frames"] = shape.frames
            if model:
                body["model"] = model
            started = time.perf_counter()
            async with session.post(f"{base_url}/v1/videos", json=body) as response:
                job = await response.json()
            status = response.status
            while status == 200 and job["status"] in ("queued", "in_progress"):
                await asyncio.sleep(poll_ms / 1000)
                async with session.get(f"{base_url}/v1/videos/{job['id']}") as response:
                    job, status = await response.json(), response.status
            latency = time.perf_counter() - started
            result = {"status": status, "latency_s": latency, "videos": 0, "shape": str(shape)}
            if status == 200 and job["status"] == "completed":
                result["videos"] = 1
            elif status == 200:  # the job failed: counted as a failure with its error code
                result["status"], result["error"] = f"job {job['status']}", job.get("error")
            else:
                result["error"] = job.get("error")
            return result

        send = {"image": send_image, "edit": send_edit, "video": send_video}[task]

        # Warm-up requests get indices (so seeds) after the measured ones: seeds must be >= 0.
        for i, shape in enumerate(shapes * warmup):
            n = concurrency or 1
            done = await asyncio.gather(*(send(num_requests + i * n + j, shape) for j in range(n)))
            if bad := [r for r in done if r["status"] != 200]:
                raise RuntimeError(f"warm-up request failed: {bad[0]['status']} {bad[0].get('error')}")

        before = await scrape(session, base_url)
        peak_rss, stop = [before.get(("process_resident_memory_bytes", ()), 0.0)], asyncio.Event()
        if rss_interval_s is not None:
            sampler = asyncio.create_task(_rss_sampler(session, base_url, peak_rss, stop, rss_interval_s))
        bar = tqdm(total=num_requests, disable=not progress, desc="requests", unit="req")
        results: list[dict] = []

        async def tracked(i: int, shape: Shape) -> None:
            results.append(await send(i, shape))
            bar.update()

        if on_window:
            on_window("start")
        started = time.perf_counter()
        if request_rate:
            # Poisson arrivals on an absolute schedule: a late wake-up does not push back later arrivals.
            tasks, arrival = [], 0.0
            for i, shape in enumerate(plan):
                if (delay := started + arrival - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(tracked(i, shape)))
                arrival += rng.expovariate(request_rate)
            await asyncio.gather(*tasks)
        else:
            queue = list(enumerate(plan))[::-1]

            async def client() -> None:
                while queue:
                    await tracked(*queue.pop())

            await asyncio.gather(*(client() for _ in range(concurrency)))
        duration = time.perf_counter() - started
        if on_window:
            on_window("end")
        bar.close()
        stop.set()
        if rss_interval_s is not None:
            await sampler
        after = await scrape(session, base_url)

    ok = [r for r in results if r["status"] == 200]
    latencies = sorted(r["latency_s"] for r in ok)

    def pct(q: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 4) if latencies else None

    outputs = "videos" if task == "video" else "images"
    edit = {"strength": strength, "mask": mask} if task == "edit" else {}
    return {
        "base_url": base_url,
        "task": task,
        **edit,
        "mode": f"rate={request_rate}/s" if request_rate else f"concurrency={concurrency}",
        "shapes": [str(s) for s in shapes],
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failed_statuses": sorted({r["status"] for r in results if r["status"] != 200}, key=str),
        "errors": [r["error"] for r in results if r.get("error")][:5],
        "duration_s": round(duration, 3),
        "requests_per_s": round(len(ok) / duration, 3),
        f"{outputs}_per_s": round(sum(r[outputs] for r in ok) / duration, 3),
        "latency_mean_s": round(statistics.fmean(latencies), 4) if latencies else None,
        "latency_p50_s": pct(0.50),
        "latency_p90_s": pct(0.90),
        "latency_p99_s": pct(0.99),
        "latencies_s": [round(x, 5) for x in latencies],
        # Edits run on the image engine: its metrics carry task="image".
        "server": server_view(before, after, "video" if task == "video" else "image")
        | {"peak_rss_mb": round(peak_rss[0] / 2**20, 1)},
    }


TASKS = ("image", "video", "edit")


def offline_ceiling(
    model: str,
    *,
    task: str,
    shape: Shape,
    batch: int,
    reps: int = 5,
    dtype: str = "auto",
    strength: float = EDIT_STRENGTH,
    mask: bool = False,
) -> dict:
    """The ceiling of the same work: ``bench_offline.py --thread best`` (each thread variant in a fresh process, the
    faster kept) for ``shape`` at batch ``batch``; its row for that batch, with the pipeline it ran."""
    if task not in ("image", "edit"):
        raise ValueError(f"no offline ceiling for task {task!r}")
    from bench_offline import Edit, run_best

    offline = run_best(
        model,
        batches=[batch],
        shapes=[shape],
        reps=reps,
        dtype=dtype,
        edit=Edit(strength, mask) if task == "edit" else None,
    )
    [row] = offline["results"]
    keep = ("model", "task", "strength", "mask", "pipeline", "device", "dtype", "torch_threads", "reps")
    return {key: offline[key] for key in keep if key in offline} | row


def with_efficiency(result: dict, ceiling: dict) -> dict:
    """``result`` with the ceiling and the batching efficiency: served images/s ÷ ceiling images/s."""
    return result | {
        "ceiling_images_per_s": ceiling["images_per_s"],
        "efficiency": round(result["images_per_s"] / ceiling["images_per_s"], 3),
        "ceiling": ceiling,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop with this many clients (default 1)")
    load.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--shapes", default="32x32:4", help="comma-separated WxH:STEPS[:WEIGHT] (video: WxH[xFRAMES]:STEPS[:WEIGHT])"
    )
    parser.add_argument(
        "--task", choices=TASKS, default="image", help="Images API (generations or edits) or Videos API"
    )
    parser.add_argument("--strength", type=float, default=EDIT_STRENGTH, help="edit: how far the image is noised")
    parser.add_argument("--mask", action="store_true", help="edit: inpainting (OpenAI's mask of the centre square)")
    parser.add_argument(
        "--offline-model", help="then the offline ceiling of the same work with this model folder: efficiency"
    )
    parser.add_argument("--offline-reps", type=int, default=5, help="ceiling: timed batch calls (median)")
    parser.add_argument(
        "--offline-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="as the server's"
    )
    parser.add_argument("--poll-ms", type=float, default=20.0, help="video: how often a job is polled")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds per shape (not measured)")
    parser.add_argument("--api-key")
    parser.add_argument("--model", help="the request's model field (a served model name)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    if args.offline_model and (args.request_rate or len(shapes) != 1 or args.task == "video"):
        parser.error("--offline-model: a closed loop (--concurrency) with one shape, task image or edit")
    if args.mask and args.task != "edit":
        parser.error("--mask: for --task edit")
    result = asyncio.run(
        run_benchmark(
            args.base_url.rstrip("/"),
            shapes=shapes,
            num_requests=args.num_requests,
            concurrency=None if args.request_rate else (args.concurrency or 1),
            request_rate=args.request_rate,
            warmup=args.warmup,
            api_key=args.api_key,
            model=args.model,
            seed=args.seed,
            task=args.task,
            poll_ms=args.poll_ms,
            strength=args.strength,
            mask=args.mask,
        )
    )
    if args.offline_model:
        ceiling = offline_ceiling(
            args.offline_model,
            task=args.task,
            shape=shapes[0],
            batch=args.concurrency or 1,
            reps=args.offline_reps,
            dtype=args.offline_dtype,
            strength=args.strength,
            mask=args.mask,
        )
        result = with_efficiency(result, ceiling)
    emit(result, args.json)


if __name__ == "__main__":
    main()
