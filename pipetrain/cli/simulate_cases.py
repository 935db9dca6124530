"""What ``pipetrain simulate`` simulates: its flags checked, and the schedule cases they
name (a built-in schedule, a schedule file, or every built-in one for ``--compare``).

Imports no torch, as ``pipetrain.cli.simulate`` which runs them.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from pipetrain.cli.errors import UsageError
from pipetrain.schedules.schedule import Schedule

__all__ = [
    "MOST_STAGE_MICROBATCHES",
    "SimCase",
    "builtin_case",
    "check_counts",
    "check_outputs",
    "check_size",
    "check_sizes",
    "file_case",
    "need",
    "save_schedule",
    "single_case",
]


@dataclass(frozen=True)
class SimCase:
    """One schedule to simulate and how to weigh it against the others."""

    schedule: Schedule
    batch_scale: int


def need(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} is required with --schedule and --compare, e.g. {flag} 4")


# The replay handles a few thousand stage micro-batches a second and about 1.5 kB each:
# a million is minutes and over a GB; a typo such as --microbatches 100000 on 100000
# ranks would run out of memory after hours instead of failing.
MOST_STAGE_MICROBATCHES = 1_000_000


def check_counts(args: argparse.Namespace) -> None:
    for name in ("pp", "microbatches", "chunks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} {value}: give a whole number >= 1")


def check_size(args: argparse.Namespace, chunks: int) -> None:
    """Refuse, before any generator runs, what the replay could not finish."""
    total = args.pp * args.microbatches * chunks
    if total > MOST_STAGE_MICROBATCHES:
        per_rank = f" x {chunks} stages per rank" if chunks > 1 else ""
        raise UsageError(
            f"--pp {args.pp} x --microbatches {args.microbatches}{per_rank} is {total:,} "
            f"stage micro-batches to replay, over the {MOST_STAGE_MICROBATCHES:,} the "
            "simulator takes: lower --pp or --microbatches"
        )


def check_sizes(args: argparse.Namespace) -> None:
    # A negative, infinite or NaN size would flow into every byte column of the report.
    for name in ("activation_bytes", "weight_bytes"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value:g}: give a finite number of bytes >= 0")


def check_outputs(args: argparse.Namespace) -> None:
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg"):
        raise UsageError(f"--plot {args.plot}: use a .png or .svg file name")
    if args.save and Path(args.save).suffix.lower() not in (".csv", ".json"):
        raise UsageError(f"--save {args.save}: use a .csv or .json file name")
    if args.save and args.compare:
        raise UsageError("--save writes one schedule: pick it with --schedule instead of --compare")
    if args.trace and Path(args.trace).suffix.lower() != ".json":
        # Any other name could be a schedule file (.csv) or a picture the trace replaces.
        raise UsageError(f"--trace {args.trace}: use a .json file name")
    # Two outputs on one path keep only the last written; one on the input destroys it.
    named: dict[Path, str] = {}
    for flag, value in (
        ("--schedule-file", args.schedule_file),
        ("--save", args.save),
        ("--trace", args.trace),
    ):
        if not value:
            continue
        path = Path(value).resolve()
        if path in named:
            raise UsageError(
                f"{flag} {value} is the file of {named[path]} too: give each its own file name"
            )
        named[path] = flag
    if args.width < 20:
        raise UsageError(f"--width {args.width}: give at least 20 characters")


def builtin_case(args: argparse.Namespace, name: str) -> SimCase:
    from pipetrain.schedules import registry

    if name not in registry.SCHEDULE_NAMES:
        raise UsageError(
            f"--schedule {name!r} is not a known schedule; use one of: "
            + ", ".join(registry.SCHEDULE_NAMES)
        )
    spec = registry.get_spec(name)
    check_size(args, spec.chunks(args.chunks))
    schedule = registry.build_schedule(name, args.pp, args.microbatches, args.chunks)
    if args.early_grads:
        from pipetrain.schedules.early_grads import early_grads

        schedule = early_grads(schedule)
    return SimCase(schedule, args.microbatches if spec.whole_batch else 1)


def single_case(args: argparse.Namespace) -> SimCase:
    """The one built-in schedule asked for; --chunks must mean something to it."""
    from pipetrain.schedules import registry

    case = builtin_case(args, args.schedule)
    spec = registry.get_spec(args.schedule)
    if args.chunks is not None and not spec.uses_chunks and args.chunks != spec.default_chunks:
        raise UsageError(
            f"--chunks {args.chunks}: {args.schedule} always has {spec.default_chunks} "
            "stage(s) per rank; drop --chunks or pick interleaved-1f1b or looped-bfs"
        )
    return case


def file_case(args: argparse.Namespace) -> SimCase:
    """A user's schedule; the loaders run the same validator as the built-in ones."""
    from pipetrain.schedules import io

    path = Path(args.schedule_file)
    if args.early_grads:
        raise UsageError(
            "--early-grads changes a built-in schedule; a schedule file runs as written "
            "(pipetrain train too): drop --early-grads, or save the file with it"
        )
    if args.chunks is not None:
        raise UsageError(
            f"--chunks {args.chunks}: a schedule file fixes the stages per rank by the stages "
            "each row runs: drop --chunks"
        )
    suffix = path.suffix.lower()
    if suffix == ".csv":
        schedule = io.load_csv(path, num_ranks=args.pp, microbatches=args.microbatches)
    elif suffix == ".json":
        schedule = io.load_json(path, num_ranks=args.pp)
        if args.microbatches is not None and args.microbatches != schedule.microbatches:
            raise UsageError(
                f"--microbatches {args.microbatches} but {path} has {schedule.microbatches}: "
                "drop --microbatches or fix the file"
            )
    else:
        raise UsageError(f"--schedule-file {path}: use a .csv or .json file")
    return SimCase(schedule, 1)


def save_schedule(schedule: Schedule, path: Path) -> None:
    """The schedule as a file that --schedule-file (and ``pipetrain.schedules.io``) loads."""
    from pipetrain.schedules import io

    if path.suffix.lower() == ".json":
        io.dump_json(schedule, path)
        return
    if schedule.asynchronous and schedule.params:
        # Loaded back, it would report one step of the whole stream, and train would not
        # know the window.
        raise UsageError(
            f"--save {path}: CSV keeps no params, and {schedule.name!r} needs its "
            f"{', '.join(name for name, _ in schedule.params)}: save it as .json"
        )
    io.dump_csv(schedule, path)
