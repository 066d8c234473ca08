"""What the benchmark scripts share: the request shapes, the prompts, the edit inputs and the JSON output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
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
