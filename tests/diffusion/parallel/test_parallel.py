"""`RankGroup`: one pipeline call on two gloo ranks (one torch thread each), alone or a batch of 4 prompts, gives the
single-process images, with the denoiser split by diffusers' context parallelism (Ulysses) or by CFG-parallel."""

import multiprocessing
import os
import re
import subprocess

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from vllm_omni.diffusion.engine.roles import DiffusionRole
from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.parallel.ranks import RankGroup, _next_call, enable_context_parallel
from vllm_omni.errors import SamplingParamsError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams
from vllm_omni.testing.processes.server import PreloadedProcess, run_as_main

pytestmark = pytest.mark.slow


PROMPTS = ["a red fox", "a blue car on a road", "snow", "a small green frog on a leaf"]


def _call(family: str, prompt: str | list[str] = "a red fox") -> dict:
    if family == "wan":
        return dict(prompt=prompt, num_inference_steps=2, height=32, width=32, num_frames=5, output_type="np")
    return dict(prompt=prompt, num_inference_steps=2, height=64, width=64, output_type="np")


def _pixels(output, family: str) -> np.ndarray:
    return np.asarray(output.frames if family == "wan" else output.images)


@pytest.mark.parametrize("family", ["flux", "wan", "qwen_image"])
def test_ulysses_2_on_two_gloo_ranks_gives_the_single_process_image(request, family):
    model = request.getfixturevalue(f"tiny_{family}")
    # Qwen-Image's text is as long as the prompt (no padding): its token count must divide by the degree too.
    prompt = "a red fox on snow" if family == "qwen_image" else "a red fox"
    family = family.replace("_", "-")
    torch.manual_seed(0)
    alone = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    reference = _pixels(alone(**_call(family, prompt), generator=torch.Generator().manual_seed(7)), family)
    batch = _pixels(alone(**_call(family, PROMPTS), generator=torch.Generator().manual_seed(7)), family)
    group = RankGroup(model, ulysses_degree=2)
    try:
        assert group.split == ["transformer"]
        pixels = _pixels(group.call(generator=torch.Generator().manual_seed(7), **_call(family, prompt)), family)
        again = _pixels(group.call(generator=torch.Generator().manual_seed(8), **_call(family, prompt)), family)
        batched = _pixels(group.call(generator=torch.Generator().manual_seed(7), **_call(family, PROMPTS)), family)
    finally:
        group.close()
    assert pixels.shape == reference.shape and batched.shape == batch.shape == (4, *reference.shape[1:])
    assert np.abs(pixels - reference).max() <= 2 / 255
    assert np.abs(batched - batch).max() <= 2 / 255
    assert np.abs(again - reference).max() > 2 / 255  # another seed: the group runs each call anew


def test_random_weights_are_drawn_alike_on_every_rank(tmp_path):
    """``load_format: dummy`` on a folder of configs: each rank draws the weights itself, seeded, so two Ulysses ranks
    give the image that one process gives with them."""
    from vllm_omni.diffusion.pipeline.dummy_weights import dummy_components, pipeline_loader
    from vllm_omni.testing.models.full_size import make_full_size_model

    model = make_full_size_model(tmp_path / "flux", "flux", configs_only=True, size="reduced")
    built = dummy_components(model, torch.float32, torch.device("cpu"))
    alone = pipeline_loader({"_class_name": "FluxPipeline"}, True).from_pretrained(model, dtype=torch.float32, **built)
    reference = _pixels(alone(**_call("flux"), generator=torch.Generator().manual_seed(7)), "flux")
    group = RankGroup(model, ulysses_degree=2, load_format="dummy")
    try:
        pixels = _pixels(group.call(generator=torch.Generator().manual_seed(7), **_call("flux")), "flux")
    finally:
        group.close()
    assert pixels.shape == reference.shape and reference.std() > 0
    assert np.abs(pixels - reference).max() <= 2 / 255


def test_a_failed_call_is_reported_and_the_group_serves_the_next(tiny_flux):
    group = RankGroup(tiny_flux, ulysses_degree=2)
    try:
        with pytest.raises(RuntimeError, match=r"the group failed \(call\): ValueError\(.*prompt_embeds"):
            group.call(
                generator=torch.Generator().manual_seed(0),
                prompt=None,
                num_inference_steps=1,
                height=64,
                width=64,
                output_type="np",
            )
        assert _pixels(group.call(generator=torch.Generator().manual_seed(0), **_call("flux")), "flux").shape == (
            1,
            64,
            64,
            3,
        )
    finally:
        group.close()


