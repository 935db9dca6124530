"""``pipetrain simulate``: time, bubble and memory of a schedule, and pictures of it.

    pipetrain simulate --schedule 1f1b --pp 4 --microbatches 8 [--ascii] [--json]
    pipetrain simulate --schedule 1f1b --pp 4 --microbatches 8 --save mine.csv
    pipetrain simulate --schedule-file mine.csv [--plot mine.png] [--trace mine.json]
    pipetrain simulate --compare --pp 4 --microbatches 8 [--plot all.png]
    pipetrain simulate --schedule 1f1b --pp 2 --microbatches 4 --weight-bytes 4.9e6 \
        --dp 2 [--shard] [--dp-bandwidth 1e6]
    pipetrain simulate --schedule 1f1b --pp 4 --microbatches 8 --tp 8 --tp-bytes 2.1e9 \
        --tp-bandwidth 1.5e11 --costs F=0.05,B=0.1
    pipetrain simulate --schedule 1f1b --pp 4 --microbatches 8 --ep 8 --ep-bytes 1.34e8 \
        --moe-layers 8 --ep-bandwidth 5e10 --costs F=2.2,B=4.4

Imports no torch: everything here is pure schedule arithmetic (matplotlib only for
``--plot``). The text it prints is formatted in ``pipetrain.cli.simulate_text``; the flags are checked
and the schedules built in ``pipetrain.cli.simulate_cases``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.cli.ranks import add_rank_flags, memory_lines, memory_report, on_ranks
from pipetrain.cli.simulate_cases import (
    SimCase,
    builtin_case,
    check_counts,
    check_outputs,
    check_size,
    check_sizes,
    file_case,
    need,
    save_schedule,
    single_case,
)
from pipetrain.cli.simulate_ep import add_ep_flags, ep_json, ep_line, with_expert_parallel
from pipetrain.cli.simulate_text import format_dp, format_summary, format_table, grid_fits
from pipetrain.schedules.execution import Costs
from pipetrain.sim.costs import parse_costs, stage_costs, stage_share
from pipetrain.sim.data_parallel import (
    DataParallelCost,
    ShardedCost,
    data_parallel_cost,
    sharded_cost,
)
from pipetrain.sim.render import plot, plot_compare, text_grid, transfers, write_chrome_trace
from pipetrain.sim.simulator import SimResult, scale_costs, simulate
from pipetrain.sim.tensor_parallel import tp_time, tp_traffic, with_tp_time

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a schedule: makespan, bubble, memory; ASCII, PNG/SVG, Chrome trace",
        description="Simulate a pipeline schedule with per-stage costs and report its "
        "makespan, the bubble under three definitions, peak live activations and weight "
        "versions per rank.",
    )
    _add_schedule_flags(p)
    _add_cost_flags(p)
    add_rank_flags(p)
    _add_data_parallel_flags(p)
    _add_tensor_parallel_flags(p)
    add_ep_flags(p)
    _add_output_flags(p)
    p.set_defaults(run=run)


def _add_schedule_flags(p: argparse.ArgumentParser) -> None:
    """Which schedule: a built-in one, a file, or all of them, and its size."""
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


def _add_cost_flags(p: argparse.ArgumentParser) -> None:
    """What the actions, messages and activations cost."""
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


def _add_data_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Replicas of the pipeline and their gradient collectives."""
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


def _add_tensor_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism inside each stage and its collectives."""
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks per stage: every F, B and I waits for the tp all-reduces "
        "of --tp-bytes at --tp-bandwidth (default 1: none). --weight-bytes and "
        "--activation-bytes are then one tp rank's, as pipetrain plan --tp prints them",
    )
    p.add_argument(
        "--tp-bytes",
        type=float,
        default=0.0,
        metavar="BYTES",
        help="bytes one micro-batch all-reduces over tp in the forward of one rank's share "
        "(2 x blocks x micro-batch x T x C x dtype); the backward as many (default 0)",
    )
    p.add_argument(
        "--tp-bandwidth",
        type=float,
        default=None,
        metavar="BYTES",
        help="bytes per time unit of a rank's tensor-parallel link (default: bytes only, no time)",
    )


def _tensor_parallel(case: SimCase, costs: Costs, args: argparse.Namespace) -> Costs:
    """``costs`` with the tp collectives' time on every F, B and I, with --tp above 1."""
    if args.tp < 1:
        raise UsageError(f"--tp {args.tp}: give a whole number >= 1")
    if args.tp == 1:
        if args.tp_bytes or args.tp_bandwidth is not None:
            raise UsageError("--tp-bytes and --tp-bandwidth need --tp 2 (or more)")
        return costs
    seconds = tp_time(1, args.tp_bytes, args.tp, args.tp_bandwidth)
    return with_tp_time(costs, seconds, stage_share(case.schedule))


