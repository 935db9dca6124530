"""The README as a new user reads it: every command it shows is one the CLI accepts, the
output it prints is what the simulator prints, and the Python example imports what exists.

Nothing here trains: commands are parsed, not run (the training ones are exercised by the
other e2e tests), and only the simulator, which takes milliseconds, is run.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from pipetrain.cli import build_parser, main

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(language: str) -> list[str]:
    """The fenced blocks of one language ("" for a plain fence), in order."""
    blocks: list[str] = []
    inside: str | None = None
    lines: list[str] = []
    for line in README.read_text(encoding="utf-8").splitlines():
        if inside is None and line.startswith("```"):
            inside, lines = line[3:].strip(), []
        elif inside is not None and line == "```":
            if inside == language:
                blocks.append("\n".join(lines) + "\n")
            inside = None
        elif inside is not None:
            lines.append(line)
    return blocks


def _commands() -> list[list[str]]:
    """pipetrain's arguments of every command line in the README's bash blocks."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            # `[--format hf]` marks an optional part: the command is shown with it.
            words = shlex.split(line.replace("[", "").replace("]", ""), comments=True)
            if words[:1] == ["pipetrain"]:
                commands.append(words[1:])
            elif "pipetrain.cli" in words:
                commands.append(words[words.index("pipetrain.cli") + 1 :])
    return commands


def test_every_command_the_readme_shows_parses() -> None:
    commands = _commands()
    shown = {argv[0] for argv in commands}
    assert shown >= {"simulate", "plan", "train", "tune", "ckpt", "generate"}
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"README command 'pipetrain {shlex.join(argv)}' is refused ({exc})")


def _run(capsys: pytest.CaptureFixture[str], command: str) -> list[str]:
    code = main(shlex.split(command))
    out, err = capsys.readouterr()
    assert code == 0, err
    return [line.rstrip() for line in out.splitlines()]


def test_the_simulators_table_is_the_one_printed(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text(encoding="utf-8")
    command = re.search(r"^`pipetrain (simulate --compare [^`]*)`", text, flags=re.M)
    assert command is not None, "the README no longer introduces the table with its command"
    table = next(block for block in _blocks("") if block.startswith("schedule "))
    assert table.splitlines() == _run(capsys, command.group(1))[: len(table.splitlines())]


def test_the_commented_output_lines_are_printed(capsys: pytest.CaptureFixture[str]) -> None:
    """A bash block whose simulate command is followed by `#  ...` lines shows its output."""
    checked = 0
    for block in _blocks("bash"):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            shown = []
            for rest in lines[i + 1 :]:
                if not rest.startswith("#  "):
                    break
                shown.append(rest[1:])
            if line.startswith("pipetrain simulate") and shown:
                printed = [p.strip() for p in _run(capsys, line.split(" ", 1)[1])]
                for expected in shown:
                    assert expected.strip() in printed, f"{line!r} no longer prints {expected!r}"
                checked += 1
    assert checked


def test_the_python_example_imports_what_exists() -> None:
    examples = [block for block in _blocks("python") if "build_pipeline" in block]
    assert len(examples) == 2  # the API's, and the user-model example
    for example in examples:
        tree = ast.parse(example)
        imported = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert imported
        for node in imported:
            assert node.module is not None
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"


def test_the_user_model_example_runs_and_prints_what_it_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Written from scratch: side inputs, a kept buffer, a mean loss, top-level names and
    a state dict round trip, in the debug mode (a few seconds)."""
    (example,) = [block for block in _blocks("python") if "LayerSpec(" in block]
    exec(compile(example, "README user-model example", "exec"), {"__name__": "readme"})
    printed = [line for line in example.splitlines() if line.startswith("# [")]
    assert capsys.readouterr().out.splitlines()[-1] == printed[-1].removeprefix("# ")
