"""What the benchmark scripts share: the request shapes, the prompts and the JSON output."""

from __future__ import annotations

import json
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