def test_enable_context_parallel_needs_the_process_group(tiny_flux):
    pipeline = DiffusionPipeline.from_pretrained(tiny_flux, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="torch.distributed must be available and initialized"):
        enable_context_parallel(pipeline, ulysses_degree=2, ring_degree=1)


def _guided(family: str, prompt: str | list[str] = "a red fox") -> dict:
    negative = "blurry" if isinstance(prompt, str) else ["blurry"] * len(prompt)
    if family in ("wan", "sd3"):
        return {**_call(family, prompt), "negative_prompt": negative, "guidance_scale": 5.0}
    return {**_call(family, prompt), "negative_prompt": negative, "true_cfg_scale": 4.0}


@pytest.mark.parametrize("family", ["flux", "wan", "qwen_image", "sd3"])  # sd3: one call over both, split by rows
def test_cfg_2_on_two_gloo_ranks_gives_the_single_process_image(request, family):
    model = request.getfixturevalue(f"tiny_{family}")
    family = family.replace("_", "-")
    alone = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    reference = _pixels(alone(**_guided(family), generator=torch.Generator().manual_seed(7)), family)
    unguided = _pixels(alone(**_call(family), generator=torch.Generator().manual_seed(7)), family)
    batch = _pixels(alone(**_guided(family, PROMPTS), generator=torch.Generator().manual_seed(7)), family)
    group = RankGroup(model, cfg_parallel_size=2)
    try:
        assert group.split == ["transformer"]
        pixels = _pixels(group.call(generator=torch.Generator().manual_seed(7), **_guided(family)), family)
        plain = _pixels(
            group.call(generator=torch.Generator().manual_seed(7), **_call(family)), family
        )  # Flux and Qwen-Image: no negative prompt, no CFG
        batched = _pixels(group.call(generator=torch.Generator().manual_seed(7), **_guided(family, PROMPTS)), family)
    finally:
        group.close()
    assert np.abs(pixels - reference).max() <= 2 / 255
    assert np.abs(plain - unguided).max() <= 2 / 255
    assert batched.shape[0] == 4 and np.abs(batched - batch).max() <= 2 / 255


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_cfg_2_times_ulysses_2_on_four_gloo_ranks_gives_the_single_process_image(request, family):
    """Each CFG branch on a Ulysses group of its own (a cfg x ring x ulysses device mesh): four ranks."""
    model = request.getfixturevalue(f"tiny_{family}")
    alone = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    reference = _pixels(alone(**_guided(family), generator=torch.Generator().manual_seed(7)), family)
    batch = _pixels(alone(**_guided(family, PROMPTS), generator=torch.Generator().manual_seed(7)), family)
    group = RankGroup(model, cfg_parallel_size=2, ulysses_degree=2)
    try:
        assert group.world == 4 and group.split == ["transformer"]
        pixels = _pixels(group.call(generator=torch.Generator().manual_seed(7), **_guided(family)), family)
        batched = _pixels(group.call(generator=torch.Generator().manual_seed(7), **_guided(family, PROMPTS)), family)
    finally:
        group.close()
    assert np.abs(pixels - reference).max() <= 2 / 255
    assert batched.shape[0] == 4 and np.abs(batched - batch).max() <= 2 / 255


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_vae_patch_2_on_two_gloo_ranks_gives_one_ranks_tiled_image(request, family):
    model = request.getfixturevalue(f"tiny_{family}")
    call = dict(prompt=PROMPTS, num_inference_steps=2, height=128, width=96, output_type="np")  # above one tile
    alone = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    alone.vae.enable_tiling()
    reference = _pixels(alone(**call, generator=torch.Generator().manual_seed(7)), family)
    one = {**call, "prompt": PROMPTS[1]}
    reference_alone = _pixels(alone(**one, generator=torch.Generator().manual_seed(8)), family)
    group = RankGroup(model, vae_patch_parallel_size=2)
    try:
        assert group.split == ["vae"]
        pixels = _pixels(group.call(generator=torch.Generator().manual_seed(7), **call), family)
        pixels_alone = _pixels(group.call(generator=torch.Generator().manual_seed(8), **one), family)
    finally:
        group.close()
    assert pixels.shape == (4, 128, 96, 3) and pixels_alone.shape == (1, 128, 96, 3)
    assert np.abs(pixels - reference).max() <= 2 / 255
    assert np.abs(pixels_alone - reference_alone).max() <= 2 / 255


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_ring_on_the_cpu_is_refused_before_any_rank_starts(tiny_flux):
    with pytest.raises(ValueError, match="ring_degree needs an attention backend that returns the log-sum-exp"):
        RankGroup(tiny_flux, ring_degree=2)


