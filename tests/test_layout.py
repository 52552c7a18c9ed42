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


def module_level_imports(path: Path) -> set[str]:
    """The hpsweep modules ``path`` imports when it is imported, or type-checked: its top level,
    including ``if TYPE_CHECKING:`` and ``try:`` blocks and class bodies; not function bodies,
    which import when they run."""
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hpsweep"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)  # type: ignore[arg-type]
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)
            for field in ("body", "orelse", "handlers", "finalbody"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(inner)

    visit(ast.parse(path.read_text()).body)
    return found & modules


def test_no_import_circle_even_counting_type_checking_imports() -> None:
    graph = {module_name(p): module_level_imports(p) for p in PACKAGE.rglob("*.py")}
    for start in graph:
        seen, todo = set(), [(start, (start,))]
        while todo:
            module, path = todo.pop()
            for target in graph[module] - {module}:
                assert target != start, " -> ".join((*path, target))
                if target not in seen:
                    seen.add(target)
                    todo.append((target, (*path, target)))


def private_members(path: Path) -> set[str]:
    """The ``_private`` methods and attributes that the classes of ``path`` define."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    names.add(item.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_train_and_devices_reach_into_no_other_modules_private_members() -> None:
    """A training run's pieces talk through what each class offers: no module of ``train/`` or
    ``devices/`` uses a ``_private`` member that only another module's classes define."""
    everywhere = {module_name(p): private_members(p) for p in PACKAGE.rglob("*.py")}
    reaches = []
    for side in ("train", "devices"):
        for path in (PACKAGE / side).rglob("*.py"):
            own = everywhere[module_name(path)]
            others = set().union(*(v for k, v in everywhere.items() if k != module_name(path)))
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in others - own
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                ):
                    reaches.append(f"{module_name(path)}:{node.lineno} {ast.unparse(node)}")
    assert reaches == []
