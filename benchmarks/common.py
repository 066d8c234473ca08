"""What the benchmark scripts share: the request shapes, the prompts, the edit inputs and the JSON output."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout these scripts belong to: the code their servers and workers run unless ``--baseline`` names
another one."""

PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse", "a blue house", "a tree", "a small dog"]


@dataclass(frozen=True)
class Shape:
    """``WxH[xFRAMES]:STEPS[:WEIGHT]``: image (or video) size, video frames, denoising steps and (for mixes) a
    relative weight. ``frames`` is for the Videos API only; unset, the model's default frame count is used."""

    width: int
    height: int
    steps: int
    weight: float = 1.0
    frames: int | None = None

    @classmethod
    def parse(cls, text: str) -> Shape:
        size, steps, *weight = text.split(":")
        width, height, *frames = size.split("x")
        return cls(
            int(width), int(height), int(steps), float(weight[0]) if weight else 1.0, int(frames[0]) if frames else None
        )

    def __str__(self) -> str:
        frames = f"x{self.frames}" if self.frames is not None else ""
        return f"{self.width}x{self.height}{frames}:{self.steps}"


EDIT_STRENGTH = 0.75
"""The default strength of the edit benchmarks (``--task edit``): how far the input image is noised."""


def edit_image(width: int, height: int):
    """The fixed input of the edit benchmarks at a shape's size: an RGB image of uniform noise (the same pixels in
    bench_serving.py, which uploads it as a PNG, and bench_offline.py, which hands it to the pipeline)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.RandomState(0).randint(0, 256, (height, width, 3), dtype=np.uint8))


def edit_mask(width: int, height: int):
    """The inpainting mask of the edit benchmarks, as diffusers takes it (mode ``L``, white: repaint): the centre
    half of each side."""
    from PIL import Image

    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (width // 4, height // 4, width - width // 4, height - height // 4))
    return mask


def openai_mask_png(mask) -> bytes:
    """``mask`` (diffusers: white repaints) as OpenAI's mask takes it: a PNG whose fully transparent pixels mark
    what to edit."""
    import io

    from PIL import Image, ImageOps

    rgba = Image.new("RGBA", mask.size, (0, 0, 0, 255))
    rgba.putalpha(ImageOps.invert(mask.convert("L")))
    buffer = io.BytesIO()
    rgba.save(buffer, "PNG")
    return buffer.getvalue()


def png_bytes(image) -> bytes:
    """``image`` encoded as PNG."""
    import io

    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def add_model_arguments(parser, families: tuple[str, ...]) -> None:
    """``--model`` (a diffusers folder), or ``--family``: a tiny random-weight model built once into ``--model-dir``."""
    parser.add_argument("--model", help="diffusers folder (default: build the tiny --family)")
    parser.add_argument("--family", default=families[0], choices=families, help="tiny model to build when no --model")
    parser.add_argument(
        "--model-dir", default=os.path.join(REPO, ".tiny-models"), help="where the tiny models are built, once"
    )


def emit(result: dict, path: str | None) -> None:
    """Print the result as JSON on stdout, and write it to ``path`` when given."""
    print(json.dumps(result, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def publish(result: dict, markdown: str, out_dir: str | None, name: str) -> None:
    """`emit` the result, print its tables, and write both to ``out_dir/name.{json,md}`` when ``out_dir`` is given."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    emit(result, os.path.join(out_dir, f"{name}.json") if out_dir else None)
    print(markdown)
    if out_dir:
        with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
            f.write(markdown)


def in_tree(command: list[str], tree: str) -> list[str]:
    """``command`` run so that it imports ``vllm_omni`` from the checkout ``tree``: ``PYTHONPATH`` starts with it
    (``vllm serve`` is a console script, whose ``sys.path`` starts with its own folder, so the working directory
    alone would not do), and the working directory is ``tree`` too, since a Ray worker puts its driver's working
    directory first on its ``sys.path``."""
    tree = os.path.abspath(tree)
    pythonpath = os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])])
    return ["env", "-C", tree, f"PYTHONPATH={pythonpath}", *command]


def runs_tree(tree: str) -> bool:
    """Whether this process imports ``vllm_omni`` from the checkout ``tree`` (so does every process forked from it, or
    from the preloaded forkserver it starts: see `Script`)."""
    import vllm_omni  # the package alone: its engines load on first use

    package = os.path.dirname(os.path.realpath(vllm_omni.__file__))
    return package == os.path.join(os.path.realpath(tree), "vllm_omni")


