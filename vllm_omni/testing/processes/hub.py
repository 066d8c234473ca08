"""A local Hugging Face Hub: a real HTTP server on 127.0.0.1 that the real ``huggingface_hub`` client downloads from.

``snapshot_download(repo_id, cache_dir=..., endpoint=hub.url)`` then writes a genuine cache (refs, snapshots, blobs),
so tests can build offline caches the way users get them and watch what gets fetched, without the internet.
"""

import contextlib
import hashlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

if TYPE_CHECKING:
    from fastapi import FastAPI, Request, Response

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def _error(status: int, code: str | None, text: str, **headers: str) -> "Response":
    """An error as the Hub answers it: the text in the body and in ``X-Error-Message``, which ``huggingface_hub``
    reads, and its ``X-Error-Code`` (``RepoNotFound``, ``GatedRepo``...), which it raises by."""
    from fastapi.responses import JSONResponse

    extra = {"X-Error-Code": code} if code else {}
    return JSONResponse({"error": text}, status, {**extra, "X-Error-Message": text, **headers})


def _parse_route(raw: str) -> tuple[str, str, list[str]] | None:
    """``(repo_id, action, rest)`` of a request path: ``/api/models/{repo}`` is the ``revision`` ``main``;
    ``/api/models/{repo}/revision|tree/{rev}/...`` and ``/{repo}/resolve/{rev}/{path}`` name theirs. ``None``: not a
    route served here."""
    segments = [unquote(s) for s in raw.strip("/").split("/")]
    api = segments[:2] == ["api", "models"]
    if api and len(segments) in (3, 4):
        return "/".join(segments[2:]), "revision", ["main"]
    found = _split(segments[2:], "revision", "tree") if api else _split(segments, "resolve")
    if found is None or (not api and len(found[2]) < 2):
        return None
    return found


def _split(segments: list[str], *keywords: str) -> tuple[str, str, list[str]] | None:
    """The route is parsed by hand: repo ids have one or two segments and a revision may hold an encoded "/"."""
    for n in (2, 1):
        if len(segments) > n + 1 and segments[n] in keywords:
            return "/".join(segments[:n]), segments[n], segments[n + 1 :]
    return None


