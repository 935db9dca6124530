"""The text ``pipetrain simulate`` prints: a schedule's summary, its data-parallel lines,
the ``--compare`` table, and whether the grid fits a terminal.

Pure formatting of simulation results (``pipetrain.cli.simulate`` runs them).
"""

from __future__ import annotations

from pipetrain.sim.data_parallel import DataParallelCost, ShardedCost
from pipetrain.sim.render import text_grid
from pipetrain.sim.simulator import SimResult

__all__ = ["format_dp", "format_ranks", "format_summary", "format_table", "grid_fits"]

# Show the grid without --ascii only when the full-width grid fits a terminal.
_AUTO_GRID_WIDTH = 160


def format_ranks(values: tuple[float, ...] | tuple[int, ...]) -> str:
    return " ".join(f"{v:g}" for v in values)


def format_summary(r: SimResult) -> str:
    b = r.bubble
    lines = [
        f"{r.schedule}: pp={r.num_ranks} microbatches={r.microbatches} chunks={r.chunks}",
        f"  makespan            {r.makespan:g}"
        + (f" for {r.steps} optimizer steps ({r.time_per_step:g} per step)" if r.steps > 1 else ""),
        f"  bubble              {b.idle_fraction:.2%} of rank time (GPipe), "
        f"{b.over_ideal:.2%} over ideal compute (Megatron)",
        f"  worst rank span     {b.per_rank_span_time:g} idle = "
        f"{b.per_rank_span_fraction:.2%} of its span (Zero Bubble)",
        f"  idle per rank       {format_ranks(r.idle)}",
        f"  peak activations    {format_ranks(r.peak_activations)} (stage x micro-batch units)",
        f"  weight versions     {format_ranks(r.weight_versions)}",
    ]
    if r.peak_activation_bytes is not None:
        lines.append(f"  activation bytes    {format_ranks(r.peak_activation_bytes)}")
    if r.weight_bytes is not None:
        lines.append(f"  weight bytes        {format_ranks(r.weight_bytes)}")
    return "\n".join(lines)


def format_dp(dp: DataParallelCost | ShardedCost) -> str:
    if isinstance(dp, ShardedCost):
        return _format_sharded(dp)
    lines = [
        f"  {f'dp={dp.replicas} all-reduce':<20}{format_ranks(dp.bytes_per_rank)} bytes per rank, "
        f"{format_ranks(dp.traffic_per_rank)} through each link",
    ]
    if any(dp.allreduce_time):
        lines.append(
            f"  all-reduce time     {format_ranks(dp.allreduce_time)}; step {dp.step_time:g} "
            f"({dp.exposed:g} past the pipeline)"
        )
    return "\n".join(lines)


def _format_sharded(dp: ShardedCost) -> str:
    lines = [
        f"  {f'dp={dp.replicas} sharded':<20}{format_ranks(dp.bytes_per_rank)} bytes per rank "
        f"all-gathered and reduce-scattered, {format_ranks(dp.traffic_per_rank)} through each link",
    ]
    if any(dp.gather_time) or any(dp.reduce_scatter_time):
        lines.append(
            f"  all-gather time     {format_ranks(dp.gather_time)}; reduce-scatter "
            f"{format_ranks(dp.reduce_scatter_time)}; step {dp.step_time:g} ({dp.exposed:g} past "
            f"the pipeline, {dp.gather_delay:g} of it first forwards waiting for gathers)"
        )
    return "\n".join(lines)


def grid_fits(r: SimResult) -> bool:
    return len(text_grid(r.timeline, width=10**6).splitlines()[-1]) <= _AUTO_GRID_WIDTH


def format_table(results: list[SimResult]) -> str:
    head = (
        "schedule",
        "makespan",
        "per step",
        "idle",
        "over ideal",
        "span idle",
        "peak activations",
        "weight versions",
    )
    rows = [
        (
            r.schedule,
            f"{r.makespan:g}",
            f"{r.time_per_step:g}",
            f"{r.bubble.idle_fraction:.1%}",
            f"{r.bubble.over_ideal:.1%}",
            f"{r.bubble.per_rank_span_time:g}",
            format_ranks(r.peak_activations),
            format_ranks(r.weight_versions),
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (head, *rows)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
