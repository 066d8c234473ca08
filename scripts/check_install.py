"""Exit 0 when this checkout is installed (editable) with every requirement of pyproject.toml satisfied.

`make install` runs it and calls pip only when it fails, so the README's commands
install what is missing on a fresh machine and cost nothing on a ready one.
"""

import importlib.metadata
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def problems() -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: no TOML reader in the standard library
        return ["cannot read pyproject.toml on this Python"]
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pending, found = [Requirement(line) for line in project["dependencies"] + extras["test"]], []
    while pending:
        requirement = pending.pop(0)
        if requirement.name == project["name"]:  # the test extra pulls in other extras of this project
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
    missing = problems()
    for problem in missing:
        print(f"install needed: {problem}")
    sys.exit(1 if missing else 0)
