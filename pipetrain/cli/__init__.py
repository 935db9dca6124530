"""The ``pipetrain`` command. The only place that imports everything.

Each subcommand is a module in this package with ``add_parser(subparsers)`` and
``run(args) -> int``. Bad input raises ``pipetrain.errors.InputError`` (``UsageError``, ``ScheduleError``, config and
checkpoint errors all derive from it): it prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from pipetrain.cli.errors import UsageError
from pipetrain.errors import InputError
from pipetrain.launch.guard import watch_launcher
from pipetrain.launch.process_exit import exit_rank, launched_rank

__all__ = ["UsageError", "main"]

# Subcommands, each the module of that name under pipetrain.cli. A module imports torch
# inside its run(), never at import time: `pipetrain simulate` must not pay for torch.
SUBCOMMANDS: tuple[str, ...] = ("simulate", "plan", "train", "tune", "ckpt", "generate", "doctor")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line with the fix and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipetrain", description="Pipeline-parallel training for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"pipetrain.cli.{name}")
        except ModuleNotFoundError as exc:
            # A subcommand whose module is not part of this build is simply not offered.
            if exc.name == f"pipetrain.cli.{name}":
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if launched_rank():
        # A rank of torchrun's (or any elastic agent's) stops when its agent dies.
        watch_launcher()
    code = _main(argv)
    if launched_rank():
        # A rank of a torchrun launch (train, generate) may leave gloo threads behind:
        # it ends without the interpreter's finalization (pipetrain.launch.process_exit).
        exit_rank(code)
    return code


def _attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--split -1,7,6`` as ``--split=-1,7,6``: argparse takes a value that starts with a
    dash (and is not a plain negative number) for an option and says "expected one
    argument", hiding what is wrong with the value. A value after an option that takes one
    is attached when it is not itself one of that subcommand's options (nor ``--...``)."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not argv or not subparsers or argv[0] not in subparsers[0].choices:
        return argv
    command = subparsers[0].choices[argv[0]]
    takes_value = {
        option
        for action in command._actions
        if action.option_strings and action.nargs is None
        if isinstance(action, (argparse._StoreAction, argparse._AppendAction))
        for option in action.option_strings
    }
    known = {option for action in command._actions for option in action.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else None
        if (
            token in takes_value
            and following is not None
            and following.startswith("-")
            and not following.startswith("--")
            and following not in known
            and len(following) > 1
        ):
            out.append(f"{token}={following}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(
        _attach_dash_values(parser, list(sys.argv[1:] if argv is None else argv))
    )
    try:
        code: int = args.run(args)
    except InputError as exc:
        sys.stderr.write(f"pipetrain {args.command}: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("pipetrain: interrupted\n")
        return 130
    except BrokenPipeError:
        # The reader went away (`pipetrain simulate --ascii | head`): not our error. Point
        # stdout at /dev/null so that the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE
    return code


if __name__ == "__main__":
    raise SystemExit(main())
