"""What the benchmark scripts share: the request shapes, the prompts and the JSON output."""

from __future__ import annotations

import json
from dataclasses import dataclass

PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse", "a blue house", "a tree", "a small dog"]


@dataclass(frozen=True)
class Shape:
    """``WxH:STEPS[:WEIGHT]``: image size, denoising steps and (for mixes) a relative weight."""

    width: int
    height: int
    steps: int
    weight: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Shape:
        size, steps, *weight = text.split(":")
        width, height = size.split("x")
        return cls(int(width), int(height), int(steps), float(weight[0]) if weight else 1.0)

    def __str__(self) -> str:
        return f"{self.width}x{self.height}:{self.steps}"


def emit(result: dict, path: str | None) -> None:
    """Print the result as JSON on stdout, and write it to ``path`` when given."""
    print(json.dumps(result, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