class Script:
    """``python benchmarks/SCRIPT.py ARGS`` importing ``vllm_omni`` from the checkout ``tree``, talking over text pipes
    (``stdin``, ``stdout``: what its ``main`` reads and prints), its stderr in ``log_path``. Where this process
    already runs ``tree`` (`runs_tree`), the script's ``main`` runs in a fork of the preloaded forkserver
    (`vllm_omni.testing.processes.server.preloaded_context`, shared with the preloaded servers and the engine workers),
    which
    has imported the stack once and run no torch op: a fork skips the ~7 s of CPU a new interpreter spends importing
    torch, vLLM and diffusers, and still starts with no OpenMP team, as a new process does. Otherwise (another
    checkout) it is a new interpreter, `in_tree`; so it is with ``fork=False``."""

    def __init__(self, script: str, args: list[str], tree: str, log_path: str, fork: bool = True):
        self.forked = fork and runs_tree(tree)
        if self.forked:
            from vllm_omni.testing.processes.server import preloaded_context

            ours, theirs = socket.socketpair()
            context = preloaded_context()
            self._process = context.Process(
                target=_run_script, args=(script, args, theirs, log_path), name=f"bench-{script}", daemon=True
            )
            self._process.start()
            theirs.close()
            self.pid = self._process.pid
            self._channel = ours
            self.stdin, self.stdout = ours.makefile("w", encoding="utf-8"), ours.makefile("r", encoding="utf-8")
        else:
            command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{script}.py")]
            with open(log_path, "w") as log:
                self._popen = subprocess.Popen(
                    in_tree([*command, *args], tree),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
            self.pid = self._popen.pid
            self.stdin, self.stdout = self._popen.stdin, self._popen.stdout

    def poll(self) -> int | None:
        """Its exit code, or ``None`` while it runs."""
        return self._process.exitcode if self.forked else self._popen.poll()

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def wait(self) -> int:
        """Close its stdin (the end of its input) and wait for it to exit; its exit code."""
        if not self.stdin.closed:
            self.stdin.close()
        if not self.forked:
            return self._popen.wait()
        with contextlib.suppress(OSError):  # the end of its input; the socket stays open for its output
            self._channel.shutdown(socket.SHUT_WR)
        self._process.join()
        self.stdout.close()
        self._channel.close()
        assert self._process.exitcode is not None, "joined"
        return self._process.exitcode


def _run_script(script: str, args: list[str], channel: socket.socket, log_path: str) -> None:
    """`Script`'s fork: stdin and stdout are the channel, stderr (and what writes to the file descriptors 1 and 2
    directly) the log; then the script's ``main``, as ``python SCRIPT.py ARGS`` runs it."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdin, sys.stdout = channel.makefile("r", encoding="utf-8"), channel.makefile("w", encoding="utf-8")
    channel.close()
    try:
        code = importlib.import_module(script).main(args)
    finally:
        sys.stdout.flush()
    if code:
        sys.exit(code)


def check_tree(tree: str) -> str:
    """``tree`` as an absolute path, after checking that it holds a ``vllm_omni`` package."""
    tree = os.path.abspath(tree)
    if not os.path.isfile(os.path.join(tree, "vllm_omni", "__init__.py")):
        raise SystemExit(f"{tree} holds no vllm_omni package")
    return tree


def imported_from(pid: int) -> dict:
    """Where the running process ``pid`` took ``vllm_omni`` from, seen from outside: the folders holding the
    ``vllm_omni`` files on its threads' stacks (``py-spy dump``, when py-spy is installed), and its ``PYTHONPATH``
    and working directory (``/proc``)."""
    seen: dict = {"pid": pid}
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            environ = file.read().split(b"\0")
        seen["pythonpath"] = next((e[11:].decode() for e in environ if e.startswith(b"PYTHONPATH=")), None)
        seen["cwd"] = os.readlink(f"/proc/{pid}/cwd")
    except OSError as exc:
        seen["proc_error"] = str(exc)
    if shutil.which("py-spy") is None:
        seen["stack_roots"] = None
        return seen
    dump = subprocess.run(
        ["py-spy", "dump", "--full-filenames", "--pid", str(pid)], capture_output=True, text=True, timeout=60
    )
    seen["stack_roots"] = sorted(set(re.findall(r"\(([^\s():]+?)/vllm_omni/[^\s():]+\.py:\d+\)", dump.stdout)))
    if dump.returncode:
        seen["py_spy_error"] = dump.stderr.strip()[-300:]
    return seen


def imports_ok(seen: dict, tree: str) -> bool | None:
    """Whether ``imported_from``'s stacks show ``vllm_omni`` from ``tree`` only; ``None`` when they cannot tell
    (no py-spy, or no ``vllm_omni`` frame on any stack at that moment)."""
    roots = seen.get("stack_roots")
    if not roots:
        return None
    return {os.path.realpath(r) for r in roots} == {os.path.realpath(tree)}


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(CPU seconds the processes ``pids`` and their descendants have used, busy CPU seconds of the whole machine):
    the difference of two readings says how much CPU others used meanwhile, i.e. how quiet the machine was. Each
    process counts once, also when it is both in ``pids`` and a descendant of another one there (a script's server
    and workers are its children)."""
    import psutil

    family: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            family |= {p.pid: p for p in [root, *root.children(recursive=True)]}
        except psutil.NoSuchProcess:
            continue
    ours = 0.0
    for process in family.values():
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        ours += times.user + times.system
    machine = psutil.cpu_times()
    return ours, sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