def _tp_json(args: argparse.Namespace) -> dict[str, Any]:
    """Per micro-batch, the time and link bytes of a rank's tp collectives."""
    return {
        "tp": args.tp,
        "tp_bytes": args.tp_bytes,
        "time_per_forward": tp_time(1, args.tp_bytes, args.tp, args.tp_bandwidth),
        "traffic_per_microbatch": tp_traffic(2, args.tp_bytes, args.tp),
    }


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Pictures, files and the printed report."""
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


def _case_costs(case: SimCase, costs: Costs, args: argparse.Namespace) -> Costs:
    # What simulate replays: the rank's share split over its stages, the batch scale on top.
    per_stage = on_ranks(args, case.schedule, stage_costs(costs, case.schedule))
    return scale_costs(per_stage, case.batch_scale) if case.batch_scale != 1 else per_stage


def _run_case(case: SimCase, costs: Costs, args: argparse.Namespace) -> SimResult:
    share = stage_share(case.schedule)
    return simulate(
        case.schedule,
        on_ranks(args, case.schedule, stage_costs(costs, case.schedule)),
        activation_bytes=None if args.activation_bytes is None else args.activation_bytes * share,
        weight_bytes=None if args.weight_bytes is None else args.weight_bytes * share,
        batch_scale=case.batch_scale,
    )


def _data_parallel(
    case: SimCase, result: SimResult, costs: Costs, args: argparse.Namespace
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
            _case_costs(case, costs, args),
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
    check_counts(args)
    check_sizes(args)
    check_outputs(args)
    costs = parse_costs(
        args.costs,
        latency=args.latency,
        bandwidth=args.bandwidth,
        message_bytes=args.message_bytes,
    )
    if args.compare:
        return _compare(args, costs)
    if args.schedule_file:
        case = file_case(args)
    else:
        need(args, "pp", "microbatches")
        case = single_case(args)
    costs = _tensor_parallel(case, costs, args)
    costs = with_expert_parallel(case, costs, args)
    result = _run_case(case, costs, args)
    dp = _data_parallel(case, result, costs, args)
    if args.save:
        save_schedule(case.schedule, Path(args.save))
    if args.plot:
        plot(result.timeline, args.plot)
    if args.trace:
        # Sharded, the first forwards wait for their gathers: trace that replay.
        traced = dp.timeline if isinstance(dp, ShardedCost) and dp.timeline else result.timeline
        sent = transfers(traced, case.schedule.placement, costs.transfer())
        links = [dp.spans if dp is not None else ()]
        write_chrome_trace(traced, args.trace, messages=[sent], links=links)
    memory = memory_report(args, result)
    if args.json:
        tp: dict[str, Any] = {"tensor_parallel": _tp_json(args)} if args.tp > 1 else {}
        tp.update({} if memory is None else {"rank_memory": memory})
        print(
            json.dumps(
                {
                    **result.to_json(),
                    **({"data_parallel": dp.to_json()} if dp else {}),
                    **tp,
                    **({"expert_parallel": ep_json(case, args)} if args.ep > 1 else {}),
                }
            )
        )
        return 0
    print(format_summary(result))
    for line in memory_lines(result.schedule, memory or []):
        print(line)
    if args.tp > 1:
        tp = _tp_json(args)
        print(
            f"  tp={args.tp} collectives  {tp['time_per_forward']:g} per F, B and I; "
            f"{tp['traffic_per_microbatch']:g} bytes per micro-batch through each tp link"
        )
    if args.ep > 1:
        print(ep_line(case, args))
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


def _compare(args: argparse.Namespace, costs: Costs) -> int:
    from pipetrain.schedules import registry

    if args.dp != 1 or args.shard or args.tp != 1 or args.ep != 1:
        raise UsageError(
            "--dp, --shard, --tp and --ep work with --schedule or --schedule-file: drop --compare"
        )

    need(args, "pp", "microbatches")
    # Checking a schedule's fit may build it: the size comes first.
    check_size(args, max(registry.get_spec(n).chunks(args.chunks) for n in registry.SCHEDULE_NAMES))
    results: list[SimResult] = []
    placements = []
    skipped: list[tuple[str, str]] = []
    for name in registry.SCHEDULE_NAMES:
        reason = registry.get_spec(name).check(args.pp, args.microbatches, args.chunks)
        if reason is not None:
            skipped.append((name, reason))
            continue
        case = builtin_case(args, name)
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
    for r in results:
        for line in memory_lines(r.schedule, memory_report(args, r) or []):
            print(line)
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