CASES = {  # the tiny Flux's 4x4-pixel tokens always divide by 2; by 3 they may not
    "flux": (3, dict(height=40, width=40), dict(height=48, width=40), r"100 tokens \(10x10, one per 4x4 pixels"),
    "wan": (
        2,
        dict(height=48, width=80, num_frames=9),
        dict(height=48, width=64, num_frames=9),
        r"45 tokens \(3x5 x 3",
    ),
}


@pytest.mark.parametrize("family", list(CASES))
def test_a_size_whose_tokens_the_sequence_ranks_do_not_divide_is_refused_at_admission(request, family):
    """diffusers shards the denoiser's sequence in equal parts and would fail the whole batch's call."""
    ranks, size, fits, tokens = CASES[family]
    card = ModelCard.of(DiffusionPipeline.from_pretrained(request.getfixturevalue(f"tiny_{family}")))
    split = DiffusionRole.admission("request", card, sequence_ranks=ranks)
    assert split.admit(OmniDiffusionSamplingParams(num_inference_steps=2, **fits)).params.width == fits["width"]
    expected = f"{tokens}.*ulysses_degree x ring_degree = {ranks} ranks.*multiple of {card.latent_pixels * ranks}"
    with pytest.raises(SamplingParamsError, match=expected) as refused:
        split.admit(OmniDiffusionSamplingParams(num_inference_steps=2, **size))
    assert refused.value.param == "height"
    assert DiffusionRole.admission("request", card).admit(OmniDiffusionSamplingParams(num_inference_steps=2, **size))


def test_an_idle_rank_waits_on_its_inbox_and_ends_once_the_groups_owner_is_gone():
    """A rank waits for calls outside any collective (whose timeout would end an idle group), and ends when the
    process that owns the group has gone without closing it (a replica's process killed)."""
    inbox = multiprocessing.get_context("spawn").Queue()
    inbox.put({"prompt": "a red fox"})
    assert _next_call(inbox, os.getpid()) == {"prompt": "a red fox"}
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert _next_call(inbox, gone.pid) is None


def test_a_script_without_a_main_guard_is_told_the_cause_and_the_fix(tiny_flux, tmp_path):
    """The ranks start from a forkserver that imports the main script again: a script that makes its parallel `Omni`
    as it is imported (no ``if __name__ == "__main__":``) fails naming that and the guard, not only "rank(s) ended";
    each rank says it too, naming the script. The script runs as the main module of a fork of the tests' preloaded
    forkserver (the stack already imported); the ranks' forkserver is a new interpreter that imports it again."""
    script, log = tmp_path / "no_guard.py", tmp_path / "no_guard.log"
    script.write_text(f"from vllm_omni import Omni\n\nomni = Omni({tiny_flux!r}, ulysses_degree=2)\nomni.close()\n")
    # Not a daemon: the script starts the ranks' processes.
    process = PreloadedProcess(run_as_main, (str(script), [], str(tmp_path), dict(os.environ), str(log)), daemon=False)
    returncode = process.wait(600)
    stderr = log.read_text()
    assert returncode == 1, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert re.match(r"RuntimeError: rank\(s\) \[[01, ]+\] of the group ended before it answered \(ready\): ", last)
    assert f"imports the main script {script} again" in last and 'if __name__ == "__main__":' in last
    told = [line for line in stderr.splitlines() if line.startswith("RuntimeError: the ranks of a parallel")]
    assert told and all(f"imports the main script {script} again" in line for line in told)