class LocalHub:
    """``with LocalHub() as hub: sha = hub.publish("org/name", folder)``, then point ``huggingface_hub`` at
    ``hub.url``. Serves model repos only: ``/api/models/...`` (info, revision, tree) and ``/{repo}/resolve/...``."""

    def __init__(self):
        self.url = ""
        self.downloads: list[tuple[str, str, str]] = []
        """``(repo_id, commit, path)`` of every file body served (GET on ``resolve``)."""
        self.requests: list[tuple[str, str]] = []
        """``(method, path)`` of every request: an empty tail proves a client stayed offline."""
        self._blobs: dict[str, bytes] = {}  # sha256 -> content, shared by all repos and commits
        self._commits: dict[str, dict[str, dict[str, str]]] = {}  # repo -> sha -> {path: sha256}
        self._refs: dict[str, dict[str, str]] = {}  # repo -> branch or tag -> sha
        self._tokens: dict[str, str] = {}
        self._server = self._thread = None

    def publish(self, repo_id: str, folder: str, *, branch: str = "main", message: str = "") -> str:
        """Snapshot ``folder``'s files (recursively) as a new commit of ``repo_id`` on ``branch``; returns its
        40-hex sha. Earlier commits stay downloadable by sha."""
        files = {}
        for root, _, names in os.walk(folder):
            for name in names:
                full = os.path.join(root, name)
                with open(full, "rb") as f:
                    data = f.read()
                files[os.path.relpath(full, folder).replace(os.sep, "/")] = digest = hashlib.sha256(data).hexdigest()
                self._blobs[digest] = data
        commits, refs = self._commits.setdefault(repo_id, {}), self._refs.setdefault(repo_id, {})
        # The parent and the count make a republished identical folder a new commit, as a real push would be.
        identity = [repo_id, branch, refs.get(branch), len(commits), message, sorted(files.items())]
        sha = hashlib.sha1(json.dumps(identity).encode()).hexdigest()
        commits[sha] = files  # before the ref moves, so that a concurrent request never sees a dangling ref
        refs[branch] = sha
        return sha

    def tag(self, repo_id: str, name: str, commit: str) -> None:
        """Point ``name`` (a tag, or another branch) at ``commit`` (a sha or an existing branch or tag)."""
        self._refs[repo_id][name] = self._resolve(repo_id, commit) or commit

    def gate(self, repo_id: str, token: str) -> None:
        """Make ``repo_id``'s files need ``Authorization: Bearer <token>``, as a gated repo the user was granted.
        Like the Hub, the repo's info and tree stay public; only ``resolve`` answers 401/403 ``GatedRepo``."""
        self._tokens[repo_id] = token

    def _resolve(self, repo_id: str, revision: str) -> str | None:
        refs = self._refs.get(repo_id, {})
        return refs[revision] if revision in refs else revision if revision in self._commits[repo_id] else None

    def _app(self) -> "FastAPI":
        from fastapi import FastAPI, Request, Response

        app = FastAPI()

        # Async handlers run on the server's event loop, one at a time: the request logs need no lock.
        @app.api_route("/{_:path}", methods=["GET", "HEAD"])
        async def route(request: Request) -> Response:
            raw = request.scope.get("raw_path", request.url.path.encode()).decode()
            self.requests.append((request.method, raw))
            return self._answer(request, raw)

        return app

    def _answer(self, request: "Request", raw: str) -> "Response":
        """The answer to a request for ``raw`` (the path as sent): the repo and revision resolved, then its info, its
        tree or one of its files, or the Hub's 404 for whichever of them does not exist."""
        from fastapi.responses import JSONResponse

        found = _parse_route(raw)
        if found is None:
            return _error(404, None, f"Not found: {raw}")
        repo_id, action, rest = found
        if repo_id not in self._commits:
            return _error(404, "RepoNotFound", f"Repository not found: {repo_id}")
        commit = self._resolve(repo_id, rest[0])
        if commit is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {rest[0]}")
        files, path = self._commits[repo_id][commit], "/".join(rest[1:])
        if action == "revision":
            gated = "manual" if repo_id in self._tokens else False
            info = {"id": repo_id, "sha": commit, "private": False, "gated": gated}
            return JSONResponse({**info, "siblings": [{"rfilename": p} for p in sorted(files)]})
        if action == "tree":
            tree = self._tree(files, path, request.query_params.get("recursive") in ("1", "true", "True"))
            if path and not tree:
                return _error(404, "EntryNotFound", f"{path} does not exist on {commit}")
            return JSONResponse(tree)
        return self._file(request, repo_id, commit, files, path)

    def _file(self, request: "Request", repo_id: str, commit: str, files: dict[str, str], path: str) -> "Response":
        """A file of a commit (``resolve``), as the Hub serves it: refused without the token of a gated repo, whole
        or the byte range asked for, and logged in `downloads` when its body is sent."""
        from fastapi import Response

        if path not in files:
            return _error(404, "EntryNotFound", f"{path} does not exist on {commit}", **{"X-Repo-Commit": commit})
        if (token := self._tokens.get(repo_id)) and request.headers.get("authorization") != f"Bearer {token}":
            status = 403 if request.headers.get("authorization") else 401
            return _error(status, "GatedRepo", f"Access to model {repo_id} is restricted.")
        data = self._blobs[files[path]]
        # No X-Xet-* headers and no redirect: the client then downloads with a plain GET on this very URL.
        headers = {"X-Repo-Commit": commit, "ETag": f'"{files[path]}"', "Accept-Ranges": "bytes"}
        status, body = 200, data
        if match := _RANGE.fullmatch(request.headers.get("range", "")):
            start, end = match.groups()
            first = int(start) if start else max(len(data) - int(end or 0), 0)  # no start: the last `end` bytes
            last = min(int(end), len(data) - 1) if start and end else len(data) - 1
            if first >= len(data) or first > last:
                return _error(416, None, "Range not satisfiable", **{"Content-Range": f"bytes */{len(data)}"})
            status, body = 206, data[first : last + 1]
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        if request.method == "GET":
            self.downloads.append((repo_id, commit, path))
        # uvicorn drops the body of a HEAD answer but keeps its Content-Length, which is what the client reads.
        return Response(body, status, headers, media_type="application/octet-stream")

    def _tree(self, files: dict[str, str], path: str, recursive: bool) -> list[dict]:
        prefix = f"{path}/" if path else ""
        entries: dict[str, dict[str, Any]] = {}
        for name, digest in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("/")
            for depth in range(1, len(parts)) if recursive else range(1, min(len(parts), 2)):
                folder = prefix + "/".join(parts[:depth])
                entries[folder] = {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest()}
            if recursive or len(parts) == 1:
                data = self._blobs[digest]
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\nsize {len(data)}\n"
                oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
                lfs = {"oid": digest, "size": len(data), "pointerSize": len(pointer)}
                entries[name] = {"type": "file", "oid": oid, "size": len(data), "lfs": lfs}
        return [{**entry, "path": name} for name, entry in entries.items()]

    def start(self) -> "LocalHub":
        """Serve on a free port of 127.0.0.1 from a background thread; returns once it accepts connections."""
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # bound here and handed over, so no other process can take the port meanwhile
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the local hub at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and wait for the server thread to end."""
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:  # started with the server
                self._thread.join(30)
            self._server = self._thread = None

    def __enter__(self) -> "LocalHub":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


@contextlib.contextmanager
def hub_online() -> Iterator[None]:
    """Lift ``HF_HUB_OFFLINE`` in this process for the block, for a client pointed at a :class:`LocalHub`.

    ``huggingface_hub`` reads the variable once, at import, into ``huggingface_hub.constants`` (the suite's conftest
    sets it to 1). Telemetry stays off meanwhile: with it on, a process's first request also fetches an "agent
    harnesses" registry from ``constants.ENDPOINT``, the real huggingface.co unless ``HF_ENDPOINT`` was set at import.
    """
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_TELEMETRY
    constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_TELEMETRY = False, True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_TELEMETRY = before


def populate_cache(repo_id: str, folder: str, cache_dir: str, *, branch: str = "main") -> str:
    """Fill ``cache_dir`` with ``folder`` as ``repo_id``@``branch``, written by ``huggingface_hub``'s own
    ``snapshot_download`` from a temporary :class:`LocalHub`; returns the commit sha (the snapshot folder's name)."""
    from huggingface_hub import snapshot_download

    with LocalHub() as hub, hub_online():
        commit = hub.publish(repo_id, folder, branch=branch)
        snapshot_download(repo_id, revision=branch, cache_dir=cache_dir, endpoint=hub.url, token=False)
    return commit
