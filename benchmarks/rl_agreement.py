"""How far a rollout's trajectory moves with what it ran beside (docs/rl.md): per family and ``sde_type``, a group
of N stochastic requests batched against each request alone, and request mode against step mode, as the largest
absolute difference of the recorded latents and log-probabilities (the bar: 1e-5 in float32).

    python benchmarks/rl_agreement.py --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO, publish  # noqa: E402

CASES = (("sd3", "sde"), ("flux", "cps"), ("wan", "dance_sde"))
BAR = 1e-5


def _rollouts(model: str, mode: str, sde_type: str, group: int, steps: int) -> tuple[list, list]:
    """The group batched (``max_num_seqs`` = its size), then each of its requests alone."""
    from vllm_omni import Omni, OmniDiffusionSamplingParams

    extra = {"sde_type": sde_type, "noise_level": 0.5, "logprobs": True, "sde_window_size": 2}
    params = [
        OmniDiffusionSamplingParams(
            height=32, width=32, num_inference_steps=steps, seed=seed, guidance_scale=4.0, extra_args=extra
        )
        for seed in range(group)
    ]
    prompts = [f"rollout {i}" for i in range(group)]
    with Omni(model=model, max_num_seqs=group, execution_mode=mode) as omni:
        batched = omni.generate(prompts, params)
        alone = [omni.generate(prompt, p)[0] for prompt, p in zip(prompts, params, strict=True)]
    return batched, alone


def _largest(pairs) -> dict[str, float]:
    """The largest absolute difference of the latents and of the log-probabilities over ``pairs`` of outputs."""
    pairs = list(pairs)
    return {
        field: max(
            float((getattr(a, f"trajectory_{field}") - getattr(b, f"trajectory_{field}")).abs().max()) for a, b in pairs
        )
        for field in ("latents", "log_probs")
    }


def measure(family: str, sde_type: str, model: str, group: int, steps: int) -> dict:
    runs = {mode: _rollouts(model, mode, sde_type, group, steps) for mode in ("request", "step")}
    row = {"family": family, "sde_type": sde_type, "group": group, "steps": steps}
    for mode, (batched, alone) in runs.items():
        row[f"{mode}_batched_vs_alone"] = _largest(zip(batched, alone, strict=True))
    row["request_vs_step"] = _largest(zip(runs["request"][0], runs["step"][0], strict=True))
    row["within_bar"] = all(
        value <= BAR for key, found in row.items() if isinstance(found, dict) for value in found.values()
    )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| family | sde_type | N | comparison | latents max abs diff | log-probs max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        for comparison in ("request_batched_vs_alone", "step_batched_vs_alone", "request_vs_step"):
            found = row[comparison]
            lines.append(
                f"| {row['family']} | {row['sde_type']} | {row['group']} | {comparison.replace('_', ' ')} | "
                f"{found['latents']:.2e} | {found['log_probs']:.2e} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=4, help="requests per group (N)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model-dir", default=os.path.join(REPO, ".tiny-models"), help="where tiny models are built")
    parser.add_argument("--out-dir", help="write <name>.json and .md here")
    parser.add_argument("--name", default="rl-agreement")
    args = parser.parse_args(argv)
    from vllm_omni.testing.models.tiny import make_tiny_model

    rows = []
    for family, sde_type in CASES:
        model = os.path.join(args.model_dir, family)
        if not os.path.isdir(model):
            make_tiny_model(model, family)
        rows.append(measure(family, sde_type, model, args.group, args.steps))
    publish({"bar": BAR, "rows": rows}, table(rows), args.out_dir, args.name)


if __name__ == "__main__":
    main()
