"""Exit 0 when this checkout is installed (editable) with its dependencies, and those of each ``--extra``, satisfied
(and scripts/constraints.txt).

    python scripts/check_install.py [--extra test]

`make install` (serving: no extra) and `make install-test` (``--extra test``) run it and call pip only when it
fails, so the README's commands install what is missing on a fresh machine and cost nothing on a ready one.
"""

import argparse
import importlib.metadata
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def problems(extras_wanted: list[str]) -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: no TOML reader in the standard library
        return ["cannot read pyproject.toml on this Python"]
    try:
        from packaging.requirements import Requirement
    except ModuleNotFoundError:  # a new venv: nothing installed yet
        return ["packaging is not installed"]

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + [line for extra in extras_wanted for line in extras[extra]]
    constraints = [
        line.strip()
        for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    pending, found = [Requirement(line) for line in wanted + constraints], []
    while pending:
        requirement = pending.pop(0)
        if requirement.name == project["name"]:  # an extra that pulls in other extras of this project
            pending += [Requirement(line) for extra in requirement.extras for line in extras[extra]]
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{requirement.name} is not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            found.append(f"{requirement.name} {version} does not satisfy {requirement}")
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or pathlib.Path(spec.origin).resolve().parent.parent != ROOT:
        found.append(f"vllm_omni is not installed from {ROOT}")
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", action="append", default=[], help="also check this optional dependency group")
    missing = problems(parser.parse_args().extra)
    for problem in missing:
        print(f"install needed: {problem}")
    sys.exit(1 if missing else 0)
