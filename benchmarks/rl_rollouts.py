"""RL rollouts: SDE sampling with trajectories through the engine against the same sampler in a plain loop over the
stock pipeline (the ceiling), and the time of a weight update per MB.

    python benchmarks/rl_rollouts.py                 # the published run: results/cpu-tiny-rl-rollouts.{json,md}
    python benchmarks/rl_rollouts.py [--model DIR] [--ns 1,4,8] [--modes request,step] [--size 64x64] [--steps 8]
        [--rollouts 16] [--reps 5] [--update-sizes 32x2,128x4,384x8] [--quick] [--out-dir DIR] [--name NAME]

A rollout is one request of Flow-GRPO's SDE sampling (``sde_type 'sde'``, ``noise_level`` 0.7, every step
stochastic, so the whole trajectory is recorded), with classifier-free guidance and a negative prompt, on a tiny
random-weight SD3 (``--model``, or the one built once into ``--model-dir``). A *wave* is N rollouts at once (N
prompts, N seeds), as a trainer sends a group; each measurement runs ``--rollouts`` rollouts as waves of N, and
rollouts/s is those over its wall time. Per N in ``--ns``, with ``logprobs`` on and off:

- ``request`` / ``step``: ``Omni.generate`` of the wave on an inline engine with ``max_num_seqs`` N in that
  execution mode (request mode with ``request_batch_max_wait_ms`` 50, so a wave is one batch: a full batch
  starts at once, the wait only bounds a partial one);
- ``ceiling``: the same work in a plain loop over the stock ``StableDiffusion3Pipeline``, loaded as the engine
  loads it: its ``encode_prompt`` (with the negative prompts), ``prepare_latents`` with one generator per row
  (the engine's seeds), the scheduler's timesteps, then per step one transformer call on the batch of 2N rows
  (``[uncond, cond]``, as the pipeline runs CFG) and per row the SDE step of `vllm_omni.diffusion.features.sde`
  (``transition``, the noise from the row's `sde_generator`, ``log_prob`` when asked), its latents kept as the
  trajectory; then the VAE decode and PIL images, as the pipeline ends. It draws what the engine draws: the JSON
  gives the largest |ceiling − engine| log-prob over the first wave of each N (``same_work``).

Each engine and the ceiling run in worker processes of their own (forked from the preloaded forkserver,
`engine_workers.WORKERS`), all torch work of a process on one thread: the engine's thread, or the ceiling
worker's main thread (docs/performance.md: a second thread running torch slows every forward). All are up before
any is measured; each of the ``--reps`` reps runs, per N, every (variant, logprobs) in turn, the order rotating
per rep, so a shared machine's drift hits all alike. Each measurement is preceded by one untimed wave in the same
worker (other seeds), its warm-up. On the 2-core machine a measurement during which another process takes a core
runs several times slower (each op's 2-thread OpenMP team waits for its descheduled thread): ``others`` shows it.

Per row: rollouts/s (median over the reps), ``÷ ceiling`` (per rep, engine ÷ the ceiling of the same N and
logprobs in that rep; the median over the reps), ``best ÷ best ceiling`` (the fastest rep of each: other work only
ever slows a measurement down), the mean batch (each output's ``metrics.batch_size``) and ``others``: the
machine's busy cores that were not this benchmark's processes during the measurement (psutil; median over the
reps), i.e. how quiet the machine was.

Weight updates: per size in ``--update-sizes`` (``WIDTHxLAYERS`` of the SD3 transformer; the tiny model's own is
32x2), a folder with a random transformer of that size and the tiny model's other components (built once under
``--model-dir``), an engine on it in a worker of its own, and ``Omni.update_weights`` of the whole transformer
state dict (as a trainer sends it: the model's own tensors, slightly perturbed; two such dicts, alternating)
timed ``--update-reps`` times while the engine idles: ms, MB and ms per MB (median), and the weights version a
rollout after the last update reports.

Nothing is asserted and the exit code says nothing about speed. Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import traceback

from common import PROMPTS, cpu_seconds, publish
from engine_workers import WORKERS, PipeWorker
from step_batching import HERE, _device, cached_model

NEGATIVE_PROMPT = "blurry, low quality"
GUIDANCE_SCALE = 4.5
SDE = {"sde_type": "sde", "noise_level": 0.7}
REQUEST_WAIT_MS = 50.0


def wave(n: int, first_seed: int) -> list[tuple[str, int]]:
    """N rollouts: (prompt, seed)."""
    return [(PROMPTS[(first_seed + i) % len(PROMPTS)], first_seed + i) for i in range(n)]


def params(seed: int, logprobs: bool, spec: dict):
    from vllm_omni import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(
        height=spec["height"],
        width=spec["width"],
        num_inference_steps=spec["steps"],
        guidance_scale=GUIDANCE_SCALE,
        negative_prompt=NEGATIVE_PROMPT,
        seed=seed,
        extra_args={**SDE, "logprobs": logprobs},
    )


# The engine side: Omni in a worker process.


class EngineRollouts:
    """Waves through an inline `Omni` with ``max_num_seqs`` N in one execution mode."""

    def __init__(self, model: str, n: int, mode: str):
        from vllm_omni import Omni

        wait = REQUEST_WAIT_MS if mode == "request" else 0.0
        self.omni = Omni(model, max_num_seqs=n, execution_mode=mode, request_batch_max_wait_ms=wait)

    def run(self, rollouts: list[tuple[str, int]], logprobs: bool, spec: dict) -> tuple[list, list[float]]:
        outputs = self.omni.generate([p for p, _ in rollouts], [params(s, logprobs, spec) for _, s in rollouts])
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(output.error)
        log_probs = [o.trajectory_log_probs[0].tolist() if logprobs else None for o in outputs]
        return log_probs, [o.metrics.batch_size for o in outputs]

    def close(self) -> None:
        self.omni.close()


# The ceiling: the stock pipeline in a plain loop, the same sampler.


class CeilingRollouts:
    """Waves in a plain loop over the stock pipeline, loaded as the engine loads it (device, dtype)."""

    def __init__(self, model: str):
        from vllm_omni.diffusion.pipeline.runner import load_pipeline, select_device, select_dtype

        device = select_device(None)
        self.pipeline = load_pipeline(model, select_dtype("auto", device), device)
        self.pipeline.set_progress_bar_config(disable=True)

    def run(self, rollouts: list[tuple[str, int]], logprobs: bool, spec: dict) -> tuple[list, list[float]]:
        import torch
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

        from vllm_omni.diffusion.features.sde import SdeSettings, log_prob, sde_generator, transition

        p, n, device = self.pipeline, len(rollouts), self.pipeline.device
        settings = SdeSettings(sde_type=SDE["sde_type"], noise_level=SDE["noise_level"], logprobs=logprobs)
        with torch.inference_mode():
            embeds, negative_embeds, pooled, negative_pooled = p.encode_prompt(
                prompt=[prompt for prompt, _ in rollouts],
                prompt_2=None,
                prompt_3=None,
                negative_prompt=[NEGATIVE_PROMPT] * n,
                do_classifier_free_guidance=True,
                device=device,
                num_images_per_prompt=1,
                max_sequence_length=spec["max_sequence_length"],
            )
            text = torch.cat([negative_embeds, embeds])
            pooled = torch.cat([negative_pooled, pooled])
            generators = [torch.Generator("cpu").manual_seed(seed) for _, seed in rollouts]
            latents = p.prepare_latents(
                n, p.transformer.config.in_channels, spec["height"], spec["width"], text.dtype, device, generators
            )
            timesteps, _ = retrieve_timesteps(p.scheduler, spec["steps"], device)
            sigmas = p.scheduler.sigmas
            noise_generators = [sde_generator(seed) for _, seed in rollouts]
            windows = [settings.window(g, spec["steps"]) for g in noise_generators]  # every step: draws nothing
            trajectory, step_log_probs = [latents.float()], []
            for i, t in enumerate(timesteps):
                out = p.transformer(
                    hidden_states=torch.cat([latents, latents]),
                    timestep=t.expand(2 * n),
                    encoder_hidden_states=text,
                    pooled_projections=pooled,
                    return_dict=False,
                )[0]
                uncond, cond = out.chunk(2)
                v = uncond + GUIDANCE_SCALE * (cond - uncond)
                rows, row_log_probs = [], []
                for r in range(n):
                    x = latents[r : r + 1].float()
                    if i not in windows[r]:
                        rows.append(x + (sigmas[i + 1] - sigmas[i]) * v[r : r + 1])
                        continue
                    mean, std = transition(
                        settings, x, v[r : r + 1], float(sigmas[i]), float(sigmas[i + 1]), float(sigmas[1])
                    )
                    noise = torch.randn(x.shape, generator=noise_generators[r], dtype=torch.float32).to(device)
                    sample = mean + std * noise
                    if logprobs:
                        row_log_probs.append(log_prob(settings, sample, mean, std))
                    rows.append(sample)
                latents = torch.cat(rows).to(text.dtype)
                trajectory.append(latents.float())
                if logprobs:
                    step_log_probs.append(torch.cat(row_log_probs))
            torch.stack(trajectory, dim=1)  # the trajectories, [n, steps + 1, ...], as an output holds them
            config = p.vae.config
            image = p.vae.decode(latents / config.scaling_factor + config.shift_factor, return_dict=False)[0]
            images = p.image_processor.postprocess(image, output_type="pil")
        assert len(images) == n
        log_probs = torch.stack(step_log_probs, dim=1).tolist() if logprobs else [None] * n
        return log_probs, [float(n)] * n

    def close(self) -> None:
        pass


def serve(conn, kind: str, model: str, n: int, mode: str | None) -> None:
    """A worker: loads its rollout maker (``ceiling`` or an engine), answers ``ready``, then runs
    ``(rollouts, logprobs, spec, waves)`` commands: ``waves`` waves back to back, answered with the seconds, the
    mean batch size and the first wave's log-probs; ``None`` ends it."""
    maker = None
    try:
        started = time.perf_counter()
        maker = CeilingRollouts(model) if kind == "ceiling" else EngineRollouts(model, n, mode)
        conn.send(("ready", time.perf_counter() - started))
        while (command := conn.recv()) is not None:
            waves, logprobs, spec = command
            started = time.perf_counter()
            results = [maker.run(rollouts, logprobs, spec) for rollouts in waves]
            seconds = time.perf_counter() - started
            batches = [b for _, sizes in results for b in sizes]
            conn.send(
                ("done", {"seconds": seconds, "batch_mean": statistics.fmean(batches), "log_probs": results[0][0]})
            )
    except BaseException:  # noqa: BLE001 - the main process raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        if maker is not None:
            maker.close()


