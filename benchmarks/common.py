"""What the benchmark scripts share: the request shapes, the prompts and the JSON output."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

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
