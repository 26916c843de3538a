"""Every third-party module the code and the tests import is declared in pyproject.toml.

A clean machine installs only what pyproject declares (CI does, into a fresh venv), so an
import that works here only because the package happens to be installed must fail here
first. Also: what is installed satisfies the declared ranges.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "protocol",
    "models",
    "edge_client",
    "coordinator",
    "sim",
    "deploy",
    "edgefl_examples",
    "benchmarks",
    "tests",
)
LOCAL = set(PACKAGES)
EXTERNAL_VENV_SCRIPTS = ROOT / "benchmarks" / "external"
"""Not scanned: scripts that the benchmarks run with the python of a separate virtual
environment they build themselves (benchmarks/vs_flower.py runs flower_workload.py in
.bench-venvs/flower/), so their imports (flwr) are that venv's and are, on purpose, no
dependency of the project. Every other file under benchmarks/ is scanned."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    return [Requirement(line) for line in lines]


def _scanned_files() -> list[Path]:
    """The project's Python files, less :data:`EXTERNAL_VENV_SCRIPTS`."""
    return [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if not path.is_relative_to(EXTERNAL_VENV_SCRIPTS)
    ]


def _imported_roots() -> dict[str, str]:
    """Top-level module -> one file importing it, over the project's packages."""
    found: dict[str, str] = {}
    for path in _scanned_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared() -> None:
    declared = {_norm(r.name) for r in _requirements()}
    distributions = md.packages_distributions()
    undeclared = {}
    for module, where in _imported_roots().items():
        if module in LOCAL or module in sys.stdlib_module_names or module == "__future__":
            continue
        owners = {_norm(d) for d in distributions.get(module, [module])}
        if not owners & declared:
            undeclared[module] = where
    assert undeclared == {}, f"imported but not declared in pyproject.toml: {undeclared}"


def test_only_the_external_venv_scripts_are_skipped() -> None:
    scanned = set(_scanned_files())
    benchmarks = set((ROOT / "benchmarks").rglob("*.py"))
    external = set(EXTERNAL_VENV_SCRIPTS.rglob("*.py"))
    assert external, f"{EXTERNAL_VENV_SCRIPTS} holds no scripts: update the constant"
    assert benchmarks - external <= scanned
    assert not external & scanned


def test_installed_versions_are_within_the_declared_ranges() -> None:
    outside = {}
    for requirement in _requirements():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        if _norm(requirement.name) == "edgefl":
            continue  # the project's own extras
        try:
            version = md.version(requirement.name)
        except md.PackageNotFoundError:
            continue  # an extra this environment does not install (e.g. vision)
        if not requirement.specifier.contains(version, prereleases=True):
            outside[requirement.name] = f"{version} not in {requirement.specifier}"
    assert outside == {}
