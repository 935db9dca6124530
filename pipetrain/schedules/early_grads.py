"""Early input gradients: a backward that another rank waits for runs as I, then W.

``B(s, k)`` computes two things: the gradient of the stage's input, which ``prev(s)``
needs, and the gradient of the stage's weights, which nothing else in the step needs.
Where ``prev(s)`` lives on another rank that sits idle until that input gradient arrives,
running ``I(s, k)``, sending, then ``W(s, k)`` at once lets that rank start a W earlier.
1F1B's cool-down is the case: rank r waits for the last micro-batches' gradients of
rank r + 1. With p = 2, m = 4 and unit costs (F = 1, B = 2, I = W = 1;
``pipetrain.schedules.grid.format_timeline``)::

    1f1b          rank 0 | 0F0 0F1 .   .   0B0 0B0 0F2 0B1 0B1 0F3 0B2 0B2 .   0B3 0B3
                  rank 1 | .   1F0 1B0 1B0 1F1 1B1 1B1 1F2 1B2 1B2 1F3 1B3 1B3
    early grads   rank 0 | 0F0 0F1 .   .   0B0 0B0 0F2 0B1 0B1 0F3 0B2 0B2 0B3 0B3
                  rank 1 | .   1F0 1B0 1B0 1F1 1B1 1B1 1F2 1B2 1B2 1F3 1I3 1W3

Each rank keeps its order of F, B and I; a W stays right after its I or moves to the end
of the rank where that shortens the step without raising the rank's peak of live
micro-batches. Which backwards split is decided by replay with unit costs plus
``SPLIT_OVERHEAD``, so every rank derives the same schedule without measuring anything.
Why, what it gains and costs (measured), and how the search runs: docs/early_grads.md.
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.execution import Costs, Event, replay
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = [
    "SPLIT_OVERHEAD",
    "decision_costs",
    "early_grads",
    "early_splits",
    "live_peaks",
    "split_backwards",
]

# What splitting one micro-batch's backward adds, as a share of its F + B: its linear
# layers defer their weight products (runtime/stage.py). Measured on llama-default's
# stages, one CPU thread, 8 sequences: 1.8-3.5% by the hook the runtime uses where it may,
# 4.2-6.8% through the custom function (checkpointing, autocast, compile). 5% is charged,
# the function's case; the hook's lower cost would let a few more splits pay (not retuned).
SPLIT_OVERHEAD = 0.05
_EPS = 1e-9
# Replays one search may run: the search ends there (the same on every rank).
_MOST_REPLAYS = 400
_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)


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


def split_backwards(
    schedule: Schedule, chosen: frozenset[Action], deferred: frozenset[Action] = frozenset()
) -> Schedule:
    """``schedule`` with each B in ``chosen`` replaced by its I and W, in its place; the W
    of a B also in ``deferred`` moves to the end of its rank's compute, in the order of the
    Is (before the first all-reduce or step that follows, where there is one)."""
    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        held: list[Action] = []
        for action in row:
            if action.kind not in _COMPUTE and held:
                out.extend(held)
                held = []
            if action in chosen:
                out.append(Action(action.stage, Kind.I, action.microbatch))
                weight = Action(action.stage, Kind.W, action.microbatch)
                (held if action in deferred else out).append(weight)
            else:
                out.append(action)
        rows.append(tuple(out + held))
    return replace(schedule, actions=tuple(rows))


def live_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most micro-batches whose activations it holds at once: one from its F
    until its B, or its W where the backward is split (a W that waits still needs the
    inputs of its weight products). A rank runs its row in order, so the row alone gives it,
    without a replay: ``pipetrain.sim.metrics.peak_activations`` of any replay of the
    schedule says the same (tests/unit/test_early_grads.py checks it)."""
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for action in row:
            if action.kind is Kind.F:
                live += 1
                peak = max(peak, live)
            elif action.kind in (Kind.B, Kind.W):
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


def _makespan(schedule: Schedule, costs: Costs) -> float:
    return replay(schedule, costs).makespan


