"""The package's layout, as docs/architecture.md tells it: each side imports only the sides below
it, so a training run never depends on the search that runs it."""

from __future__ import annotations

import ast
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "hpsweep"

#: The sides, from the ground up; a module may import its own side and the sides below it.
LAYERS = {
    "errors": 0,
    "trial": 0,
    "redaction": 0,
    "faults": 0,
    "runs": 1,
    "devices": 2,
    "train": 3,
    "search": 4,
    "integrations": 5,
    "api": 6,
    "cli": 6,
}
#: The one import that runs upwards: transformers' Trainer.hyperparameter_search hands the
#: trainer to the search, lazily, inside that method.
ALLOWED_UPWARDS = {("hpsweep.train.trainer", "hpsweep.search.sweep")}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 6) if len(parts) > 1 else 6  # the package's face is on top


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """Every hpsweep module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hpsweep"):
            if node.module == "hpsweep":
                found |= {f"hpsweep.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hpsweep")}
    return found


def test_every_import_runs_downwards_but_the_one_documented() -> None:
    upwards = {
        (module_name(path), target)
        for path in PACKAGE.rglob("*.py")
        for target in imports(path)
        if layer(target) > layer(module_name(path))
    }
    assert upwards == ALLOWED_UPWARDS


def test_every_module_belongs_to_a_side() -> None:
    top = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    top -= {"__init__", "__pycache__"}
    assert top <= set(LAYERS), (
        f"{sorted(top - set(LAYERS))} belong to no side: see docs/architecture.md"
    )