class Worker(PipeWorker):
    """One rollout maker in a process of its own."""

    def __init__(self, kind: str, model: str, n: int = 0, mode: str | None = None):
        name = kind if kind == "ceiling" else f"{mode}-N{n}"
        super().__init__(name, serve, (kind, model, n, mode))

    def run(self, waves: list, logprobs: bool, spec: dict) -> dict:
        self.conn.send((waves, logprobs, spec))
        return self.answer()


# Weight updates.


def sized_model(base: str, root: str, width: int, layers: int) -> str:
    """A folder with ``base``'s components but a random SD3 transformer of ``width`` (heads × head dim) and
    ``layers`` joint blocks; ``base`` itself for its own size."""
    from diffusers import SD3Transformer2DModel

    config = dict(SD3Transformer2DModel.load_config(base, subfolder="transformer"))
    heads = config["num_attention_heads"]
    if width == heads * config["attention_head_dim"] and layers == config["num_layers"]:
        return base
    folder = os.path.join(root, f"sd3-{width}x{layers}")
    if os.path.isdir(folder):
        return folder
    os.makedirs(folder)
    for entry in os.listdir(base):
        if entry != "transformer":
            os.symlink(os.path.join(base, entry), os.path.join(folder, entry))
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config.update(attention_head_dim=width // heads, caption_projection_dim=width, num_layers=layers)
    SD3Transformer2DModel(**config).save_pretrained(os.path.join(folder, "transformer"))
    return folder


def time_updates(conn, model: str, reps: int, spec: dict) -> None:
    """A worker: ``reps`` timed ``update_weights`` of the whole transformer on an idle engine, then one rollout
    (which reports the weights version)."""
    try:
        import torch
        from diffusers import SD3Transformer2DModel

        from vllm_omni import Omni

        with Omni(model, max_num_seqs=1) as omni:
            omni.generate([PROMPTS[0]], [params(0, True, spec)])
            # What a trainer sends: its own copy's state dict, as diffusers names it (two of them, alternating).
            own = SD3Transformer2DModel.from_pretrained(model, subfolder="transformer").state_dict()
            generator = torch.Generator().manual_seed(0)
            weights = [
                {name: t + 1e-3 * torch.randn(t.shape, generator=generator, dtype=t.dtype) for name, t in own.items()}
                for _ in range(2)
            ]
            megabytes = sum(t.numel() * t.element_size() for t in weights[0].values()) / 2**20
            seconds = []
            for rep in range(reps):
                started = time.perf_counter()
                omni.update_weights(weights[rep % 2])
                seconds.append(time.perf_counter() - started)
            [output] = omni.generate([PROMPTS[0]], [params(1, True, spec)])
        conn.send(("done", {"mb": megabytes, "seconds": seconds, "weights_version": output.metrics.weights_version}))
    except BaseException:  # noqa: BLE001 - the main process raises it
        conn.send(("error", traceback.format_exc()))


def measure_updates(models: dict[str, str], reps: int, spec: dict) -> list[dict]:
    rows = []
    for label, model in models.items():
        conn, theirs = WORKERS.Pipe()
        process = WORKERS.Process(target=time_updates, args=(theirs, model, reps, spec), daemon=True)
        process.start()
        theirs.close()
        status, value = conn.recv()
        process.join(60)
        if status == "error":
            raise RuntimeError(f"update worker {label} failed:\n{value}")
        median = statistics.median(value["seconds"])
        rows.append(
            {
                "size": label,
                "mb": round(value["mb"], 3),
                "reps": reps,
                "update_ms_median": round(1000 * median, 3),
                "update_ms_min": round(1000 * min(value["seconds"]), 3),
                "ms_per_mb": round(1000 * median / value["mb"], 3),
                "mb_per_s": round(value["mb"] / median, 1),
                "weights_version_after": value["weights_version"],
            }
        )
        print(f"update_weights {label}: {value['mb']:.2f} MB in {1000 * median:.2f} ms", flush=True)
    return rows


# The run.


def measure(args, model: str, spec: dict) -> tuple[list[dict], dict]:
    """Every (N, variant, logprobs) over the reps: rows, and the ceiling-vs-engine log-prob check."""
    workers = {("ceiling", 0): Worker("ceiling", model)}
    for n in args.ns:
        for mode in args.modes:
            workers[mode, n] = Worker("engine", model, n, mode)
    try:
        ready = {w.name: round(w.answer(), 2) for w in workers.values()}
        pids = [os.getpid()]  # with its descendants: the forkserver and the workers it forked
        print(f"workers up: {ready}", flush=True)
        plan = [(n, v, lp) for n in args.ns for v in ("ceiling", *args.modes) for lp in (True, False)]

        def worker(n: int, variant: str) -> Worker:
            return workers["ceiling", 0] if variant == "ceiling" else workers[variant, n]

        figures: dict[tuple, list[dict]] = {key: [] for key in plan}
        for rep in range(args.reps):
            for n in args.ns:
                keys = [key for key in plan if key[0] == n]
                shift = rep % len(keys)
                waves = [wave(n, args.seed + w * n) for w in range(max(1, args.rollouts // n))]
                for key in keys[shift:] + keys[:shift]:
                    worker(n, key[1]).run([wave(n, 900_000)], key[2], spec)  # warm-up
                    started, (ours, machine) = time.perf_counter(), cpu_seconds(pids)
                    result = worker(n, key[1]).run(waves, key[2], spec)
                    ours_after, machine_after = cpu_seconds(pids)
                    wall = time.perf_counter() - started
                    result["other_cores"] = ((machine_after - machine) - (ours_after - ours)) / wall
                    result["rollouts_per_s"] = len(waves) * n / result["seconds"]
                    figures[key].append(result)
            print(f"rep {rep + 1}/{args.reps} done", flush=True)
    finally:
        for w in workers.values():
            w.close()
    rows = []
    for (n, variant, logprobs), reps in figures.items():
        ceiling = figures[n, "ceiling", logprobs]
        ratios = [r["rollouts_per_s"] / c["rollouts_per_s"] for r, c in zip(reps, ceiling, strict=True)]
        rows.append(
            {
                "n": n,
                "variant": variant,
                "logprobs": logprobs,
                "rollouts_per_s": round(statistics.median(r["rollouts_per_s"] for r in reps), 3),
                "rollouts_per_s_reps": [round(r["rollouts_per_s"], 3) for r in reps],
                "over_ceiling": round(statistics.median(ratios), 3),
                "over_ceiling_reps": [round(r, 3) for r in ratios],
                "best_over_best_ceiling": round(
                    max(r["rollouts_per_s"] for r in reps) / max(c["rollouts_per_s"] for c in ceiling), 3
                ),
                "batch_mean": round(statistics.median(r["batch_mean"] for r in reps), 2),
                "other_cores": round(statistics.median(r["other_cores"] for r in reps), 2),
                "other_cores_reps": [round(r["other_cores"], 2) for r in reps],
            }
        )
    same_work = {}
    for n in args.ns:
        reference = figures[n, "ceiling", True][0]["log_probs"]
        for mode in args.modes:
            engine = figures[n, mode, True][0]["log_probs"]
            same_work[f"{mode} N={n}"] = max(
                abs(a - b) for ra, rb in zip(reference, engine, strict=True) for a, b in zip(ra, rb, strict=True)
            )
    return rows, same_work


def tables(result: dict) -> str:
    lines = [
        "| N | variant | logprobs | rollouts/s | ÷ ceiling | best ÷ best ceiling | mean batch | others (cores) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ceiling = row["variant"] == "ceiling"
        ratio = "" if ceiling else f"{row['over_ceiling']:.3f}"
        best = "" if ceiling else f"{row['best_over_best_ceiling']:.3f}"
        lines.append(
            f"| {row['n']} | {row['variant']} | {'on' if row['logprobs'] else 'off'} | {row['rollouts_per_s']:.2f} | "
            f"{ratio} | {best} | {row['batch_mean']} | {row['other_cores']:.2f} |"
        )
    lines += [
        "",
        "| transformer (width x layers) | MB | update_weights ms (median) | ms per MB | MB/s |",
        "|---|---|---|---|---|",
    ]
    for row in result["updates"]:
        lines.append(
            f"| {row['size']} | {row['mb']:.2f} | {row['update_ms_median']:.2f} | {row['ms_per_mb']:.3f} | "
            f"{row['mb_per_s']:.0f} |"
        )
    worst = max(result["same_work"].values(), default=0.0)
    lines += ["", f"Same work: largest |ceiling − engine| log-prob over the first wave of each N: {worst:.2e}", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an SD3 diffusers folder (default: the tiny one, built once into --model-dir)")
    parser.add_argument("--model-dir", default=os.path.join(os.path.dirname(HERE), ".tiny-models"))
    parser.add_argument("--ns", default="1,4,8", help="rollouts at once (max_num_seqs)")
    parser.add_argument("--modes", default="request,step", help="engine execution modes")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per measurement (waves of N)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--update-sizes", default="32x2,128x4,384x8", help="transformer WIDTHxLAYERS for update_weights (32x2: tiny)"
    )
    parser.add_argument("--update-reps", type=int, default=7)
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"), help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default="cpu-tiny-rl-rollouts")
    parser.add_argument(
        "--quick", action="store_true", help="smoke: N 2, 32x32, 2 steps, one wave, 1 rep, the tiny size only"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.ns, args.size, args.steps, args.rollouts, args.reps = "2", "32x32", 2, 1, 1
        args.update_sizes, args.update_reps = "32x2", 2
    args.ns = [int(n) for n in args.ns.split(",")]
    args.modes = args.modes.split(",")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    model = os.path.abspath(args.model or cached_model(args.model_dir, "sd3"))
    width, height = (int(v) for v in args.size.split("x"))
    # max_sequence_length: StableDiffusion3Pipeline's default, which the engine takes too.
    spec = {"width": width, "height": height, "steps": args.steps, "max_sequence_length": 256}
    rows, same_work = measure(args, model, spec)
    root = os.path.join(args.model_dir, "rl-update-sizes")
    sizes = {}
    for label in args.update_sizes.split(","):
        w, layers = (int(v) for v in label.split("x"))
        sizes[label] = sized_model(model, root, w, layers)
    updates = measure_updates(sizes, args.update_reps, spec)
    if os.path.isdir(root) and not os.listdir(root):
        shutil.rmtree(root)
    result = {
        "name": args.name,
        "device": _device(),
        "cpus": os.cpu_count(),
        "config": {
            "model": model,
            "ns": args.ns,
            "modes": args.modes,
            "size": args.size,
            "steps": args.steps,
            "guidance_scale": GUIDANCE_SCALE,
            "negative_prompt": NEGATIVE_PROMPT,
            "sde": SDE,
            "rollouts": args.rollouts,
            "reps": args.reps,
            "request_batch_max_wait_ms": REQUEST_WAIT_MS,
            "seed": args.seed,
            "quick": args.quick,
        },
        "rows": rows,
        "same_work": same_work,
        "updates": updates,
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    publish(result, tables(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
