"""The local Hub: the real ``huggingface_hub`` client downloads from it into a genuine cache, resolves branches, tags
and shas, fetches only what it asked for, and raises its own errors for missing repos, revisions, files and gates."""

import hashlib
import os
import subprocess
import sys

import httpx
import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from vllm_omni.testing.processes.hub import LocalHub, hub_online, populate_cache

REPO = "org/name"
FILES = {"config.json": b'{"a": 1}\n', "model_index.json": b"{}\n", "unet/weights.bin": bytes(range(256)) * 40}


def _write(folder, files: dict[str, bytes]) -> str:
    for name, data in files.items():
        os.makedirs(os.path.dirname(folder / name), exist_ok=True)
        (folder / name).write_bytes(data)
    return str(folder)


@pytest.fixture
def folder(tmp_path) -> str:
    return _write(tmp_path / "src", FILES)


@pytest.fixture
def hub(monkeypatch):
    """A started hub, with the suite's ``HF_HUB_OFFLINE=1`` lifted for this process (read once, at import)."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)  # never send a developer's own token
    with LocalHub() as started, hub_online():
        yield started


def _python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter, so that ``huggingface_hub`` reads ``env`` at import as a user's would."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "HF_TOKEN": "", "HF_HUB_DISABLE_TELEMETRY": "1", **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_snapshot_download_writes_a_genuine_cache_that_serves_offline(hub, folder, tmp_path):
    commit = hub.publish(REPO, folder)
    cache = tmp_path / "cache"
    snapshot = snapshot_download(REPO, cache_dir=cache, endpoint=hub.url)

    storage = cache / "models--org--name"
    assert snapshot == str(storage / "snapshots" / commit)
    assert (storage / "refs" / "main").read_text() == commit
    for name, data in FILES.items():
        path = storage / "snapshots" / commit / name
        assert path.read_bytes() == data
        assert path.is_symlink() and os.path.realpath(path) == str(storage / "blobs" / hashlib.sha256(data).hexdigest())
    assert sorted(path for _, _, path in hub.downloads) == sorted(FILES)

    seen = len(hub.requests)
    code = (
        f"from huggingface_hub import snapshot_download; print(snapshot_download({REPO!r}, cache_dir={str(cache)!r}))"
    )
    assert _python(code, HF_HUB_OFFLINE="1", HF_ENDPOINT=hub.url) == snapshot
    assert hub.requests[seen:] == [], "the offline client contacted the hub"


def test_the_environment_alone_points_a_fresh_client_at_the_hub(hub, folder, tmp_path):
    commit = hub.publish(REPO, folder)
    code = f"from huggingface_hub import snapshot_download; print(snapshot_download({REPO!r}))"
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache")}
    assert _python(code, **env) == str(tmp_path / "cache" / "models--org--name" / "snapshots" / commit)
    assert len(hub.downloads) == len(FILES)


def test_branches_tags_and_shas_resolve_and_old_commits_stay_downloadable(hub, folder, tmp_path):
    first = hub.publish(REPO, folder)
    hub.tag(REPO, "v1.0", first)
    second = hub.publish(REPO, _write(tmp_path / "v2", {**FILES, "config.json": b'{"a": 2}\n'}), message="a = 2")
    dev = hub.publish(REPO, _write(tmp_path / "dev", {"config.json": b'{"a": 3}\n'}), branch="dev")
    assert len({first, second, dev}) == 3 and all(len(sha) == 40 for sha in (first, second, dev))
    assert hub.publish(REPO, folder) != first, "publishing the same folder again makes a new commit"
    hub.tag(REPO, "main", second)  # a branch can be moved back too

    api = HfApi(endpoint=hub.url)
    cache = tmp_path / "cache"
    for revision, commit, config in [
        ("main", second, b'{"a": 2}\n'),
        ("v1.0", first, b'{"a": 1}\n'),
        (first, first, b'{"a": 1}\n'),
        ("dev", dev, b'{"a": 3}\n'),
    ]:
        info = api.model_info(REPO, revision=revision)
        assert info.sha == commit
        assert {s.rfilename for s in info.siblings} == (set(FILES) if revision != "dev" else {"config.json"})
        path = hf_hub_download(REPO, "config.json", revision=revision, cache_dir=cache, endpoint=hub.url)
        assert path == str(cache / "models--org--name" / "snapshots" / commit / "config.json")
        with open(path, "rb") as file:
            assert file.read() == config
    refs = cache / "models--org--name" / "refs"
    assert sorted(os.listdir(refs)) == ["dev", "main", "v1.0"], "a sha is no ref"
    assert snapshot_download(REPO, revision=first, cache_dir=cache, endpoint=hub.url).endswith(first)


def test_allow_patterns_fetch_only_the_matching_files(hub, folder, tmp_path):
    commit = hub.publish(REPO, folder)
    snapshot = snapshot_download(REPO, cache_dir=tmp_path / "cache", endpoint=hub.url, allow_patterns=["*.json"])
    assert sorted(hub.downloads) == [(REPO, commit, "config.json"), (REPO, commit, "model_index.json")]
    assert sorted(os.listdir(snapshot)) == ["config.json", "model_index.json"]


def test_missing_repos_revisions_and_files_raise_the_clients_own_errors(hub, folder, tmp_path):
    hub.publish(REPO, folder)
    cache, api = tmp_path / "cache", HfApi(endpoint=hub.url)
    with pytest.raises(RepositoryNotFoundError) as missing:
        snapshot_download("org/missing", cache_dir=cache, endpoint=hub.url)
    assert not isinstance(missing.value, GatedRepoError)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="nope", cache_dir=cache, endpoint=hub.url)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="nope", cache_dir=cache, endpoint=hub.url)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.txt", cache_dir=cache, endpoint=hub.url)
    assert hub.downloads == []


def test_a_gated_repo_needs_its_token(hub, folder, tmp_path):
    commit = hub.publish(REPO, folder)
    hub.gate(REPO, "hf_secret")
    cache = tmp_path / "cache"
    assert HfApi(endpoint=hub.url).model_info(REPO).gated == "manual", "the info of a gated repo is public"
    for token in (False, "hf_wrong"):
        with pytest.raises(GatedRepoError) as gated:
            hf_hub_download(REPO, "config.json", cache_dir=cache, endpoint=hub.url, token=token)
        assert gated.value.response.status_code == (401 if token is False else 403)
        with pytest.raises(GatedRepoError):
            snapshot_download(REPO, cache_dir=cache, endpoint=hub.url, token=token)
    assert hub.downloads == []

    snapshot = snapshot_download(REPO, cache_dir=cache, endpoint=hub.url, token="hf_secret")
    assert snapshot.endswith(commit) and len(hub.downloads) == len(FILES)


def test_file_answers_carry_the_metadata_and_honour_ranges(hub, folder):
    commit = hub.publish(REPO, folder)
    url, data = f"{hub.url}/{REPO}/resolve/main/unet/weights.bin", FILES["unet/weights.bin"]
    head = httpx.head(url)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["x-repo-commit"] == commit
    assert head.headers["etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert int(head.headers["content-length"]) == len(data)
    assert not [name for name in head.headers if name.startswith("x-xet")], "the client must not try Xet"
    assert hub.downloads == [], "a HEAD serves no body"

    part = httpx.get(url, headers={"Range": "bytes=100-"})
    assert part.status_code == 206 and part.content == data[100:]
    assert part.headers["content-range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
    assert httpx.get(url, headers={"Range": "bytes=-10"}).content == data[-10:]
    assert httpx.get(url, headers={"Range": f"bytes={len(data)}-"}).status_code == 416


def test_populate_cache_leaves_a_cache_that_loads_offline(folder, tmp_path):
    switches = constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_TELEMETRY
    commit = populate_cache(REPO, folder, str(tmp_path / "cache"))
    assert switches == (constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_TELEMETRY), "the switches were not restored"
    path = hf_hub_download(REPO, "unet/weights.bin", cache_dir=tmp_path / "cache", local_files_only=True)
    assert path == str(tmp_path / "cache" / "models--org--name" / "snapshots" / commit / "unet" / "weights.bin")
    with open(path, "rb") as file:
        assert file.read() == FILES["unet/weights.bin"]
