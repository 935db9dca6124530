"""Splits as balanced as the balancer's, and the fastest of them by the simulator
(torch-free).

The time balancer (``balance.split_by_cost``) minimises the slowest stage, then the sum of
squares of the stage times. Where blocks cost alike, many splits reach both minima or come
within the profile's noise of them (blocks measured one by one differ by a few percent):
which stages of an interleaved placement take the extra block, for instance. They simulate
differently (interleaved 1F1B at v = 4, pp = 2 on llama-default: up to 7% apart), and
which one the balancer returns is an accident of its order and of that noise, so a
planner that took it would be neither the fastest it could be nor stable when a factor
moves by a rounding. ``fastest_tie`` simulates every split within ``TOLERANCE`` of both
minima (up to ``MAX_TIES``) and keeps the fastest.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.partition.balance import split_explicit
from pipetrain.partition.layer_costs import LayerCost
from pipetrain.partition.layouts import Scored
from pipetrain.partition.scoring import Scorer
from pipetrain.partition.stages import stage_ranks_of

__all__ = ["MAX_TIES", "TOLERANCE", "fastest_tie", "tied_block_counts"]

# Splits simulated per layout at most: llama-default's interleaved v = 4 has 35 exact ties.
MAX_TIES = 64
# How far above the balanced split's slowest stage and sum of squares a tie may be.
TOLERANCE = 0.02
# Partial splits the enumeration visits at most (milliseconds).
_VISITS = 20_000


def tied_block_counts(
    costs: Sequence[LayerCost],
    counts: Sequence[int],
    tolerance: float = TOLERANCE,
    limit: int = MAX_TIES,
) -> list[tuple[int, ...]]:
    """Blocks per stage of every split whose slowest stage and sum of squared stage times
    are within ``tolerance`` (relative) of those of ``counts``, ``counts`` first; at most
    ``limit``, found within a bounded enumeration.
    The embedding stays on the first stage and the head on the last; a stage between
    them holds at least one block, as ``split_explicit`` asks."""
    kinds = [c.kind == "block" for c in costs]
    first, last = kinds.index(True), len(kinds) - 1 - kinds[::-1].index(True)
    embed = sum(c.time for c in costs[:first])
    head = sum(c.time for c in costs[last + 1 :])
    prefix = [0.0]
    for c in costs[first : last + 1]:
        prefix.append(prefix[-1] + c.time)
    n_stages, n_blocks = len(counts), len(prefix) - 1

    def stage_time(stage: int, start: int, count: int) -> float:
        time = prefix[start + count] - prefix[start]
        return time + (embed if stage == 0 else 0.0) + (head if stage == n_stages - 1 else 0.0)

    times, start = [], 0
    for stage, count in enumerate(counts):
        times.append(stage_time(stage, start, count))
        start += count
    cap = max(times) * (1 + tolerance)
    squares = sum(t * t for t in times) * (1 + tolerance)
    found: list[tuple[int, ...]] = [tuple(counts)]
    visits = [0]

    def visit(stage: int, start: int, chosen: tuple[int, ...], sumsq: float) -> None:
        visits[0] += 1
        # What is left, shared by the stages left: none above the cap, and its squares
        # no fewer than an even share's.
        left, rest = n_stages - stage, prefix[-1] - prefix[start] + head
        rest += embed if stage == 0 else 0.0
        if rest > left * cap or sumsq + rest * rest / left > squares:
            return
        final = stage == n_stages - 1
        # Every stage after this one but the last needs a block of its own.
        most = n_blocks - start - max(0, n_stages - stage - 2)
        least = 0 if stage == 0 or final else 1
        options = [n_blocks - start] if final else list(range(least, most + 1))
        # Nearest an even share first: the ties lie there, and the bound finds them soon.
        options.sort(key=lambda count: abs(stage_time(stage, start, count) - rest / left))
        for count in options:
            if len(found) >= limit or visits[0] > _VISITS:
                return
            time = stage_time(stage, start, count)
            if time > cap:
                continue
            total = sumsq + time * time
            if total > squares:
                continue
            if final:
                if (*chosen, count) != tuple(counts):
                    found.append((*chosen, count))
            else:
                visit(stage + 1, start + count, (*chosen, count), total)

    visit(0, 0, (), 0.0)
    return found


def fastest_tie(scorer: Scorer, scored: Scored) -> Scored:
    """``scored`` at the fastest of its time-balanced split's ties that fits (itself where
    none is faster); a split balanced under the memory limit, or one balanced as if the
    ranks that recompute ran slower (``recompute_ranks``), is kept as it is."""
    layout = scored.layout
    if layout.pp == 1 or scored.memory_balanced or layout.recompute_ranks:
        return scored
    costs = scorer.layout_costs(layout)
    schedule = scorer.schedule(layout)
    ranks = stage_ranks_of(schedule.placement)
    best = scored
    for counts in tied_block_counts(costs, scored.split)[1:]:
        trial = scorer.score(layout, schedule, split_explicit(costs, counts, ranks), False)
        if trial.fits and trial.step_time < best.step_time:
            best = trial
    return best
