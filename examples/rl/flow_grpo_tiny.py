"""Flow-GRPO on a tiny SD3 on the CPU: vllm-omni does the rollouts, a plain PyTorch trainer the updates.

    python examples/rl/flow_grpo_tiny.py [--iterations 4] [--group-size 4] [--steps 4] [--out-dir flow-grpo-out]
        [--model DIR] [--execution-mode request|step]

Each iteration:

1. Rollouts: every prompt is sent ``--group-size`` times with different seeds (one group), through ``Omni``
   (inline, ``max_num_seqs`` = the group size), with Flow-GRPO's SDE sampling (``sde_type='sde'``) on a window of
   2 of the first 3 steps, ``logprobs=True`` and classifier-free guidance with a negative prompt. Each output
   carries its trajectory: the latents before and after each window step, their timesteps and sigmas, the
   engine's log-prob of each step, and the prompt embeddings the denoiser saw.
2. Reward: how close each image's mean colour is to ``TARGET_RGB`` (`reward`), normalised within its group into
   advantages (GRPO).
3. The trainer, holding its own float32 copy of the denoiser, recomputes the guided velocity of every recorded
   transition (CFG rows as SD3's pipeline runs them) and its log-prob with `vllm_omni.diffusion.features.sde.transition`
   and `log_prob`, the engine's own math. With the trainer's weights still equal to the engine's, that is the
   engine's log-prob again: the train-inference mismatch (max |trainer - engine|), which must stay <= 1e-5.
4. PPO-clip loss on the ratio exp(new - old), one optimizer step, and ``omni.update_weights`` with the trainer's
   weights (timed: the weight sync). The next iteration's outputs say in ``metrics.weights_version`` which
   weights made them, and the script checks it is the new one.

It prints one line per iteration and writes ``flow_grpo.json`` and ``flow_grpo.png`` (reward and mismatch per
iteration) to ``--out-dir``; the exit code is 1 when the mismatch exceeds the bound. Without ``--model`` it builds
the tiny random-weight SD3 into ``OUT_DIR/tiny-sd3``: its images are coloured noise, so the reward is only there
to show the loop turning (docs/rl.md, "A worked loop").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.features.sde import SdeSettings, log_prob, transition

PROMPTS = ["a red apple on a table", "a sunset over the sea"]
NEGATIVE_PROMPT = "blurry, low quality"
TARGET_RGB = (1.0, 0.5, 0.0)
"""The colour the reward pulls the images' mean towards (orange)."""
SIZE, GUIDANCE_SCALE = 32, 4.5
SDE = {"sde_type": "sde", "noise_level": 0.7, "sde_window_size": 2, "sde_window_range": [0, 3], "logprobs": True}
"""The request's stochastic sampling (verl-omni's names): Flow-GRPO's SDE on a window of 2 steps within the first
3 (it starts at step 0 or 1, drawn per request from its seed); the other steps are plain Euler."""
MISMATCH_BOUND = 1e-5
"""In float32, on both sides: the engine runs ``dtype="float32"`` (on CUDA its default would be bfloat16)."""
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the trainer runs: where the engine runs too."""
LEARNING_RATE, CLIP_RANGE, ADV_CLIP = 1e-2, 1e-4, 5.0
"""AdamW's learning rate (large, so that four steps on a tiny random model move the reward visibly; a real model
trains at a far smaller one), PPO's ratio clip and the advantage clip (Flow-GRPO's)."""


def reward(image) -> float:
    """1 − the distance of the image's mean RGB (in [0, 1]) from `TARGET_RGB`, over the largest such distance
    (√3): 1 for a uniform image of the target colour. Deterministic, and cheap next to the rollout."""
    mean = np.asarray(image.convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(axis=0) / 255
    return 1 - float(np.linalg.norm(mean - np.array(TARGET_RGB))) / math.sqrt(3)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``[prompts, G]`` rewards → GRPO advantages: normalised within each prompt's group, clipped."""
    mean, std = rewards.mean(dim=1, keepdim=True), rewards.std(dim=1, keepdim=True)
    return ((rewards - mean) / (std + 1e-4)).clamp(-ADV_CLIP, ADV_CLIP)


