"""Sizes and unequal ranks on the command line: ``--memory-limit 16GiB``, ``--rank-speed
1,1,0.5,1`` and ``--rank-memory 8GiB,8GiB,4GiB,8GiB`` for ``plan`` and ``simulate``.

A rank's speed is relative to the costs (1: as given or measured; 0.5: twice as slow), its
memory is its own limit. ``plan`` balances the split for them and shows the split it would
make for equal ranks beside it, run on these ranks; ``simulate`` runs each rank's stages
at its speed and checks its peak against its memory. Imports no torch.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.partition.balance import LayerCost, format_bytes
from pipetrain.partition.planner import Plan
from pipetrain.schedules.execution import Costs
from pipetrain.schedules.schedule import Schedule
from pipetrain.sim.ranks import with_rank_speeds
from pipetrain.sim.simulator import SimResult

__all__ = [
    "RankOptions",
    "add_rank_flags",
    "compare_equal",
    "memory_lines",
    "memory_report",
    "on_ranks",
    "parse_size",
    "rank_options",
    "rank_report",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str, flag: str = "--memory-limit") -> float:
    """``"16GiB"`` -> 17179869184.0; decimal (GB) and binary (GiB) units, or plain bytes."""
    # The number may have an exponent ("2e9", as the error below suggests).
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    size = float(match.group(1)) * _UNITS[unit] if match and unit in _UNITS else 0.0
    if not 0 < size < math.inf:
        raise UsageError(f"{flag} {text!r} is not a size: write e.g. 16GiB, 512MiB or 2e9")
    return size


@dataclass(frozen=True)
class RankOptions:
    """Per-rank speed and memory; None where the flag was not given."""

    speed: tuple[float, ...] | None = None
    memory: tuple[float, ...] | None = None

    @property
    def given(self) -> bool:
        return self.speed is not None or self.memory is not None


def add_rank_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rank-speed",
        metavar="1,1,0.5,1",
        help="each pipeline rank's speed relative to the costs (0.5: twice as slow); a slow "
        "rank's stages take longer, and plan gives it fewer layers",
    )
    p.add_argument(
        "--rank-memory",
        metavar="8GiB,8GiB,4GiB,8GiB",
        help="each pipeline rank's own memory limit (instead of --memory-limit); plan gives a "
        "small rank fewer layers, simulate checks each rank's peak against it",
    )


def rank_options(args: argparse.Namespace, pp: int) -> RankOptions:
    """The per-rank flags parsed and checked against ``pp`` ranks (one line on a problem)."""
    speed = memory = None
    if args.rank_speed is not None:
        speed = tuple(_speed(x, args.rank_speed) for x in _items(args.rank_speed, "--rank-speed"))
        _count("--rank-speed", args.rank_speed, len(speed), pp)
    if args.rank_memory is not None:
        items = _items(args.rank_memory, "--rank-memory")
        memory = tuple(parse_size(x, "--rank-memory: size") for x in items)
        _count("--rank-memory", args.rank_memory, len(memory), pp)
        if getattr(args, "memory_limit", None) is not None:
            raise UsageError(
                "--memory-limit gives every rank one limit and --rank-memory each its own: "
                "give one of them"
            )
    return RankOptions(speed, memory)


def _items(text: str, flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise UsageError(
            f"{flag} {text!r} has an empty entry: write one value per rank, comma-separated"
        )
    return items


def _speed(text: str, whole: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise UsageError(
            f"--rank-speed {whole!r}: {text!r} is not a speed > 0 (1 = the costs as given, "
            "0.5 = twice as slow)"
        )
    return value


def _count(flag: str, text: str, n: int, pp: int) -> None:
    if n != pp:
        raise UsageError(f"{flag} {text!r} gives {n} values for --pp {pp}: give one per rank")


def rank_report(
    options: RankOptions,
    layers: Sequence[int],
    step_time: float,
    even_layers: Sequence[int],
    even_step_time: float,
    even_peaks: Sequence[float],
) -> tuple[list[str], dict[str, Any]]:
    """Lines and a JSON object comparing the split made for these ranks with the one made
    for equal ranks, both timed on these ranks (``even_peaks``: the latter's bytes per rank)."""
    over = [
        f"rank {r} needs {format_bytes(b)} of its {format_bytes(limit)}"
        for r, (b, limit) in enumerate(zip(even_peaks, options.memory or (), strict=False))
        if b > limit
    ]
    shown = []
    if options.speed is not None:
        shown.append("speed " + ",".join(f"{s:g}" for s in options.speed))
    if options.memory is not None:
        shown.append("memory " + ",".join(format_bytes(m) for m in options.memory))
    lines = [
        f"unequal ranks ({'; '.join(shown)}):",
        f"  split for these ranks: layers {','.join(map(str, layers))}, step {step_time:.3f} s",
        f"  split for equal ranks: layers {','.join(map(str, even_layers))}, "
        f"step {even_step_time:.3f} s on these ranks" + (f" ({'; '.join(over)})" if over else ""),
    ]
    json_out = {
        "layers": list(layers),
        "step_time": step_time,
        "equal_ranks": {
            "layers": list(even_layers),
            "step_time": even_step_time,
            "fits": not over,
        },
    }
    return lines, json_out


def compare_equal(
    plan_for: Callable[..., Plan],
    plan: Plan,
    options: RankOptions,
    method: str,
    split: Sequence[int] | None,
    costs: Sequence[LayerCost],
) -> tuple[list[str], dict[str, Any]]:
    """``plan`` (made for these ranks) beside the split ``method`` makes for equal ranks,
    timed on these ranks; ``plan_for(**kw)`` plans with the run's other settings."""
    even = plan_for(method=method, split=split)

    def blocks(p: Plan) -> list[int]:
        return [sum(1 for i in stage if costs[i].kind == "block") for stage in p.partition.stages]

    on_these = plan_for(method="explicit", split=blocks(even), rank_speed=options.speed)
    return rank_report(
        options,
        [len(stage) for stage in plan.partition.stages],
        plan.step_time,
        [len(stage) for stage in even.partition.stages],
        on_these.step_time,
        on_these.rank_bytes,
    )


def on_ranks(args: argparse.Namespace, schedule: Schedule, costs: Costs) -> Costs:
    """``costs`` (per stage, as ``simulate`` replays them) with each rank's stages at its
    ``--rank-speed``; unchanged without the flag."""
    options = rank_options(args, schedule.num_ranks)
    if options.speed is None:
        return costs
    return with_rank_speeds(costs, schedule.placement, options.speed)


def memory_report(args: argparse.Namespace, result: SimResult) -> list[dict[str, Any]] | None:
    """Per rank, its peak bytes (activations, plus weights when given) against its
    ``--rank-memory``; None without the flag."""
    options = rank_options(args, result.num_ranks)
    if options.memory is None:
        return None
    if result.peak_activation_bytes is None:
        raise UsageError(
            "--rank-memory needs --activation-bytes (and --weight-bytes for the weights) to "
            "count each rank's bytes"
        )
    weights = result.weight_bytes or (0.0,) * result.num_ranks
    return [
        {"rank": r, "peak_bytes": a + w, "limit": limit, "fits": a + w <= limit}
        for r, (a, w, limit) in enumerate(
            zip(result.peak_activation_bytes, weights, options.memory, strict=True)
        )
    ]


def memory_lines(schedule: str, report: list[dict[str, Any]]) -> list[str]:
    """The ranks over their memory: one line naming the first, none when all fit."""
    over = [x for x in report if not x["fits"]]
    if not over:
        return []
    first = over[0]
    more = f" (and {len(over) - 1} more ranks)" if len(over) > 1 else ""
    return [
        f"  over --rank-memory: {schedule}: rank {first['rank']} needs "
        f"{format_bytes(first['peak_bytes'])} of its {format_bytes(first['limit'])}{more}"
    ]
