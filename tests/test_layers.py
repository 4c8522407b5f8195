"""The package's layers import one way (docs/design.md): config, schedule and fixed_order are leaves; sync knows no
model and no training loop; swarm knows neither sync nor train."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "p2p_diloco"

# module or package -> the p2p_diloco modules and packages it may not import
FORBIDDEN = {
    "config": ("swarm", "sync", "train"),
    "schedule": ("swarm", "sync", "train", "config"),
    "hashing": ("swarm", "sync", "train"),
    "fixed_order": ("swarm", "sync", "train", "config"),
    "swarm": ("sync", "train"),
    "sync": ("train",),
}


def project_imports(path: Path) -> set[str]:
    """The p2p_diloco submodules that `path` imports, e.g. {"sync.codecs", "config"}."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("p2p_diloco."):
            names.add(node.module.removeprefix("p2p_diloco."))
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("p2p_diloco.") for a in node.names if a.name.startswith("p2p_diloco."))
    return names


def modules_of(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).glob("*.py")) if (PACKAGE / layer).is_dir() else [PACKAGE / f"{layer}.py"]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_no_layer_above_it(layer):
    wrong = {
        f"{path.relative_to(PACKAGE)} imports p2p_diloco.{name}"
        for path in modules_of(layer)
        for name in project_imports(path)
        if name.split(".")[0] in FORBIDDEN[layer]
    }
    assert not wrong, sorted(wrong)
