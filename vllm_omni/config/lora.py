"""One LoRA adapter served from start-up: vLLM's ``--lora-modules`` entry."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class LoRAModulePath(BaseModel):
    """One adapter served from start-up (vLLM's ``--lora-modules`` entry)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The name requests select it by (``model`` or ``lora``)."""
    path: str = Field(min_length=1)
    """A diffusers/PEFT LoRA folder or file (``save_lora_weights``), or a kohya-style file."""
    base_model_name: str | None = None
    """The base model it was trained for, listed as its ``parent`` in ``/v1/models`` (default: the served model)."""

    def __repr__(self) -> str:  # as --lora-modules takes it, in the start-up line
        return f"{self.name}={self.path}"

    @classmethod
    def parse(cls, value: Any) -> Any:
        """``name=path``, vLLM's JSON form, or a mapping, as an entry (anything else is left to validation)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    return json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"lora_modules entry {value!r} is not valid JSON ({exc})") from None
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(
                    f"lora_modules entry {value!r} is neither name=path nor "
                    '{"name": ..., "path": ..., "base_model_name": ...}'
                )
            return {"name": name, "path": path}
        return value