def _awaited(placement: Placement, costs: Costs, events: tuple[Event, ...]) -> list[Action]:
    """The Bs whose input gradient a rank waited for, idle, on another rank, in the
    replay ``events`` of a schedule on ``placement``; latest first."""
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

    The search splits, one at a time, the awaited B whose consumer starts last, its W in
    place or at the end of the rank (whichever replays shorter, in place on a tie, and
    the end only within the rank's peak of live micro-batches), and keeps the shortest
    step seen. A split may gain nothing alone and pay off with the next ones (1F1B's
    cool-down on many ranks runs down a diagonal), so up to ``patience`` splits in a row
    may gain nothing (default: two per stage); then the splits the best step does not need
    are undone, and the moves of Ws it does not need. Within such a run a stage takes at
    most its rank's stages + 1 splits: that leaves out chains where every B of a stage
    must split for one W (measured not to pay: docs/early_grads.md).
    """
    if schedule.asynchronous or schedule.is_lowered:
        return schedule
    costs = costs or decision_costs()
    patience = 2 * schedule.placement.num_stages if patience is None else patience
    per_stage = schedule.placement.stages_per_rank + 1
    peaks = live_peaks(schedule)
    chosen: frozenset[Action] = frozenset()
    deferred: frozenset[Action] = frozenset()
    idle = 0
    idle_on: dict[int, int] = {}  # stage -> its splits since the last gain
    timeline = replay(schedule, costs)
    best, best_chosen, best_deferred = timeline.makespan, chosen, deferred
    gained_nothing: list[Action] = []  # splits that did not shorten the step when made
    replays = 1
    while idle < patience and replays < _MOST_REPLAYS:
        options = [
            a
            for a in _awaited(schedule.placement, costs, timeline.events)
            if a not in chosen and idle_on.get(a.stage, 0) < per_stage
        ]
        if not options:
            break
        pick = options[0]
        chosen = chosen | {pick}
        # Its W in place, or at the end of the rank where that holds no more micro-batches
        # at once than the schedule did: the shorter step wins, in place on a tie (its
        # weight products leave memory sooner).
        trials = []
        for later in (deferred, deferred | {pick}):
            candidate = split_backwards(schedule, chosen, later)
            if later is not deferred and not _fits(live_peaks(candidate), peaks):
                continue
            trials.append((replay(candidate, costs), later))
            replays += 1
        shortest = min(t.makespan for t, _ in trials)
        timeline, deferred = next((t, d) for t, d in trials if t.makespan <= shortest + _EPS)
        if timeline.makespan < best - _EPS:
            best, best_chosen, best_deferred, idle = timeline.makespan, chosen, deferred, 0
            idle_on.clear()
        else:
            gained_nothing.append(pick)
            idle += 1
            idle_on[pick.stage] = idle_on.get(pick.stage, 0) + 1
    # Undo what the best step does not need: splits that gained nothing, then deferrals.
    for action in (a for a in gained_nothing if a in best_chosen):
        trial, trial_deferred = best_chosen - {action}, best_deferred - {action}
        span = _makespan(split_backwards(schedule, trial, trial_deferred), costs)
        if span <= best + _EPS:
            best, best_chosen, best_deferred = min(best, span), trial, trial_deferred
    for action in sorted(best_deferred, key=lambda a: (a.stage, a.microbatch or 0)):
        trial_deferred = best_deferred - {action}
        span = _makespan(split_backwards(schedule, best_chosen, trial_deferred), costs)
        if span <= best + _EPS:
            best, best_deferred = min(best, span), trial_deferred
    if not best_chosen:
        return schedule
    return split_backwards(schedule, best_chosen, best_deferred)


def _fits(peaks: tuple[int, ...], limits: tuple[int, ...]) -> bool:
    return all(peak <= limit for peak, limit in zip(peaks, limits, strict=True))


def early_splits(plain: Schedule, early: Schedule) -> list[str]:
    """The backwards that ``early`` splits and ``plain`` runs whole, as text: ``1I7``, or
    ``1I0 with 1W0 at the end`` where the W moved."""
    before = {a for row in plain.actions for a in row if a.kind is Kind.I}
    out = []
    for row in early.actions:
        for k, action in enumerate(row):
            if action.kind is not Kind.I or action in before:
                continue
            weight = Action(action.stage, Kind.W, action.microbatch)
            in_place = k + 1 < len(row) and row[k + 1] == weight
            out.append(str(action) if in_place else f"{action} with {weight} at the end")
    return out
