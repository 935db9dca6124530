"""The reference semantics of a schedule: what each action waits for, and a timed replay.

One engine serves the validator (unit costs; a stall is a deadlock), the simulator
(per-stage costs; metrics from the timeline) and the comparison with measured runs (the
runtime records the same ``Timeline`` type).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.deps import Requirement, requirements
from pipetrain.schedules.events import Event, Timeline
from pipetrain.schedules.grid import format_grid
from pipetrain.schedules.schedule import Schedule, ScheduleError

__all__ = ["Costs", "Event", "Timeline", "replay"]


def _per_stage(value: float | Sequence[float], model_stage: int) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return float(value[model_stage])


@dataclass(frozen=True)
class Costs:
    """Durations of actions, scalar for every stage or one value per model stage.

    Defaults are the papers' unit costs: F = I = W = 1, B = 2, free communication.
    """

    forward: float | tuple[float, ...] = 1.0
    backward: float | tuple[float, ...] = 2.0
    backward_input: float | tuple[float, ...] = 1.0
    backward_weight: float | tuple[float, ...] = 1.0
    # Transfer time of one message = latency + message_bytes / bandwidth (bandwidth in
    # bytes per time unit; None means infinite).
    latency: float = 0.0
    bandwidth: float | None = None
    message_bytes: float = 0.0
    allreduce: float = 0.0
    step: float = 0.0

    def compute(self, kind: Kind, model_stage: int) -> float:
        """Duration of a compute (or step-level) action on one model stage."""
        table = {
            Kind.F: self.forward,
            Kind.B: self.backward,
            Kind.I: self.backward_input,
            Kind.W: self.backward_weight,
        }
        if kind in table:
            return _per_stage(table[kind], model_stage)
        if kind is Kind.ALLREDUCE:
            return self.allreduce
        if kind is Kind.STEP:
            return self.step
        return 0.0

    def check(self, num_model_stages: int) -> None:
        """Raise ``ScheduleError`` unless every per-stage tuple has one value per model stage."""
        for name in ("forward", "backward", "backward_input", "backward_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) and len(value) != num_model_stages:
                raise ScheduleError(
                    f"costs: {name} has {len(value)} values for {num_model_stages} model stages: "
                    "give one per model stage (each of a rank's v chunks counts) or one for all"
                )

    def transfer(self) -> float:
        """Time from a send being issued to the data being available at the receiver."""
        extra = 0.0 if not self.bandwidth else self.message_bytes / self.bandwidth
        return self.latency + extra


# ----------------------------------------------------------------------------- replay
@dataclass(frozen=True)
class _Blocked:
    """Why a rank cannot run its next action: the requirement it waits for."""

    rank: int
    position: int
    action: Action
    waits_for: str


class _Replay:
    """The state of one replay. Ranks advance from a work queue: a rank that blocks on an
    action is woken when that action completes, so every action is examined a bounded
    number of times and the replay is linear in the schedule size (times the fan-in)."""

    def __init__(
        self, schedule: Schedule, costs: Costs, not_before: Mapping[Action, float]
    ) -> None:
        costs.check(schedule.placement.num_model_stages)
        self.schedule = schedule
        self.costs = costs
        self.not_before = not_before
        self.placement = schedule.placement
        self.lowered = schedule.is_lowered
        self.num_ranks = len(schedule.actions)
        # Where each action sits (its first occurrence), to resolve alternatives and to
        # say where a missing dependency is.
        self.where: dict[Action, tuple[int, int]] = {}
        for rank, pos, action in schedule.enumerate_actions():
            self.where.setdefault(action, (rank, pos))
        self.position = [0] * self.num_ranks
        self.free_at = [0.0] * self.num_ranks
        self.end: dict[Action, float] = {}
        self.events: list[list[Event]] = [[] for _ in range(self.num_ranks)]
        self.waiters: dict[Action, list[int]] = {}
        # What each action waits for, resolved once: (dependency or None for "never",
        # delay after it ends), and how long the action itself takes.
        transfer = costs.transfer()
        self.needs = [
            [
                tuple(
                    (self.resolve(req), transfer if req.transfer else 0.0)
                    for req in requirements(a, self.placement, lowered=self.lowered)
                )
                for a in row
            ]
            for row in schedule.actions
        ]
        self.duration = [
            [
                0.0
                if a.is_comm or a.stage >= self.placement.num_stages
                else costs.compute(a.kind, self.placement.model_stage(a.stage))
                for a in row
            ]
            for row in schedule.actions
        ]

    def head(self, rank: int) -> Action | None:
        if rank >= self.num_ranks:  # a placement with more ranks than rows: never arrives
            return None
        row = self.schedule.actions[rank]
        return row[self.position[rank]] if self.position[rank] < len(row) else None

    def run(self) -> Timeline:
        queue = deque(range(self.num_ranks))
        queued = set(queue)
        while queue:
            rank = queue.popleft()
            queued.discard(rank)
            for woken in self.advance(rank):
                if woken not in queued:
                    queued.add(woken)
                    queue.append(woken)
        stuck = [self.blocked(r) for r in range(self.num_ranks) if self.head(r) is not None]
        if stuck:
            raise _stall_error(self.schedule, stuck)
        return Timeline(
            self.schedule.name,
            self.num_ranks,
            tuple(e for rank_events in self.events for e in rank_events),
        )

    def advance(self, rank: int) -> list[int]:
        """Run ``rank`` as far as it can go; return the ranks to look at again."""
        woken: list[int] = []
        while (action := self.head(rank)) is not None:
            if action.kind is Kind.ALLREDUCE:
                group = self.allreduce_group(action)
                if group is None:
                    return woken
                start = max(self.free_at[r] for r in group)
                for r in group:
                    self.record(r, start, start + self.costs.allreduce)
                woken.extend(r for r in group if r != rank)
                continue
            pos = self.position[rank]
            start = max(self.free_at[rank], self.not_before.get(action, 0.0))
            for dep, delay in self.needs[rank][pos]:
                if dep is None:
                    return woken
                end = self.end.get(dep)
                if end is None:
                    self.waiters.setdefault(dep, []).append(rank)
                    return woken
                start = max(start, end + delay)
            self.record(rank, start, start + self.duration[rank][pos])
            woken.extend(self.waiters.pop(action, ()))
        return woken

    def resolve(self, req: Requirement) -> Action | None:
        """The alternative the schedule contains, else the first (which never completes);
        None when nothing can satisfy the requirement."""
        for alternative in req.alternatives:
            if alternative in self.where:
                return alternative
        return req.alternatives[0] if req.alternatives else None

    def allreduce_group(self, action: Action) -> list[int] | None:
        """The ranks of every replica of the stage, if all of them have reached it."""
        if action.stage >= self.placement.num_stages:
            return None
        group = []
        for stage in self.placement.replicas_of(self.placement.model_stage(action.stage)):
            rank = self.placement.rank_of(stage)
            if self.head(rank) != Action(stage, Kind.ALLREDUCE):
                return None
            group.append(rank)
        return group

    def record(self, rank: int, start: float, end: float) -> None:
        action = self.head(rank)
        assert action is not None
        self.events[rank].append(Event(rank, action, start, end))
        self.end.setdefault(action, end)
        self.free_at[rank] = end
        self.position[rank] += 1

    def blocked(self, rank: int) -> _Blocked:
        action = self.head(rank)
        assert action is not None
        pos = self.position[rank]
        if action.kind is Kind.ALLREDUCE:
            return _Blocked(rank, pos, action, self.describe_allreduce(action))
        for req in requirements(action, self.placement, lowered=self.lowered):
            dep = self.resolve(req)
            if dep is None:
                return _Blocked(rank, pos, action, str(req))
            if dep not in self.end:
                if dep not in self.where:
                    return _Blocked(rank, pos, action, f"{req}, which no rank runs")
                dep_rank, dep_pos = self.where[dep]
                return _Blocked(rank, pos, action, f"{dep} (rank {dep_rank}, position {dep_pos})")
        return _Blocked(rank, pos, action, "nothing it lacks (a bug in replay: please report it)")

    def describe_allreduce(self, action: Action) -> str:
        if action.stage >= self.placement.num_stages:
            return f"stage {action.stage}, which the placement does not have"
        partners = []
        for stage in self.placement.replicas_of(self.placement.model_stage(action.stage)):
            partner = Action(stage, Kind.ALLREDUCE)
            rank = self.placement.rank_of(stage)
            if self.head(rank) == partner:
                continue
            where = self.where.get(partner)
            if where is None:
                partners.append(f"{partner} on rank {rank}, which never runs it")
            else:
                partners.append(f"{partner} (rank {where[0]}, position {where[1]})")
        return "the all-reduce partner " + " and ".join(partners)


def _stall_error(schedule: Schedule, stuck: list[_Blocked]) -> ScheduleError:
    details = "; ".join(
        f"rank {b.rank} at position {b.position} ({b.action}) waits for {b.waits_for}"
        for b in stuck
    )
    grid = format_grid(schedule, {(b.rank, b.position) for b in stuck}, context=8)
    return ScheduleError(
        f"schedule {schedule.name!r} deadlocks: {details}: reorder the actions so that each "
        "one comes after what it waits for",
        grid=grid,
    )


def replay(
    schedule: Schedule,
    costs: Costs = Costs(),
    *,
    not_before: Mapping[Action, float] | None = None,
) -> Timeline:
    """Timed replay of ``schedule``: when each action starts and ends.

    Each rank runs its actions in order; an action starts when its rank is free and its
    requirements (``pipetrain.schedules.deps``) have completed, plus one transfer for each
    edge that crosses ranks. Sends and receives take no rank time: a send is issued when its
    rank reaches it, a receive ends when the data has arrived. ``ALLREDUCE(s)`` starts on all
    replicas of the model stage together, when the last of them reaches it. A stall (actions
    left, none can run) raises ``ScheduleError`` naming each stuck rank, position, action and
    what it waits for, with the grid of the schedule, stuck steps marked.

    ``not_before`` holds actions back until a time whatever else they wait for: e.g. a
    stage's first F until its sharded weights are all-gathered (``pipetrain.sim.data_parallel``).

    Events come grouped by rank, each rank's in the order it ran them.
    """
    return _Replay(schedule, costs, not_before or {}).run()
