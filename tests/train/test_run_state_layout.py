"""How `train/` and `devices/` hang together, read from their source: no module imports itself
back through others (``TYPE_CHECKING`` imports and imports inside functions count), and no module
reads or sets another module's class's private members, so that a class's state changes in the
module that owns it."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "hpsweep"
CHECKED = ("train", "devices")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


@functools.cache
def trees() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def imported(module: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The hpsweep modules ``module`` imports anywhere in its source: at the top, under
    ``TYPE_CHECKING`` or inside a function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = module.split(".")[: -node.level]
                base = ".".join([*package, base] if base else package)
            # a submodule named in the import is what it imports, not its package
            found |= {
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            }
    return {name for name in found if name in known and name != module}


def reachable(graph: dict[str, set[str]], starts: set[str]) -> set[str]:
    """Every module that ``starts`` import, directly or through others."""
    seen, todo = set(), list(starts)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def in_checked(module: str) -> bool:
    return module.split(".")[1:2] in ([side] for side in CHECKED)


def circles(parsed: dict[str, ast.Module]) -> list[str]:
    """The modules of train/ and devices/ that import themselves back, through any module."""
    graph = {module: imported(module, tree, set(parsed)) for module, tree in parsed.items()}
    return [m for m in graph if in_checked(m) and m in reachable(graph, graph[m])]


def test_train_and_devices_import_nothing_that_imports_them_back() -> None:
    assert circles(trees()) == []


def private_members(tree: ast.Module) -> set[str]:
    """The ``_names`` a module's classes own: their methods and class attributes, and the
    attributes their methods read or set on ``self`` (``"_name"`` strings in them included, as
    ``getattr(self, "_name")`` spells one)."""
    owned = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for statement in cls.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owned.add(statement.name)
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = getattr(statement, "targets", [getattr(statement, "target", None)])
                owned |= {t.id for t in targets if isinstance(t, ast.Name)}
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and _on_self(node):
                owned.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                owned.add(node.value)
    return {name for name in owned if _is_private(name)}


def reached_into(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Each ``x._name`` (``x`` not ``self`` or ``cls``) and each ``"_name"`` string (as
    ``getattr`` and lists of attribute names spell one) in a module, with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _on_self(node):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _is_private(node.value):
                yield node.lineno, node.value


def reach_ins(parsed: dict[str, ast.Module]) -> list[str]:
    """Where train/ and devices/ use a private member that a class of another module owns."""
    owners: dict[str, set[str]] = {}
    for module, tree in parsed.items():
        for name in private_members(tree):
            owners.setdefault(name, set()).add(module)
    return [
        f"{module}:{line} {name} (owned by {', '.join(sorted(owners[name]))})"
        for module, tree in parsed.items()
        if in_checked(module)
        for line, name in reached_into(tree)
        if owners.get(name, set()) - {module}
    ]


def test_train_and_devices_use_no_other_modules_private_members() -> None:
    assert reach_ins(trees()) == []


def test_the_checks_find_a_hidden_circle_and_a_reach_in() -> None:
    """What the two checks above exist to catch: a loop that imports its trainer for a type and
    sets the trainer's private state, or names it in a string."""
    parsed = {
        "hpsweep.train.trainer": ast.parse(
            "from hpsweep.train.loop import Loop\n"
            "class Trainer:\n"
            "    def step(self):\n"
            "        self._total = 0\n"
        ),
        "hpsweep.train.loop": ast.parse(
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from hpsweep.train.trainer import Trainer\n"
            "def run(trainer):\n"
            "    trainer._total += 1\n"
            "    return getattr(trainer, '_total')\n"
        ),
    }
    assert circles(parsed) == ["hpsweep.train.trainer", "hpsweep.train.loop"]
    assert reach_ins(parsed) == [
        "hpsweep.train.loop:5 _total (owned by hpsweep.train.trainer)",
        "hpsweep.train.loop:6 _total (owned by hpsweep.train.trainer)",
    ]


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _is_private(name: str) -> bool:
    """``_name``: not a dunder, and not ``_`` alone (a name for what is thrown away)."""
    return (
        name.isidentifier() and name.startswith("_") and not name.startswith("__") and name != "_"
    )
