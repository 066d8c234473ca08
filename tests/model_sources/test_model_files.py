"""`local_model_folder`: a repo id through the Hugging Face cache (offline here, as the suite runs), its revisions,
what a download fetches from a local hub, and the errors that name the repo, the revision and the reason."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from huggingface_hub import snapshot_download
from safetensors.torch import load_file

from vllm_omni.config.model_source import ModelSource, ModelSourceError
from vllm_omni.model_sources.files import local_model_folder
from vllm_omni.testing.models.custom_code import make_custom_code_flux
from vllm_omni.testing.processes.hub import LocalHub, hub_online

REPO = "tiny-org/flux"


@pytest.fixture(scope="module")
def hub(tiny_flux, tmp_path_factory):
    """``tiny-org/flux`` with two commits on main (the first also tag ``v1``), ``tiny-org/flux-dup`` whose denoiser
    has a ``.bin`` copy beside its ``.safetensors`` and files no pipeline reads, a gated ``tiny-org/gated``, and
    ``tiny-org/flux-gguf``: GGUFs of the tiny Flux's transformer (`_gguf_repo`), and ``tiny-org/custom``, whose
    pipeline and transformer classes are its own code (`make_custom_code_flux`)."""
    changed = tmp_path_factory.mktemp("flux-v2") / "flux"
    shutil.copytree(tiny_flux, changed)
    scheduler = changed / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "shift": 2.5}))

    dup = tmp_path_factory.mktemp("flux-dup") / "flux"
    shutil.copytree(tiny_flux, dup)
    weights = load_file(dup / "transformer" / "diffusion_pytorch_model.safetensors")
    torch.save(weights, dup / "transformer" / "diffusion_pytorch_model.bin")
    (dup / "README.md").write_text("a model card")
    (dup / "extras").mkdir()
    (dup / "extras" / "notes.bin").write_bytes(b"\0" * 64)

    with LocalHub() as hub:
        hub.v1 = hub.publish(REPO, tiny_flux)
        hub.tag(REPO, "v1", hub.v1)
        hub.v2 = hub.publish(REPO, str(changed))
        hub.publish("tiny-org/flux-dup", str(dup))
        hub.publish("tiny-org/gated", tiny_flux)
        hub.gate("tiny-org/gated", "hf_granted")
        hub.publish("tiny-org/flux-gguf", str(_gguf_repo(tiny_flux, tmp_path_factory.mktemp("flux-gguf"))))
        hub.publish("tiny-org/custom", make_custom_code_flux(tiny_flux, tmp_path_factory.mktemp("custom") / "flux"))
        yield hub


def _gguf_repo(tiny_flux: str, folder) -> str:
    """A repo as city96's: the transformer at Q8_0 and Q4_0 (one file each), two Q5 files, a README."""
    from vllm_omni.testing.models.gguf_files import write_gguf

    for qtype in ("Q8_0", "Q4_0"):
        write_gguf(tiny_flux, "flux", str(folder / f"flux-tiny-{qtype}.gguf"), qtype)
    for name in ("flux-tiny-Q5_0.gguf", "flux-tiny-v2-Q5_0.gguf"):
        shutil.copyfile(folder / "flux-tiny-Q4_0.gguf", folder / name)
    (folder / "README.md").write_text("tiny GGUFs")
    return folder


@pytest.fixture(scope="module")
def cache(hub, tmp_path_factory):
    """The cache a user has after ``hf download tiny-org/flux`` and ``hf download tiny-org/flux --revision v1``."""
    cache = str(tmp_path_factory.mktemp("hf-cache"))
    with hub_online():
        for revision in ("main", "v1"):
            snapshot_download(REPO, revision=revision, cache_dir=cache, endpoint=hub.url, token=False)
    return cache


@pytest.mark.parametrize("revision", [None, "main", "v1", "v1-commit", "v2-commit"])
def test_offline_a_revision_loads_the_snapshot_of_its_commit(hub, cache, revision):
    commit = {None: hub.v2, "main": hub.v2, "v1": hub.v1, "v1-commit": hub.v1, "v2-commit": hub.v2}[revision]
    given = {"v1-commit": hub.v1, "v2-commit": hub.v2}.get(revision, revision)
    folder = local_model_folder(ModelSource(REPO, revision=given, download_dir=cache), ["diffusion"])
    assert folder == os.path.join(cache, "models--tiny-org--flux", "snapshots", commit)
    with open(os.path.join(folder, "scheduler", "scheduler_config.json")) as file:
        shift = json.load(file)["shift"]
    assert (shift == 2.5) == (commit == hub.v2)


