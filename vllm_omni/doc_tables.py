"""Markdown tables generated from pydantic field declarations and kept between two marker comments of a doc, so that
they cannot fall behind the declarations: docs/configuration.md's stage keys (`vllm_omni.config.docs`) and
docs/serving.md's request fields (`vllm_omni.entrypoints.openai.docs`). Each of those modules lays out its rows; the
cells they share (a field's type with its bounds, its default, its docstring) and the rewrite or ``--check`` of the
doc are here."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import annotated_types
from pydantic.fields import FieldInfo

_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.MinLen, "min_length", "length >="),
    (annotated_types.MaxLen, "max_length", "length <="),
)
"""The metadata of ``Field(ge=..., max_length=...)`` and how a table writes each bound."""


def field_type(info: FieldInfo, written_as: Mapping[Any, str], value: Callable[[Any], str]) -> str:
    """The Type cell: the field's type (``written_as`` names a type for the doc's reader, else its Python name; a
    literal lists its values as ``value`` writes them), its bounds, and whether it may be unset."""
    kinds, optional = [info.annotation], False
    if typing.get_origin(info.annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(info.annotation)
        kinds = [t for t in args if t is not type(None)]
        optional = len(kinds) < len(args)
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is typing.Literal:
        text = " \\| ".join(f"`{value(v)}`" for v in typing.get_args(kinds[0]))
        return text + (" \\| unset" if optional else "")
    text = " or ".join(_type_name(kind, written_as) for kind in kinds)
    bounds = [f"{sign} {getattr(m, attr)}" for m in info.metadata for t, attr, sign in _BOUNDS if type(m) is t]
    text = ", ".join([text, *bounds])
    return text + (", or unset" if optional and bounds else " or unset" if optional else "")


def _type_name(kind: Any, written_as: Mapping[Any, str]) -> str:
    if typing.get_origin(kind) is Annotated:  # a union's member with metadata of its own, as StrictInt | None
        kind = typing.get_args(kind)[0]
    if kind in written_as:
        return written_as[kind]
    if typing.get_origin(kind) in (tuple, list):
        return "list of " + _type_name(typing.get_args(kind)[0], written_as)
    return getattr(kind, "__name__", str(kind))


def default(info: FieldInfo, value: Callable[[Any], str]) -> str:
    """The Default cell: ``required``, ``unset`` (``None``), or the default as ``value`` writes it."""
    if info.is_required():
        return "required"
    return "unset" if info.default is None else f"`{value(info.default)}`"


def meaning(info: FieldInfo) -> str:
    """The field's docstring (pydantic's ``use_attribute_docstrings`` makes it the description) as one table cell."""
    return " ".join((info.description or "").split()).replace("|", "\\|")


def replace_between(text: str, begin: str, end: str, table: str) -> str:
    """``text`` with what lies between the lines ``begin`` and ``end`` replaced by ``table``."""
    head, found_begin, rest = text.partition(begin + "\n")
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the markers {begin!r} and {end!r} are missing")
    return head + found_begin + table + found_end + tail


def regenerate(doc: Path, render: Callable[[str], str], command: str, argv: list[str] | None, about: str) -> int:
    """The command line of a doc's generator (``command``): rewrite ``doc`` with its tables made anew by ``render``,
    or with ``--check`` exit 1 when they are stale."""
    parser = argparse.ArgumentParser(prog=command, description=about)
    parser.add_argument("--check", action="store_true", help="exit 1 if the tables in the docs are not current")
    args = parser.parse_args(argv)
    text = doc.read_text()
    fresh = render(text)
    if args.check:
        if fresh != text:
            print(f"{doc} is stale: run {command}", file=sys.stderr)
            return 1
        return 0
    doc.write_text(fresh)
    return 0
