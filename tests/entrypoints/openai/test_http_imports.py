"""The HTTP layer talks to `AsyncOmni` and the public types only (docs/architecture.md): no module under
``vllm_omni/entrypoints/openai/`` imports the engines' internals, not even for type checking. What it needs of them
is a public type (sampling_params.py, outputs.py, errors.py) or a method of the facade."""

import ast
import pathlib

import vllm_omni

PACKAGE = pathlib.Path(vllm_omni.__file__).parent
HTTP_LAYER = PACKAGE / "entrypoints" / "openai"
INTERNALS = (
    "vllm_omni.diffusion",
    "vllm_omni.codec",
    "vllm_omni.orchestrator",
    "vllm_omni.model_sources",
    "vllm_omni.testing",
)


def _internal(module: str) -> bool:
    return any(module == internal or module.startswith(internal + ".") for internal in INTERNALS)


def _internal_imports(tree: ast.AST) -> list[str]:
    """Each import of an internal module in ``tree``, anywhere in it (a function, ``if TYPE_CHECKING:``), as written:
    ``line N: from M import A, B`` or ``line N: import M``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {alias.name}" for alias in node.names if _internal(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names = [alias.name for alias in node.names]
            if _internal(node.module):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
            elif node.module == "vllm_omni":  # `from vllm_omni import diffusion`
                found += [
                    f"line {node.lineno}: from vllm_omni import {name}"
                    for name in names
                    if _internal(f"vllm_omni.{name}")
                ]
    return sorted(found, key=lambda text: int(text.split(":")[0].removeprefix("line ")))


def test_the_http_layer_imports_no_internals():
    offenders = []
    for path in sorted(HTTP_LAYER.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        offenders += [f"{module}: {found}" for found in _internal_imports(ast.parse(path.read_text(), str(path)))]
    assert not offenders, (
        "the HTTP layer imports only AsyncOmni, the public types and vllm_omni.config; move what it needs there:\n"
        + "\n".join(offenders)
    )


def test_the_check_finds_every_form_of_import():
    source = (
        "import vllm_omni.diffusion.engine\n"
        "from vllm_omni import testing, errors\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from vllm_omni.orchestrator.omni_engine import OmniEngine\n"
        "def f():\n"
        "    from vllm_omni.model_sources.files import local_model_folder\n"
        "from vllm_omni.outputs import OmniRequestOutput\n"
        "from vllm_omni.diffusionists import nothing\n"
    )
    assert _internal_imports(ast.parse(source)) == [
        "line 1: import vllm_omni.diffusion.engine",
        "line 2: from vllm_omni import testing",
        "line 5: from vllm_omni.orchestrator.omni_engine import OmniEngine",
        "line 7: from vllm_omni.model_sources.files import local_model_folder",
    ]
