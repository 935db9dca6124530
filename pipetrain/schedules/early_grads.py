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

Each rank keeps its order of work and its memory (the W follows its I at once, so nothing
is held longer), and the gradients are the same sums; only the moment the input gradient
leaves changes. It is not a zero-bubble schedule: those also move the Ws later.

Which backwards. Splitting is not free (the runtime's split backward costs a few per cent
more than one B, ``SPLIT_OVERHEAD``), and a gradient that arrives while its consumer is
still busy gains nothing. So the choice is made by replay: a B whose consumer waited for
it, idle, is split when that shortens the replayed step; rounds repeat until no split
helps. The decision uses the papers' unit costs plus the overhead (or the costs given), so
every rank derives the same schedule from the same inputs without measuring anything.
1F1B and naive gain (p = 2: one W per step; p = 4, m = 8: 33 -> 30.4 units), GPipe and
interleaved 1F1B keep their Bs (their consumers are busy, or every B would have to split
for any gain), the zero-bubble family has no B left to split.
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.execution import Costs, Event, replay
from pipetrain.schedules.schedule import Schedule

__all__ = ["SPLIT_OVERHEAD", "decision_costs", "early_grads", "early_splits", "split_backwards"]

# Extra time of I + W over one B, as a share of B: the split backward runs every linear
# layer through a custom autograd function (runtime/stage.py). Measured on llama-default,
# one CPU thread, micro-batches of 2-8 sequences: 3-6%; 5% is charged, half on I, half on W.
SPLIT_OVERHEAD = 0.05
_EPS = 1e-9


def decision_costs(overhead: float = SPLIT_OVERHEAD) -> Costs:
    """Unit costs (F = 1, B = 2) with I and W each carrying half of the split's overhead."""
    half = 1.0 + overhead
    return Costs(forward=1.0, backward=2.0, backward_input=half, backward_weight=half)


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
    return Schedule(
        schedule.name,
        schedule.placement,
        schedule.microbatches,
        tuple(rows),
        schedule.asynchronous,
        schedule.params,
    )


def _makespan(schedule: Schedule, costs: Costs) -> float:
    return replay(schedule, costs).makespan


def _awaited(schedule: Schedule, costs: Costs) -> list[Action]:
    """The Bs whose input gradient a rank waited for, idle, on another rank; latest first."""
    placement = schedule.placement
    events = replay(schedule, costs).events
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


def early_grads(schedule: Schedule, costs: Costs | None = None) -> Schedule:
    """``schedule`` with the awaited backwards split where that shortens the step.

    Takes a compute-only schedule (lower the result); asynchronous schedules (their Bs
    are followed by weight updates) and schedules with nothing to gain come back as they
    are. ``costs``: the durations to decide with (default ``decision_costs()``).
    """
    if schedule.asynchronous or schedule.is_lowered:
        return schedule
    costs = costs or decision_costs()
    chosen: frozenset[Action] = frozenset()
    best = _makespan(schedule, costs)
    current = schedule
    while True:
        accepted = False
        for action in _awaited(current, costs):
            trial = chosen | {action}
            candidate = split_backwards(schedule, trial)
            span = _makespan(candidate, costs)
            if span < best - _EPS:
                chosen, best, current, accepted = trial, span, candidate, True
        if not accepted:
            return current


def early_splits(plain: Schedule, early: Schedule) -> list[str]:
    """The backwards that ``early`` splits and ``plain`` runs whole, as text (``1I7``)."""
    before = {a for row in plain.actions for a in row if a.kind is Kind.I}
    return [str(a) for row in early.actions for a in row if a.kind is Kind.I and a not in before]