class Trainer:
    """The policy side: a float32 copy of the denoiser, its optimizer, and the log-prob of recorded transitions."""

    def __init__(self, model: str, settings: SdeSettings):
        from diffusers import SD3Transformer2DModel

        self.transformer = SD3Transformer2DModel.from_pretrained(
            model, subfolder="transformer", torch_dtype=torch.float32
        )
        self.transformer.to(DEVICE).eval()  # no dropout: the same function as the engine's copy
        self.optimizer = torch.optim.AdamW(self.transformer.parameters(), lr=LEARNING_RATE)
        self.settings = settings

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """The guided velocity, as StableDiffusion3Pipeline computes it: one forward over ``[uncond, cond]`` rows,
        then uncond + guidance_scale · (cond − uncond)."""
        out = self.transformer(
            hidden_states=torch.cat([latents, latents]),
            timestep=torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]]),
            pooled_projections=torch.cat([embeds["negative_pooled_prompt_embeds"], embeds["pooled_prompt_embeds"]]),
            return_dict=False,
        )[0]
        uncond, cond = out.chunk(2)
        return uncond + GUIDANCE_SCALE * (cond - uncond)

    def log_probs(self, batch: dict) -> torch.Tensor:
        """``[T]``: the log-prob under the trainer's weights of each recorded transition x → x' (with gradients)."""
        v = self.velocity(batch["x"], batch["t"], batch["embeds"])
        rows = []
        for i in range(len(v)):
            sigma, sigma_next, second = (float(s) for s in batch["sigmas"][i])
            mean, std = transition(self.settings, batch["x"][i : i + 1], v[i : i + 1], sigma, sigma_next, second)
            rows.append(log_prob(self.settings, batch["x_next"][i : i + 1], mean, std))
        return torch.cat(rows)


def transitions(outputs, advantages: torch.Tensor) -> dict:
    """Every recorded transition of the rollouts as one batch: x, x', timestep, (σ, σ', the schedule's second σ),
    the denoiser's text inputs, the engine's log-prob and the output's advantage."""
    x, x_next, t, sigmas, old, adv = [], [], [], [], [], []
    embeds: dict[str, list[torch.Tensor]] = {}
    for output, advantage in zip(outputs, advantages.flatten().tolist(), strict=True):
        latents, s = output.trajectory_latents[0], output.trajectory_sigmas  # [W + 1, ...], [W + 1]
        for j in range(len(output.trajectory_timesteps)):
            x.append(latents[j])
            x_next.append(latents[j + 1])
            t.append(output.trajectory_timesteps[j])
            # `transition` needs the schedule's second σ only at σ = 1, i.e. when the window starts at step 0,
            # and then it is the trajectory's second σ.
            sigmas.append((s[j], s[j + 1], s[1]))
            old.append(output.trajectory_log_probs[0, j])
            adv.append(advantage)
            for name, value in output.prompt_embeds.items():
                embeds.setdefault(name, []).append(value[0])
    return {
        "x": torch.stack(x).to(DEVICE),
        "x_next": torch.stack(x_next).to(DEVICE),
        "t": torch.stack(t).to(DEVICE),
        "sigmas": sigmas,
        "embeds": {name: torch.stack(rows).to(DEVICE) for name, rows in embeds.items()},
        "old_log_probs": torch.stack(old).to(DEVICE),
        "advantages": torch.tensor(adv, dtype=torch.float32, device=DEVICE),
    }


