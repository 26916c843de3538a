"""The package boundaries (docs/architecture.md, "Packages and boundaries"), enforced.

- protocol never imports torch (nor any of our other packages);
- edge_client never imports coordinator or sim;
- coordinator never imports edge_client or sim;
- models imports protocol only among our packages;
- deploy (the provisioning tool) imports protocol only among our packages, and no torch;
- edgefl_examples (the worked examples: what a user writes) imports none of them.

Checked statically over every module's import statements (including imports inside
functions) and dynamically for protocol, by importing all of it in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"protocol", "models", "edge_client", "coordinator", "sim", "deploy", "edgefl_examples"}
FORBIDDEN = {
    "protocol": {"torch", "torchvision", "models", "edge_client", "coordinator", "sim", "deploy"},
    "models": {"edge_client", "coordinator", "sim"},
    "edge_client": {"coordinator", "sim"},
    "coordinator": {"edge_client", "sim"},
    "deploy": {"torch", "torchvision", "models", "edge_client", "coordinator", "sim"},
    "edgefl_examples": {"protocol", "models", "edge_client", "coordinator", "sim", "deploy"},
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_its_import_boundary(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"package {package} has no modules"
    offenders = {
        str(f.relative_to(ROOT)): sorted(imported_roots(f) & FORBIDDEN[package]) for f in files
    }
    assert {f: bad for f, bad in offenders.items() if bad} == {}


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import torch.nn\n    from sim.x import y\n")
    assert imported_roots(module) == {"torch", "sim"}


def test_importing_all_of_protocol_does_not_load_torch() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "protocol").rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'models', 'sim'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def imported_modules(path: Path) -> set[str]:
    """Every module named by an import statement of ``path`` (absolute imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


# edge_client holds three products: the inference device and the bundler never pull in the
# training device or torch (the infer profile has neither).
TORCH_FREE = ("edge_client/serve", "edge_client/bundle")
TORCH_FREE_SHARED = ("config", "errors", "link", "logs")


def _torch_free_files() -> list[Path]:
    files = [p for folder in TORCH_FREE for p in sorted((ROOT / folder).rglob("*.py"))]
    return files + [ROOT / "edge_client" / f"{name}.py" for name in TORCH_FREE_SHARED]


def test_serve_and_bundle_never_import_the_training_device_or_torch() -> None:
    forbidden = ("torch", "models", "edge_client.train", "coordinator", "sim")
    offenders = {
        str(f.relative_to(ROOT)): sorted(
            m
            for m in imported_modules(f)
            if m.split(".")[0] in forbidden or m.startswith(forbidden)
        )
        for f in _torch_free_files()
    }
    assert {f: bad for f, bad in offenders.items() if bad} == {}


def test_importing_the_inference_device_does_not_load_torch() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in _torch_free_files()
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'models') "
        "or m.startswith('edge_client.train'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
