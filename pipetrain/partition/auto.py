"""``plan --auto``: one search over schedule, chunks, pp x dp x tp, micro-batches,
recomputation and early input gradients, scored by the simulator under a memory budget.

Torch-free. The caller gives per-layer costs for each tp degree (estimated or profiled);
each candidate layout is split by the exact time balancer (``split_for``; again with the
memory model when the time-balanced split does not fit), replayed by the simulator for
its step time and its peak live activations per rank, and charged in bytes by
``pipetrain.partition.memory``.

What is exact and what is pruned (docs/plan_auto.md): every layout of the space gets a
lower bound on its step time (its replica's compute spread evenly over its ranks) and a
lower bound on its memory (its state spread evenly); layouts are simulated in order of
the bound until the bound passes the ``top``-th fastest fitting time, so the ``top``
fastest layouts with plain backwards are exactly those of the whole space. Early input
gradients, whose choice replays the schedule many times, are tried on the ``top``
fastest only, and only where the schedule is small (``_EARLY_MAX_ACTIONS``); so are the
splits as balanced as the balancer's (``ties.fastest_tie``), which can only make a layout
of the top faster.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import replace

from pipetrain.models.config import ModelConfig
from pipetrain.partition.layouts import (
    AutoPlan,
    AutoRequest,
    CostsFor,
    Hardware,
    Layout,
    Scored,
    enumerate_layouts,
)
from pipetrain.partition.scoring import Scorer
from pipetrain.partition.ties import fastest_tie

__all__ = ["AutoPlan", "AutoRequest", "Hardware", "Layout", "Scored", "search"]

# Early input gradients replay the schedule once per split tried: beyond this many actions
# (p x m x v) the choice takes seconds per layout, so it is not tried there.
_EARLY_MAX_ACTIONS = 256
# Pipelines over the limit that are tried with only their fullest ranks recomputing.
_SOME_RANKS_TRIED = 20


def _rank_key(s: Scored) -> tuple[float, float, Layout]:
    return (s.step_time, s.peak_bytes, s.layout)


def _recomputing_some_ranks(scorer: Scorer, over: list[Scored], req: AutoRequest) -> list[Scored]:
    """The fastest ``_SOME_RANKS_TRIED`` pipelines over the limit without recomputation,
    each with only its ranks over the limit recomputing (more, while the split that
    balances them pushes others over): those that then fit."""
    limit = req.memory_limit
    if limit is None or True not in req.recompute:
        return []
    found = []
    tried = [s for s in over if s.layout.pp > 1 and not s.layout.recompute]
    for scored in sorted(tried, key=_rank_key)[:_SOME_RANKS_TRIED]:
        ranks: set[int] = set()
        current: Scored | None = scored
        while current is not None and not current.fits:
            more = {r for r, m in enumerate(current.memory) if m.total > limit} - ranks
            if not more or len(ranks | more) == scored.layout.pp:
                break  # nothing new to recompute, or every rank: plain recompute's layout
            ranks |= more
            current = scorer.evaluate(replace(scored.layout, recompute_ranks=tuple(sorted(ranks))))
        if current is not None and current.fits:
            found.append(current)
    return found


def search(
    config: ModelConfig, req: AutoRequest, costs_for: CostsFor, hardware: Hardware
) -> AutoPlan:
    """The ``req.top`` fastest layouts that fit (see the module doc for what is exact)."""
    started = time.perf_counter()
    scorer = Scorer(config, req, costs_for, hardware)
    bounded = sorted((scorer.bound(lay), lay) for lay in enumerate_layouts(config, req))
    limit = req.memory_limit
    fitting: list[Scored] = []
    over: list[Scored] = []
    times: list[float] = []  # of the fitting ones, sorted: the top-th is the cutoff
    fastest_over = math.inf  # the fastest simulated layout over the limit
    simulated = 0
    for (time_bound, static_bound), layout in bounded:
        if time_bound >= (times[req.top - 1] if len(times) >= req.top else math.inf):
            break
        if limit is not None and static_bound > limit:
            continue  # its weights and their state alone are over the limit
        if time_bound >= fastest_over and (scorer.over_without_simulating(layout)):
            continue  # over the limit, and not the fastest layout the limit rules out
        scored = scorer.evaluate(layout)
        simulated += 1
        if scored is None:
            continue
        (fitting if scored.fits else over).append(scored)
        if not scored.fits:
            fastest_over = min(fastest_over, scored.step_time)
        if scored.fits:
            bisect.insort(times, scored.step_time)
    pruned = len(bounded) - simulated  # bounded out, or over the limit by state alone
    fitting.extend(_recomputing_some_ranks(scorer, over, req))
    fitting.sort(key=_rank_key)
    # The top's splits: the fastest of those as balanced as the balancer's (ties.py).
    fitting[: req.top] = [fastest_tie(scorer, scored) for scored in fitting[: req.top]]
    for scored in list(fitting[: req.top]):
        lay = scored.layout
        if lay.pp == 1 or lay.pp * lay.microbatches * lay.chunks > _EARLY_MAX_ACTIONS:
            continue
        early = scorer.evaluate(replace(lay, early_grads=True))
        if early is not None and early.fits:
            early = fastest_tie(scorer, early)
        if early is not None and early.fits and early.step_time < scored.step_time:
            fitting.append(early)
    fitting.sort(key=_rank_key)
    over.sort(key=_rank_key)
    return AutoPlan(
        req,
        tuple(fitting),
        tuple(over),
        len(bounded),
        simulated,
        pruned,
        time.perf_counter() - started,
    )
