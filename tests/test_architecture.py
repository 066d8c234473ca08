"""docs/architecture.md's recipes stay true: every file and definition its Recipes table names exists."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
REFERENCE = re.compile(r"`((?:vllm_omni|docs)/[\w/.<>-]+?)(?::(\w+))?`")


def _recipes() -> list[str]:
    text = DOC.read_text()
    table = text.split("## Recipes", 1)[1].split("\n\n| change |", 1)[1].split("\n\n", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("|---")]


def _defined(path: pathlib.Path) -> set[str]:
    """The names a module defines at its top level, and its classes' methods as ``Class.method``."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_recipe_names_files_and_definitions_that_exist():
    rows = _recipes()
    assert len(rows) >= 7, rows
    missing = []
    for row in rows:
        recipe, count = (cell.strip() for cell in row.strip("|").split("|")[:2])
        assert count.isdigit(), f"{recipe}: the number of files is not a number: {count!r}"
        for path, name in REFERENCE.findall(row):
            if "<" in path:  # a pattern, as entrypoints/openai/<api>/
                continue
            file = ROOT / path
            if not file.is_file():
                missing.append(f"{recipe}: {path}")
            elif name and name not in _defined(file):
                missing.append(f"{recipe}: {path} defines no {name}")
    assert not missing, "docs/architecture.md's Recipes name what is not there:\n" + "\n".join(missing)


def test_the_recipes_cover_each_kind_of_change_the_issue_names():
    recipes = " ".join(row.split("|")[1] for row in _recipes())
    for kind in ("stage knob", "request field", "family", "control verb", "HTTP API", "stage type"):
        assert kind in recipes, kind
