"""``pipetrain simulate``: time, bubble and memory of a schedule, and pictures of it.

    pipetrain simulate --schedule 1f1b --pp 4 --microbatches 8 [--ascii] [--json]
    pipetrain simulate --schedule 1f1b --pp 4 --microbatches 8 --save mine.csv
    pipetrain simulate --schedule-file mine.csv [--plot mine.png] [--trace mine.json]
    pipetrain simulate --compare --pp 4 --microbatches 8 [--plot all.png]
    pipetrain simulate --schedule 1f1b --pp 2 --microbatches 4 --weight-bytes 4.9e6 \
        --dp 2 [--shard] [--dp-bandwidth 1e6]

Imports no torch: everything here is pure schedule arithmetic (matplotlib only for
``--plot``). The text it prints is formatted in ``pipetrain.cli.simulate_text``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.cli.simulate_text import format_dp, format_summary, format_table, grid_fits
from pipetrain.schedules.execution import Costs
from pipetrain.schedules.schedule import Schedule
from pipetrain.sim.costs import parse_costs, stage_costs, stage_share
from pipetrain.sim.data_parallel import (
    DataParallelCost,
    ShardedCost,
    data_parallel_cost,
    sharded_cost,
)
from pipetrain.sim.render import plot, plot_compare, text_grid, transfers, write_chrome_trace
from pipetrain.sim.simulator import SimResult, scale_costs, simulate

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a schedule: makespan, bubble, memory; ASCII, PNG/SVG, Chrome trace",
        description="Simulate a pipeline schedule with per-stage costs and report its "
        "makespan, the bubble under three definitions, peak live activations and weight "
        "versions per rank.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--schedule", metavar="NAME", help="a built-in schedule, e.g. 1f1b, zb-v")
    what.add_argument(
        "--schedule-file", metavar="FILE", help="a schedule saved as CSV or JSON (one row per rank)"
    )
    what.add_argument(
        "--compare",
        action="store_true",
        help="every built-in schedule that fits --pp/--microbatches",
    )
    p.add_argument("--pp", type=int, metavar="P", help="pipeline ranks")
    p.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per step")
    p.add_argument("--chunks", type=int, metavar="V", help="stages per rank (interleaved, looped)")
    p.add_argument(
        "--costs",
        default="",
        metavar="F=1,B=2,I=1,W=1",
        help="durations of F, B, I, W (and ALLREDUCE, STEP) for one micro-batch. One number is "
        "the time of one rank's share of the model (1/pp of it): a schedule with v stages per "
        "rank (interleaved, V, looped) spends 1/v of it per stage, so schedules compare on "
        "one model. Numbers joined by '/' give each model stage's own time, e.g. F=1/1/2/1. "
        "B alone sets I = W = B/2; otherwise B = I + W, a missing one filled in (I or W "
        "alone keeps the other at 1). Default: F=I=W=1, B=2",
    )
    p.add_argument(
        "--early-grads",
        action="store_true",
        help="split the backwards that another rank waits for into I and W, as pipetrain train "
        "and build_pipeline run a built-in schedule (pipetrain.schedules.early_grads)",
    )
    p.add_argument("--latency", type=float, default=0.0, help="time per message (default 0)")
    p.add_argument(
        "--bandwidth", type=float, default=None, help="bytes per time unit (default: infinite)"
    )
    p.add_argument("--message-bytes", type=float, default=0.0, help="bytes per message")
    p.add_argument(
        "--activation-bytes",
        type=float,
        default=None,
        help="activation bytes one micro-batch leaves on one rank's share of the model "
        "(split over its stages like --costs)",
    )
    p.add_argument(
        "--weight-bytes",
        type=float,
        default=None,
        help="parameter bytes of one rank's share of the model (split like --costs)",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel replicas of the pipeline: add each rank's gradient all-reduce "
        "(its --weight-bytes) after its stages' last B/W (default 1: none)",
    )
    p.add_argument(
        "--shard",
        action="store_true",
        help="with --dp: stages sharded over the replicas (FSDP, as train --shard): each "
        "stage all-gathers its parameters before its first F and reduce-scatters its "
        "gradients after its last B/W, instead of one all-reduce",
    )
    p.add_argument(
        "--dp-bandwidth",
        type=float,
        default=None,
        metavar="BYTES",
        help="bytes per time unit of a rank's data-parallel link (default: bytes only, no time)",
    )
    p.add_argument("--plot", metavar="FILE", help="Gantt chart, .png or .svg")
    p.add_argument("--trace", metavar="FILE", help="Chrome trace JSON (Perfetto, chrome://tracing)")
    p.add_argument(
        "--save",
        metavar="FILE",
        help="write the schedule to FILE (.csv: one row of actions per rank; .json: also its "
        "placement and params) to edit and load back with --schedule-file",
    )
    p.add_argument("--ascii", action="store_true", help="print the time-aligned grid")
    p.add_argument("--width", type=int, default=120, help="grid width in characters (default 120)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (with --compare: {results: [...], skipped: [...]})",
    )
    p.set_defaults(run=run)


# -------------------------------------------------------------------------- helpers
@dataclass(frozen=True)
class _Case:
    """One schedule to simulate and how to weigh it against the others."""

    schedule: Schedule
    batch_scale: int


def _need(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} is required with --schedule and --compare, e.g. {flag} 4")


# The replay handles a few thousand stage micro-batches a second and about 1.5 kB each:
# a million is minutes and over a GB; a typo such as --microbatches 100000 on 100000
# ranks would run out of memory after hours instead of failing.
_MOST_STAGE_MICROBATCHES = 1_000_000


def _check_counts(args: argparse.Namespace) -> None:
    for name in ("pp", "microbatches", "chunks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} {value}: give a whole number >= 1")


def _check_size(args: argparse.Namespace, chunks: int) -> None:
    """Refuse, before any generator runs, what the replay could not finish."""
    total = args.pp * args.microbatches * chunks
    if total > _MOST_STAGE_MICROBATCHES:
        per_rank = f" x {chunks} stages per rank" if chunks > 1 else ""
        raise UsageError(
            f"--pp {args.pp} x --microbatches {args.microbatches}{per_rank} is {total:,} "
            f"stage micro-batches to replay, over the {_MOST_STAGE_MICROBATCHES:,} the "
            "simulator takes: lower --pp or --microbatches"
        )


def _check_sizes(args: argparse.Namespace) -> None:
    # A negative, infinite or NaN size would flow into every byte column of the report.
    for name in ("activation_bytes", "weight_bytes"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value:g}: give a finite number of bytes >= 0")


def _check_outputs(args: argparse.Namespace) -> None:
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


def _builtin(args: argparse.Namespace, name: str) -> _Case:
    from pipetrain.schedules import registry

    if name not in registry.SCHEDULE_NAMES:
        raise UsageError(
            f"--schedule {name!r} is not a known schedule; use one of: "
            + ", ".join(registry.SCHEDULE_NAMES)
        )
    spec = registry.get_spec(name)
    _check_size(args, spec.chunks(args.chunks))
    schedule = registry.build_schedule(name, args.pp, args.microbatches, args.chunks)
    if args.early_grads:
        from pipetrain.schedules.early_grads import early_grads

        schedule = early_grads(schedule)
    return _Case(schedule, args.microbatches if spec.whole_batch else 1)


def _single(args: argparse.Namespace) -> _Case:
    """The one built-in schedule asked for; --chunks must mean something to it."""
    from pipetrain.schedules import registry

    case = _builtin(args, args.schedule)
    spec = registry.get_spec(args.schedule)
    if args.chunks is not None and not spec.uses_chunks and args.chunks != spec.default_chunks:
        raise UsageError(
            f"--chunks {args.chunks}: {args.schedule} always has {spec.default_chunks} "
            "stage(s) per rank; drop --chunks or pick interleaved-1f1b or looped-bfs"
        )
    return case


def _from_file(args: argparse.Namespace) -> _Case:
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
    return _Case(schedule, 1)


def _case_costs(case: _Case, costs: Costs) -> Costs:
    # What simulate replays: the rank's share split over its stages, the batch scale on top.
    per_stage = stage_costs(costs, case.schedule)
    return scale_costs(per_stage, case.batch_scale) if case.batch_scale != 1 else per_stage


def _run_case(case: _Case, costs: Costs, args: argparse.Namespace) -> SimResult:
    share = stage_share(case.schedule)
    return simulate(
        case.schedule,
        stage_costs(costs, case.schedule),
        activation_bytes=None if args.activation_bytes is None else args.activation_bytes * share,
        weight_bytes=None if args.weight_bytes is None else args.weight_bytes * share,
        batch_scale=case.batch_scale,
    )


def _data_parallel(
    case: _Case, result: SimResult, costs: Costs, args: argparse.Namespace
) -> DataParallelCost | ShardedCost | None:
    """The dp all-reduce of each rank's gradients (sharded: gathers and reduce-scatters),
    with --dp above 1."""
    if args.dp < 1:
        raise UsageError(f"--dp {args.dp}: give a whole number >= 1")
    if args.dp == 1:
        if args.shard:
            raise UsageError("--shard shards stages over dp replicas: add --dp 2 (or more)")
        return None
    if case.schedule.asynchronous:
        # One all-reduce per stage after its last B/W models one synchronous step; an
        # asynchronous stream updates its weights inside it (train refuses --dp with it).
        raise UsageError(
            f"--dp {args.dp}: {case.schedule.name!r} is asynchronous (weights change inside "
            "a step), which data parallelism does not support: pick a synchronous schedule "
            "such as 1f1b or zb-h1, or drop --dp"
        )
    if args.weight_bytes is None:
        raise UsageError(
            "--dp needs --weight-bytes: the parameter bytes of a rank's share, which it all-reduces"
        )
    stage_bytes = args.weight_bytes * stage_share(case.schedule)
    if args.shard:
        return sharded_cost(
            case.schedule,
            _case_costs(case, costs),
            stage_bytes,
            replicas=args.dp,
            bandwidth=args.dp_bandwidth,
        )
    return data_parallel_cost(
        result.timeline,
        case.schedule.placement,
        stage_bytes,
        replicas=args.dp,
        bandwidth=args.dp_bandwidth,
    )


# ------------------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> int:
    _check_counts(args)
    _check_sizes(args)
    _check_outputs(args)
    costs = parse_costs(
        args.costs,
        latency=args.latency,
        bandwidth=args.bandwidth,
        message_bytes=args.message_bytes,
    )
    if args.compare:
        return _compare(args, costs)
    if args.schedule_file:
        case = _from_file(args)
    else:
        _need(args, "pp", "microbatches")
        case = _single(args)
    result = _run_case(case, costs, args)
    dp = _data_parallel(case, result, costs, args)
    if args.save:
        _save(case.schedule, Path(args.save))
    if args.plot:
        plot(result.timeline, args.plot)
    if args.trace:
        # Sharded, the first forwards wait for their gathers: trace that replay.
        traced = dp.timeline if isinstance(dp, ShardedCost) and dp.timeline else result.timeline
        sent = transfers(traced, case.schedule.placement, costs.transfer())
        links = [dp.spans if dp is not None else ()]
        write_chrome_trace(traced, args.trace, messages=[sent], links=links)
    if args.json:
        print(json.dumps({**result.to_json(), **({"data_parallel": dp.to_json()} if dp else {})}))
        return 0
    print(format_summary(result))
    if dp is not None:
        print(format_dp(dp))
    if args.ascii or grid_fits(result):
        print()
        print(text_grid(result.timeline, width=args.width))
    elif not args.plot:
        print("  (grid too wide for the terminal: --ascii squeezes it, --plot draws it)")
    for path in (args.plot, args.trace, args.save):
        if path:
            print(f"wrote {path}")
    return 0


def _save(schedule: Schedule, path: Path) -> None:
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


def _compare(args: argparse.Namespace, costs: Costs) -> int:
    from pipetrain.schedules import registry

    if args.dp != 1 or args.shard:
        raise UsageError("--dp and --shard work with --schedule or --schedule-file: drop --compare")

    _need(args, "pp", "microbatches")
    # Checking a schedule's fit may build it: the size comes first.
    _check_size(
        args, max(registry.get_spec(n).chunks(args.chunks) for n in registry.SCHEDULE_NAMES)
    )
    results: list[SimResult] = []
    placements = []
    skipped: list[tuple[str, str]] = []
    for name in registry.SCHEDULE_NAMES:
        reason = registry.get_spec(name).check(args.pp, args.microbatches, args.chunks)
        if reason is not None:
            skipped.append((name, reason))
            continue
        case = _builtin(args, name)
        results.append(_run_case(case, costs, args))
        placements.append(case.schedule.placement)
    if not results:
        raise UsageError(
            f"no schedule fits --pp {args.pp} --microbatches {args.microbatches}: "
            "try --microbatches equal to a multiple of --pp"
        )
    pictured, off_scale = _on_one_scale(results)
    if args.plot:
        plot_compare([r.timeline for r in pictured], args.plot)
    if args.trace:
        sent = [
            transfers(r.timeline, where, costs.transfer())
            for r, where in zip(results, placements, strict=True)
        ]
        write_chrome_trace([r.timeline for r in results], args.trace, messages=sent)
    if args.json:
        print(
            json.dumps(
                {
                    "results": [r.to_json() for r in results],
                    "skipped": [{"schedule": n, "reason": why} for n, why in skipped],
                }
            )
        )
        return 0
    print(format_table(results))
    print(
        "  costs: one rank's share of the model per micro-batch, split over its stages; "
        "naive runs the whole batch at once\n"
        "  idle: share of ranks x makespan; over ideal: idle over work; span idle: worst "
        "rank's idle time inside its own span\n"
        "  peak activations: stage x micro-batch units (a stage is 1/v of a rank's share)"
    )
    for name, why in skipped:
        print(f"  not fitting: {name}: {why}")
    if args.ascii:
        for r in results:
            print()
            print(text_grid(r.timeline, width=args.width))
    if args.plot:
        for r in off_scale:
            print(f"  not in the picture: {r.schedule} (makespan {r.makespan:g}, off the scale)")
    for path in (args.plot, args.trace):
        if path:
            print(f"wrote {path}")
    return 0


def _on_one_scale(results: list[SimResult]) -> tuple[list[SimResult], list[SimResult]]:
    """Split off the naive baseline when it is over twice as long as every pipeline: on a
    shared time axis it would squeeze all the others into slivers."""
    from pipetrain.schedules import registry

    whole = {r.schedule for r in results if registry.get_spec(r.schedule).whole_batch}
    longest = max((r.makespan for r in results if r.schedule not in whole), default=0.0)
    off = {r.schedule for r in results if r.schedule in whole and 0 < 2 * longest < r.makespan}
    return (
        [r for r in results if r.schedule not in off],
        [r for r in results if r.schedule in off],
    )