@pytest.mark.parametrize(
    ("repo", "revision"), [("tiny-org/not-cached", None), (REPO, "a-branch-never-downloaded"), (REPO, "0" * 40)]
)
def test_offline_what_is_not_cached_is_a_clear_error(cache, repo, revision):
    with pytest.raises(ModelSourceError) as info:
        local_model_folder(ModelSource(repo, revision=revision, download_dir=cache), ["diffusion"])
    message = str(info.value)
    assert message.startswith(f"model {repo!r} at revision {revision or 'main'!r}: it is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1 forbids downloading" in message and cache in message


_DOWNLOAD = """
import json, sys
from vllm_omni.config.model_source import ModelSource, ModelSourceError
from vllm_omni.model_sources.files import local_model_folder
for repo, revision, token, stages, *more in json.loads(sys.argv[1]):
    sys.stdin.readline()  # the test's go: it counts the hub's downloads between calls
    base, trust = (more + [None, False])[:2]
    try:
        source = ModelSource(repo, revision=revision, hf_token=token, model_config=base)
        folder = local_model_folder(source, stages, trust)
        print(json.dumps({"folder": folder}), flush=True)
    except ModelSourceError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
"""


def _download(hub, tmp_path, *calls) -> list[tuple[dict, list[str]]]:
    """``local_model_folder`` for each ``(repo, revision, token, stage_types[, model_config[, trust_remote_code]])``
    in turn, in one process whose ``huggingface_hub`` talks to ``hub`` (it reads ``HF_ENDPOINT`` at import), into a
    fresh cache (and ``$VLLM_CACHE_ROOT``, for a single file's folder; ``HF_MODULES_CACHE``, for a repo's code): each
    call's
    answer, and the paths the hub served for it (a call starts only when told to, and answers after its last
    download was served)."""
    env = os.environ | {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    command = [sys.executable, "-c", _DOWNLOAD, json.dumps(calls)]
    answers = []
    with subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as process:
        for _ in calls:
            before = len(hub.downloads)
            process.stdin.write("go\n")
            process.stdin.flush()
            line = process.stdout.readline()
            assert line.startswith("{"), f"the download process exited {process.wait()} (its stderr is above)"
            answers.append((json.loads(line), [path for _, _, path in hub.downloads[before:]]))
        process.stdin.close()
        assert process.wait(timeout=300) == 0
    return answers


@pytest.mark.slow  # the downloads run in a fresh interpreter that imports the stack
def test_a_download_fetches_each_needed_file_once_in_one_format(hub, tmp_path):
    """A split deployment's decode stage alone first (no text encoder, no denoiser), then all three stages: the
    rest, and nothing twice; the ``.bin`` copy, the README and the extras are never fetched."""
    repo = "tiny-org/flux-dup"
    (decode, first), (split, second) = _download(
        hub, tmp_path, (repo, None, None, ["decode"]), (repo, None, None, ["encode", "denoise", "decode"])
    )

    assert decode["folder"] == split["folder"]
    assert "vae/diffusion_pytorch_model.safetensors" in first and "model_index.json" in first
    assert not [path for path in first if path.startswith(("transformer", "text_encoder"))]
    assert not set(first) & set(second) and len(first + second) == len(set(first + second))
    cached = {
        os.path.relpath(os.path.join(root, name), split["folder"])
        for root, _, names in os.walk(split["folder"])
        for name in names
    }
    assert set(first + second) == cached
    assert {"transformer/diffusion_pytorch_model.safetensors", "text_encoder_2/model.safetensors"} <= cached
    assert not [path for path in cached if path.endswith(".bin") or path.startswith(("README", "extras/"))]


@pytest.mark.slow
def test_hub_failures_name_the_repo_the_revision_and_the_reason(hub, tmp_path):
    """Each failure names the repo, the revision and the reason, and what fixes it: a token for a gated repo,
    ``--trust-remote-code`` for a repo whose pipeline class is its own code (which then downloads, code included)."""
    (missing, _), (no_revision, _), (gated, _), (granted, _), (untrusted, _), (trusted, _) = _download(
        hub,
        tmp_path,
        ("tiny-org/missing", None, None, ["diffusion"]),
        (REPO, "v9", None, ["diffusion"]),
        ("tiny-org/gated", None, None, ["diffusion"]),
        ("tiny-org/gated", None, "hf_granted", ["diffusion"]),
        ("tiny-org/custom", None, None, ["diffusion"]),
        ("tiny-org/custom", None, None, ["diffusion"], None, True),
    )
    assert missing["error"].startswith("model 'tiny-org/missing' at revision 'main': no such repo on " + hub.url)
    assert (
        no_revision["error"]
        == f"model {REPO!r} at revision 'v9': the repo has no such revision (a branch, tag or commit)"
    )
    assert gated["error"].startswith(
        "model 'tiny-org/gated' at revision 'main': the repo is gated: "
        f"accept its conditions on {hub.url}/tiny-org/gated"
    )
    assert "--hf-token" in gated["error"]
    assert os.path.isfile(os.path.join(granted["folder"], "model_index.json"))
    assert untrusted["error"] == (
        "model 'tiny-org/custom' at revision 'main': its pipeline class CustomFluxPipeline is the repo's own code "
        "(pipeline.py), which runs only when you trust it: read it, then give --trust-remote-code (vllm serve) or "
        "trust_remote_code=True (Omni)"
    )
    for code in ("pipeline.py", "transformer/custom_transformer.py"):
        assert os.path.isfile(os.path.join(trusted["folder"], code)), code


@pytest.mark.network
def test_a_real_hub_repo_downloads_only_its_pipeline_files(tmp_path):
    """diffusers' own tiny test pipeline from huggingface.co, into an empty cache."""
    code = (
        "from vllm_omni.config.model_source import ModelSource\n"
        "from vllm_omni.model_sources.files import local_model_folder\n"
        "print(local_model_folder(ModelSource('hf-internal-testing/tiny-stable-diffusion-pipe'), ['diffusion']))\n"
    )
    env = os.environ | {"HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    folder = out.stdout.strip().splitlines()[-1]
    assert os.path.isfile(os.path.join(folder, "model_index.json"))
    files = [name for _, _, names in os.walk(folder) for name in names]
    assert not (any(f.endswith(".bin") for f in files) and any(f.endswith(".safetensors") for f in files))


@pytest.mark.slow
def test_a_gguf_in_a_repo_is_fetched_alone_by_name_or_by_type_and_a_missing_one_is_named(hub, tmp_path):
    """``org/name:QUANT_TYPE`` fetches that one file (not the others, not the README) and the base's files but its
    denoiser's weights; ``org/name:FILE`` the file it names; the folder links to the file in the hub cache. A type
    the repo holds twice or not at all, and a file it lacks, are errors that name them."""
    calls = [
        (f"tiny-org/flux-gguf:{file}", None, None, ["diffusion"], REPO)
        for file in ("Q4_0", "flux-tiny-Q8_0.gguf", "Q5_0", "Q2_K", "flux-tiny-Q6_K.gguf")
    ]
    (by_type, fetched), (by_name, fetched_by_name), (twice, _), (none, _), (missing, _) = _download(
        hub, tmp_path, *calls
    )
    assert [p for p in fetched if p.endswith(".gguf") or p == "README.md"] == ["flux-tiny-Q4_0.gguf"]
    assert not [p for p in fetched if p.startswith("transformer/") and p != "transformer/config.json"]
    assert [p for p in fetched_by_name if p.endswith(".gguf")] == ["flux-tiny-Q8_0.gguf"]
    for answer, qtype in ((by_type, "Q4_0"), (by_name, "Q8_0")):
        link = os.path.join(answer["folder"], "transformer", f"flux-tiny-{qtype}.gguf")
        assert os.path.realpath(link).startswith(str(tmp_path / "hub" / "models--tiny-org--flux-gguf" / "blobs"))
    assert twice["error"] == (
        "model 'tiny-org/flux-gguf:Q5_0' at revision 'main': the repo has 2 .gguf files of type Q5_0 "
        "(flux-tiny-Q5_0.gguf, flux-tiny-v2-Q5_0.gguf); name the file: org/name:FILE.gguf"
    )
    assert none["error"].startswith("model 'tiny-org/flux-gguf:Q2_K' at revision 'main': the repo has no .gguf file")
    assert "flux-tiny-Q4_0.gguf, flux-tiny-Q5_0.gguf" in none["error"]
    assert missing["error"] == (
        "model 'tiny-org/flux-gguf' at revision 'main': the repo has no flux-tiny-Q6_K.gguf at this revision"
    )
