"""The shape of the house, checked: which package may import which, no two modules that
import each other, no module over 450 lines, no function longer than a screen without
saying why, and the synchronous trainer's own modules (``pipetrain/train/`` less its
``pipedream`` package) at most about 3,000 lines (ARCHITECTURE.md's rules, issue 19).

Imports are read from the source (``ast``), those under ``TYPE_CHECKING`` and inside
functions included: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pipetrain"
MAX_LINES = 450
# "About 80 lines": a function longer than this says in its docstring why it stays long.
MAX_FUNCTION_LINES = 80
LONG_BECAUSE = "Long because"
# The synchronous trainer (train/ without train/pipedream/, a concept of its own).
MAX_TRAINER_LINES = 3200

_ABOVE_RUNTIME = (
    "pipetrain.runtime",
    "pipetrain.train",
    "pipetrain.parallel",
    "pipetrain.cli",
    "pipetrain.launch",
    "pipetrain.config",
)
# What each package must not import (the torch-free core also imports no torch).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "pipetrain.schedules": ("torch", "pipetrain.runtime", "pipetrain.sim", "pipetrain.train"),
    "pipetrain.sim": ("torch", "pipetrain.runtime", "pipetrain.train", "pipetrain.parallel"),
    "pipetrain.partition.balance": ("torch", "pipetrain.runtime"),
    "pipetrain.runtime": (
        "pipetrain.train",
        "pipetrain.parallel",
        "pipetrain.cli",
        "pipetrain.launch",
        "pipetrain.config",
        # The runtime uses diagnose's pure analyses (grads, doctor), not its recorders.
        "pipetrain.diagnose.profile",
        "pipetrain.diagnose.trace_merge",
    ),
    # Pure analyses that the runtime itself calls: they import nothing above it.
    "pipetrain.diagnose.grads": _ABOVE_RUNTIME,
    "pipetrain.diagnose.doctor": _ABOVE_RUNTIME,
    "pipetrain.parallel": ("pipetrain.train", "pipetrain.cli", "pipetrain.launch"),
    "pipetrain.launch": ("pipetrain.train", "pipetrain.parallel", "pipetrain.cli"),
    "pipetrain.config": (
        "torch",
        "pipetrain.train",
        "pipetrain.parallel",
        "pipetrain.launch",
        "pipetrain.runtime",
    ),
    "pipetrain.train": ("pipetrain.cli",),
    # Data sets and tokenizers: read by the trainers, generate and tune; they know no trainer.
    "pipetrain.data": (
        "pipetrain.train",
        "pipetrain.runtime",
        "pipetrain.parallel",
        "pipetrain.launch",
        "pipetrain.cli",
    ),
    "pipetrain.checkpoint": ("pipetrain.train", "pipetrain.cli"),
    "pipetrain.models": ("pipetrain.train", "pipetrain.cli", "pipetrain.runtime"),
}
# Modules the rules above leave out, and why.
EXEMPT = {
    # The first write of a run: it lists and checks the checkpoints already there.
    "pipetrain.config.run_folder": ("torch",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it, as absolute dotted names."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # "from pipetrain.train import loop" imports the module pipetrain.train.loop.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_package_imports_what_its_layer_must_not() -> None:
    problems = []
    for name, path in _modules().items():
        for owner, forbidden in FORBIDDEN.items():
            if not _within(name, owner):
                continue
            allowed = EXEMPT.get(name, ())
            for imported in _imports(path, name):
                bad = [f for f in forbidden if _within(imported, f) and f not in allowed]
                if bad:
                    problems.append(f"{name} imports {imported}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_no_two_modules_import_each_other() -> None:
    modules = _modules()
    edges = {
        name: {m for m in _imports(path, name) if m in modules and m != name}
        for name, path in modules.items()
    }
    pairs = sorted(
        f"{a} <-> {b}"
        for a, targets in edges.items()
        for b in targets
        if a < b
        and a in edges.get(b, set())
        # A package's __init__ re-exports its modules; a module importing a sibling
        # through the package is the same edge, not a cycle of two files.
        and not (b.startswith(a + ".") or a.startswith(b + "."))
    )
    assert not pairs, "\n".join(pairs)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_at_most_450_lines(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines: split it by concept"


def test_no_function_is_longer_than_a_screen_without_saying_why() -> None:
    long = []
    for name, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES and LONG_BECAUSE not in (ast.get_docstring(node) or ""):
                long.append(f"{name}.{node.name}: {length} lines")
    assert not long, (
        f"split these, or say in the docstring why they stay long ({LONG_BECAUSE!r}):\n"
        + "\n".join(long)
    )


def test_the_synchronous_trainer_is_one_concept_of_about_3000_lines() -> None:
    trainer = PACKAGE / "train"
    lines = sum(
        len(path.read_text().splitlines())
        for path in trainer.rglob("*.py")
        if "pipedream" not in path.relative_to(trainer).parts
    )
    assert lines <= MAX_TRAINER_LINES, (
        f"pipetrain/train/ (less pipedream/) has {lines} lines: move what is not the trainer "
        "to the package of its concept"
    )