def ppo_loss(new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's clipped surrogate over the transitions (no KL term)."""
    ratio = torch.exp(new - old)
    clipped = torch.clamp(ratio, 1 - CLIP_RANGE, 1 + CLIP_RANGE)
    return torch.maximum(-advantages * ratio, -advantages * clipped).mean()


def rollout_params(iteration: int, group_size: int, steps: int) -> list[OmniDiffusionSamplingParams]:
    """One request per (prompt, group member), each with its own seed."""
    return [
        OmniDiffusionSamplingParams(
            height=SIZE,
            width=SIZE,
            num_inference_steps=steps,
            guidance_scale=GUIDANCE_SCALE,
            negative_prompt=NEGATIVE_PROMPT,
            seed=10_000 * iteration + group_size * p + g,
            extra_args=dict(SDE),
        )
        for p in range(len(PROMPTS))
        for g in range(group_size)
    ]


def plot(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    iterations = [h["iteration"] for h in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    top.plot(iterations, [h["reward_mean"] for h in history], marker="o")
    top.set_ylabel("mean reward")
    top.set_title("Flow-GRPO on a tiny SD3 (vllm-omni rollouts)")
    bottom.semilogy(iterations, [max(h["mismatch"], 1e-12) for h in history], marker="o", label="max |Δ log-prob|")
    bottom.axhline(MISMATCH_BOUND, color="red", linestyle="--", label="bound 1e-5")
    bottom.set_ylabel("train–inference mismatch")
    bottom.set_xlabel("iteration")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4, help="outputs per prompt (G); also max_num_seqs")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (at least 3: the SDE window's range)")
    parser.add_argument("--out-dir", default="flow-grpo-out")
    parser.add_argument("--model", help="an SD3 diffusers folder (default: build the tiny one into OUT_DIR)")
    parser.add_argument("--execution-mode", choices=["request", "step"], default="request")
    args = parser.parse_args(argv)
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (advantages are normalised within a group)")
    if args.steps < SDE["sde_window_range"][1]:
        parser.error(f"--steps must be at least {SDE['sde_window_range'][1]} (the SDE window's range)")

    os.makedirs(args.out_dir, exist_ok=True)
    model = args.model
    if model is None:
        from vllm_omni.testing.models.tiny import make_tiny_model

        model = os.path.join(args.out_dir, "tiny-sd3")
        if not os.path.isfile(os.path.join(model, "model_index.json")):
            make_tiny_model(model, "sd3")

    settings = SdeSettings.of(rollout_params(0, 1, args.steps)[0], args.steps)
    trainer = Trainer(model, settings)
    history: list[dict] = []
    with Omni(model=model, max_num_seqs=args.group_size, execution_mode=args.execution_mode, dtype="float32") as omni:
        for iteration in range(args.iterations):
            # 1. Rollouts: G requests per prompt, batched by the engine.
            started = time.perf_counter()
            prompts = [p for p in PROMPTS for _ in range(args.group_size)]
            outputs = omni.generate(prompts, rollout_params(iteration, args.group_size, args.steps))
            rollout_s = time.perf_counter() - started
            for output in outputs:
                if output.error is not None:
                    raise RuntimeError(f"rollout failed: {output.error}")
            # Every rollout of an iteration ran on one weights version, newer than the last iteration's.
            versions = sorted({o.metrics.weights_version for o in outputs})
            if len(versions) != 1 or (history and versions[0] <= history[-1]["weights_version"]):
                raise RuntimeError(f"iteration {iteration} ran on weights versions {versions}, not one newer one")
            version = versions[0]

            # 2. Rewards and group-normalised advantages.
            rewards = torch.tensor([reward(o.images[0]) for o in outputs]).view(len(PROMPTS), args.group_size)
            advantages = group_advantages(rewards)

            # 3. The trainer's log-probs of the engine's transitions, with the engine's weights: the mismatch.
            started = time.perf_counter()
            batch = transitions(outputs, advantages)
            new = trainer.log_probs(batch)
            mismatch = (new.detach() - batch["old_log_probs"]).abs().max().item()

            # 4. PPO-clip step, then the new weights to the engine.
            loss = ppo_loss(new, batch["old_log_probs"], batch["advantages"])
            trainer.optimizer.zero_grad()
            loss.backward()
            trainer.optimizer.step()
            train_s = time.perf_counter() - started
            weights = trainer.transformer.state_dict()  # by diffusers' names, as the engine's copy has them
            weight_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
            started = time.perf_counter()
            omni.update_weights(weights)
            sync_s = time.perf_counter() - started
            history.append(
                {
                    "iteration": iteration,
                    "weights_version": version,
                    "transitions": len(new),
                    "mismatch": mismatch,
                    "reward_mean": rewards.mean().item(),
                    "reward_std": rewards.std().item(),
                    "loss": loss.item(),
                    "rollout_s": rollout_s,
                    "train_s": train_s,
                    "weight_sync_s": sync_s,
                    "weight_mb": weight_mb,
                }
            )
            print(
                f"iteration {iteration}: mismatch {mismatch:.2e} over {len(new)} transitions, "
                f"reward {rewards.mean():.4f}, loss {loss.item():+.4f}, rollouts {rollout_s:.2f} s, "
                f"train {train_s:.2f} s, weight sync {sync_s * 1000:.1f} ms ({weight_mb:.2f} MB)",
                flush=True,
            )

    worst = max(h["mismatch"] for h in history)
    result = {
        "model": model,
        "execution_mode": args.execution_mode,
        "group_size": args.group_size,
        "steps": args.steps,
        "prompts": PROMPTS,
        "sde": SDE,
        "target_rgb": TARGET_RGB,
        "mismatch_bound": MISMATCH_BOUND,
        "max_mismatch": worst,
        "iterations": history,
    }
    with open(os.path.join(args.out_dir, "flow_grpo.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(history, os.path.join(args.out_dir, "flow_grpo.png"))
    ok = worst <= MISMATCH_BOUND
    print(
        f"max mismatch {worst:.2e} ({'within' if ok else 'ABOVE'} the bound {MISMATCH_BOUND:.0e}); "
        f"wrote {args.out_dir}/flow_grpo.json and .png"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
