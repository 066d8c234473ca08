"""The one-owner rules of docs/configuration.md, checked on the source tree."""

import ast
import inspect
import pathlib

import pytest

import vllm_omni
from vllm_omni.diffusion.request_engine import RequestEngine
from vllm_omni.diffusion.step_engine import StepEngine
from vllm_omni.engine.omni_engine import AsyncOmniEngine, OmniEngine
from vllm_omni.engine.stage_runtime import StageRuntime

PACKAGE = pathlib.Path(vllm_omni.__file__).parent
RESOLVER = PACKAGE / "config" / "resolver.py"
SHIM = PACKAGE / "config" / "legacy.py"


def _writes_of_max_num_seqs(tree: ast.AST) -> list[int]:
    """Lines that store into ``x.max_num_seqs`` / ``x["max_num_seqs"]`` or setattr it."""
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr == "max_num_seqs":
                    lines.append(node.lineno)
                if isinstance(sub, ast.Subscript) and getattr(sub.slice, "value", None) == "max_num_seqs":
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and (
            getattr(node.func, "id", None) == "setattr" or getattr(node.func, "attr", None) == "__setattr__"
        ):
            if any(isinstance(a, ast.Constant) and a.value == "max_num_seqs" for a in node.args):
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("model_copy", "update"):
            for keyword in node.keywords:
                if isinstance(keyword.value, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "max_num_seqs" for k in keyword.value.keys
                ):
                    lines.append(node.lineno)
    return sorted(lines)


def test_only_the_resolver_writes_max_num_seqs():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if path == RESOLVER:
            continue
        lines = _writes_of_max_num_seqs(ast.parse(path.read_text(), filename=str(path)))
        if lines:
            offenders[str(path.relative_to(PACKAGE))] = lines
    assert offenders == {}


def test_the_write_detector_catches_writes():
    source = (
        "a.max_num_seqs = 1\nb['max_num_seqs'] = 2\nsetattr(c, 'max_num_seqs', 3)\nd.x.max_num_seqs += 1\n"
        "object.__setattr__(e, 'max_num_seqs', 5)\nf = g.model_copy(update={'max_num_seqs': 6})\n"
        "n = cfg.max_num_seqs\n"
    )
    assert _writes_of_max_num_seqs(ast.parse(source)) == [1, 2, 3, 4, 5, 6]


def test_the_alias_name_appears_only_in_the_shim():
    name = "diffusion_" + "batch_size"
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*")
        if path.is_file()
        and path != SHIM
        and path.suffix in (".py", ".yaml", ".yml", ".json", ".txt", ".md")
        and name in path.read_text()
    ]
    assert offenders == []


@pytest.mark.parametrize("cls", [AsyncOmniEngine, OmniEngine, StageRuntime, RequestEngine, StepEngine])
def test_engine_signatures_have_no_batch_size_alias(cls):
    params = inspect.signature(cls.__init__).parameters
    assert not {"diffusion_" + "batch_size", "batch_size"} & set(params)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@pytest.mark.parametrize("cls", [AsyncOmniEngine, StageRuntime])
@pytest.mark.parametrize("name", ["diffusion_" + "batch_size", "batch_size"])
def test_passing_the_alias_to_the_engine_is_a_type_error(cls, name):
    with pytest.raises(TypeError, match=name):
        cls("model", [], **{name: 4})
