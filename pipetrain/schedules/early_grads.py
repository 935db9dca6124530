"""Early input gradients: a backward that another rank waits for runs as I, then W.

``B(s, k)`` computes two things: the gradient of the stage's input, which ``prev(s)``
needs, and the gradient of the stage's weights, which nothing else in the step needs.
Where ``prev(s)`` lives on another rank that sits idle until that input gradient arrives,
running ``I(s, k)``, sending, then ``W(s, k)`` at once lets that rank start a W earlier.
1F1B's cool-down is the case: rank r waits for the last micro-batches' gradients of
rank r + 1. With p = 2, m = 4 and unit costs (F = 1, B = 2, I = W = 1; ``pipetrain.schedules.grid.format_timeline``)::

    1f1b          rank 0 | 0F0 0F1 .   .   0B0 0B0 0F2 0B1 0B1 0F3 0B2 0B2 .   0B3 0B3
                  rank 1 | .   1F0 1B0 1B0 1F1 1B1 1B1 1F2 1B2 1B2 1F3 1B3 1B3
    early grads   rank 0 | 0F0 0F1 .   .   0B0 0B0 0F2 0B1 0B1 0F3 0B2 0B2 0B3 0B3
                  rank 1 | .   1F0 1B0 1B0 1F1 1B1 1B1 1F2 1B2 1B2 1F3 1I3 1W3

Each rank keeps its order of work, and the gradients are the same sums; only the moment
the input gradient leaves changes. Memory grows a little: from I to W the stage keeps the
output gradient of each linear layer for one micro-batch (llama-default, 8 sequences of 128
tokens: about 20 MB of peak RSS). It is not a zero-bubble schedule: those also move the Ws
later.

Which backwards. Splitting is not free (the split backward costs a few per cent of the
micro-batch's F + B, ``SPLIT_OVERHEAD``), and a gradient that arrives while its consumer
is still busy gains nothing. So the choice is made by replay (``early_grads`` says how it
searches): only a B whose consumer waited for it, idle, is a candidate, and the splits
kept are those that shorten the replayed step. The decision uses the papers' unit costs
plus the overhead (or the costs given), so every rank derives the same schedule from the
same inputs without measuring anything. With unit costs: 1F1B gains one W per step on
p = 2 and 33 -> 30 on p = 4, m = 8; interleaved 1F1B (v = 2) one W on p = 2; naive one W
per rank; GPipe only where few micro-batches make the chain of splits pay (p = 2, m = 4);
the zero-bubble family has no B left to split.
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.execution import Costs, Event, replay
from pipetrain.schedules.schedule import Schedule

__all__ = ["SPLIT_OVERHEAD", "decision_costs", "early_grads", "early_splits", "split_backwards"]

# What splitting one micro-batch's backward adds, as a share of its F + B: its forward and
# backward run every linear layer through a custom autograd function (runtime/stage.py).
# Measured on llama-default's stages, one CPU thread, micro-batches of 8 and 2 sequences:
# 3.8% and 6.1% (F +1.5 and +1.4 ms, I + W over B +4.1 and +1.4 ms).
SPLIT_OVERHEAD = 0.05
_EPS = 1e-9
# Replays one search may run: the search ends there (the same on every rank).
_MOST_REPLAYS = 400


def decision_costs(overhead: float = SPLIT_OVERHEAD) -> Costs:
    """Unit costs (F = 1, B = 2) with the split's overhead on I (two thirds: the slower
    forward runs on the same rank before it) and W (one third)."""
    extra = 3.0 * overhead  # of F + B = 3
    return Costs(
        forward=1.0,
        backward=2.0,
        backward_input=1.0 + 2.0 * extra / 3.0,
        backward_weight=1.0 + extra / 3.0,
    )


def split_backwards(schedule: Schedule, chosen: frozenset[Action]) -> Schedule:
    """``schedule`` with each B in ``chosen`` replaced by its I and W, in its place."""
    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        for action in row:
            if action in chosen:
                out.append(Action(action.stage, Kind.I, action.microbatch))
                out.append(Action(action.stage, Kind.W, action.microbatch))
            else:
                out.append(action)
        rows.append(tuple(out))
    return replace(schedule, actions=tuple(rows))


def _makespan(schedule: Schedule, costs: Costs) -> float:
    return replay(schedule, costs).makespan


def _awaited(schedule: Schedule, costs: Costs, events: tuple[Event, ...]) -> list[Action]:
    """The Bs whose input gradient a rank waited for, idle, on another rank, in the
    replay ``events`` of ``schedule``; latest first."""
    placement = schedule.placement
    by_action = {e.action: e for e in events}
    # Whether the rank sat idle right before each action (events come grouped by rank,
    # each rank's in program order).
    idle_before: dict[Action, bool] = {}
    previous: Event | None = None
    for event in events:
        free_at = previous.end if previous is not None and previous.rank == event.rank else 0.0
        idle_before[event.action] = event.start > free_at + _EPS
        previous = event
    found: list[tuple[float, Action]] = []
    for event in events:
        action = event.action
        if action.kind is not Kind.B or action.microbatch is None:
            continue
        prev = placement.prev_stage(action.stage)
        if prev is None or placement.rank_of(prev) == placement.rank_of(action.stage):
            continue
        for kind in (Kind.B, Kind.I):
            consumer = by_action.get(Action(prev, kind, action.microbatch))
            if consumer is None or not idle_before[consumer.action]:
                continue
            if abs(consumer.start - (event.end + costs.transfer())) <= _EPS:
                found.append((consumer.start, action))
    return [action for _, action in sorted(found, key=lambda item: -item[0])]


def early_grads(
    schedule: Schedule, costs: Costs | None = None, patience: int | None = None
) -> Schedule:
    """``schedule`` with the awaited backwards split where that shortens the step.

    Takes a compute-only schedule (lower the result); asynchronous schedules (their Bs
    are followed by weight updates) and schedules with nothing to gain come back as they
    are. ``costs``: the durations to decide with (default ``decision_costs()``).

    The search splits, one at a time, the awaited B whose consumer starts last, and keeps
    the shortest step seen. A split may gain nothing alone and pay off with the next ones
    (interleaved 1F1B's cool-down alternates a rank's stages; 1F1B's on many ranks runs
    down a diagonal), so up to ``patience`` splits in a row may gain nothing (default: two
    per stage), then the splits the best step does not need are undone. Within such a run
    a stage takes at most its rank's stages + 1 splits: that leaves out GPipe's chain,
    where the ranks go in lockstep and every B of a stage must split for one W, which
    measured did not pay (p = 2, m = 4, all four split: the same wall time as whole Bs and
    4.6% more CPU over 48 paired steps).
    """
    if schedule.asynchronous or schedule.is_lowered:
        return schedule
    costs = costs or decision_costs()
    patience = 2 * schedule.placement.num_stages if patience is None else patience
    per_stage = schedule.placement.stages_per_rank + 1
    chosen: frozenset[Action] = frozenset()
    current, idle = schedule, 0
    idle_on: dict[int, int] = {}  # stage -> its splits since the last gain
    timeline = replay(current, costs)
    best, best_chosen = timeline.makespan, chosen
    gained_nothing: list[Action] = []  # splits that did not shorten the step when made
    replays = 1
    while idle < patience and replays < _MOST_REPLAYS:
        options = [
            a
            for a in _awaited(current, costs, timeline.events)
            if a not in chosen and idle_on.get(a.stage, 0) < per_stage
        ]
        if not options:
            break
        pick = options[0]
        chosen = chosen | {pick}
        current = split_backwards(schedule, chosen)
        timeline = replay(current, costs)
        replays += 1
        if timeline.makespan < best - _EPS:
            best, best_chosen, idle = timeline.makespan, chosen, 0
            idle_on.clear()
        else:
            gained_nothing.append(pick)
            idle += 1
            idle_on[pick.stage] = idle_on.get(pick.stage, 0) + 1
    for action in (a for a in gained_nothing if a in best_chosen):
        trial = best_chosen - {action}
        span = _makespan(split_backwards(schedule, trial), costs)
        if span <= best + _EPS:
            best, best_chosen = min(best, span), trial
    return split_backwards(schedule, best_chosen) if best_chosen else schedule


def early_splits(plain: Schedule, early: Schedule) -> list[str]:
    """The backwards that ``early`` splits and ``plain`` runs whole, as text (``1I7``)."""
    before = {a for row in plain.actions for a in row if a.kind is Kind.I}
    return [str(a) for row in early.actions for a in row if a.kind is Kind.I and a not in before]
