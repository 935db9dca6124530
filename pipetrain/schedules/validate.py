"""The validator: reject a schedule that cannot run, with the step that is wrong marked.

Checks, in order (the first failure raises ``ScheduleError``):

1. shape: one row per rank; every rank holds a stage; every stage exists and sits on
   the rank that runs it; micro-batches inside ``0..microbatches-1``;
2. no action twice;
3. ``STEP`` only in asynchronous schedules; with replicas, one ``ALLREDUCE`` per stage,
   without them none;
4. coverage: each micro-batch goes through exactly one replica chain, where each stage
   runs its ``F`` and either ``B`` or both ``I`` and ``W`` (never ``B`` mixed with them);
5. messages of a lowered schedule: every send has its receive and every receive its send,
   and both sit on an edge between ranks;
6. order on a rank: nothing before what it needs on the same rank (a backward before its
   forward, ``W`` before ``I``, a send before its compute, ``ALLREDUCE`` before the last
   backward of its stage); in a lowered schedule every cross-rank edge has its receive;
7. deadlock: a replay with unit costs must run every action (``execution.replay``).

Each message is one line naming rank, position, action and the problem; ``grid`` shows the
schedule with the failing step marked.
"""

from __future__ import annotations

from collections import defaultdict

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.deps import BACKWARD_INPUT_KINDS, requirements
from pipetrain.schedules.execution import replay
from pipetrain.schedules.grid import format_grid
from pipetrain.schedules.schedule import Schedule, ScheduleError

__all__ = ["validate"]

_SENDS = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}
_BACKWARD_END_KINDS = frozenset({Kind.B, Kind.W})


def _error(
    schedule: Schedule,
    problem: str,
    at: tuple[int, int] | None = None,
    action: Action | None = None,
) -> ScheduleError:
    where = "" if at is None else f"rank {at[0]}, position {at[1]} ({action}): "
    marks = set() if at is None else {at}
    grid = format_grid(schedule, marks, context=8 if marks else None)
    return ScheduleError(f"schedule {schedule.name!r}: {where}{problem}", grid=grid)


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` if ``schedule`` cannot run (see the module docstring)."""
    _check_shape(schedule)
    where = _check_duplicates(schedule)
    _check_collectives(schedule, where)
    _check_coverage(schedule, where)
    if schedule.is_lowered:
        _check_messages(schedule, where)
    _check_order(schedule, where)
    replay(schedule)


def _check_shape(schedule: Schedule) -> None:
    placement = schedule.placement
    if len(schedule.actions) != placement.num_ranks:
        raise _error(
            schedule,
            f"{len(schedule.actions)} rows of actions for {placement.num_ranks} ranks: "
            "give exactly one row per rank",
        )
    if schedule.microbatches < 1:
        raise _error(schedule, f"microbatches is {schedule.microbatches}: it must be 1 or more")
    # A rank without a stage would be a process that only waits (a JSON file can say so; a
    # CSV cannot): the reports would count it idle, and chunks would read 0.
    if not placement.stage_to_rank:
        raise _error(schedule, "the placement holds no stage: map each stage to its rank")
    idle = sorted(set(range(placement.num_ranks)) - set(placement.stage_to_rank))
    if idle:
        raise _error(
            schedule,
            f"rank {idle[0]} holds no stage"
            + (f" ({len(idle)} ranks hold none)" if len(idle) > 1 else "")
            + f": place a stage on every rank or use pp={placement.num_ranks - len(idle)}",
        )
    for rank, pos, action in schedule.enumerate_actions():
        if action.stage >= placement.num_stages:
            raise _error(
                schedule,
                f"stage {action.stage} does not exist (the placement has stages "
                f"0..{placement.num_stages - 1}): fix the stage number",
                (rank, pos),
                action,
            )
        owner = placement.rank_of(action.stage)
        if owner != rank:
            raise _error(
                schedule,
                f"stage {action.stage} belongs to rank {owner}, and a stage cannot be on two "
                f"ranks: move {action} to rank {owner}",
                (rank, pos),
                action,
            )
        mb = action.microbatch
        if mb is not None and mb >= schedule.microbatches:
            raise _error(
                schedule,
                f"micro-batch {mb} is outside 0..{schedule.microbatches - 1}: fix the number or "
                "raise the schedule's micro-batch count",
                (rank, pos),
                action,
            )


def _check_duplicates(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Refuse any action that appears twice; return where each action is."""
    where: dict[Action, tuple[int, int]] = {}
    for rank, pos, action in schedule.enumerate_actions():
        if action in where:
            first = where[action]
            raise _error(
                schedule,
                f"duplicates {action} of rank {first[0]}, position {first[1]}: remove one",
                (rank, pos),
                action,
            )
        where[action] = (rank, pos)
    return where


def _check_collectives(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    placement = schedule.placement
    for action, at in where.items():
        if action.kind is Kind.STEP and not schedule.asynchronous:
            raise _error(
                schedule,
                "STEP in a synchronous schedule (it steps once, after the last action): "
                "remove it or mark the schedule asynchronous",
                at,
                action,
            )
    if placement.replicas < 2:
        # Nothing to sum it with: the simulator would still charge its time, and a file that
        # has one most likely meant a replicated placement (Chimera's) that it did not get.
        for action, at in where.items():
            if action.kind is Kind.ALLREDUCE:
                raise _error(
                    schedule,
                    f"stage {action.stage} has no replica whose gradients it would sum "
                    f"(placement {placement.kind!r}, one replica): remove {action}",
                    at,
                    action,
                )
        return
    for stage in range(placement.num_stages):
        action = Action(stage, Kind.ALLREDUCE)
        if action not in where:
            rank = placement.rank_of(stage)
            raise _error(
                schedule,
                f"rank {rank} never runs {action}: stage {stage} has replicas whose gradients "
                f"must be summed; add {action} after its last backward",
            )


def _check_coverage(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    placement = schedule.placement
    chains: dict[int, set[int]] = defaultdict(set)
    for action in where:
        if action.is_compute and action.microbatch is not None:
            chains[action.microbatch].add(placement.replica(action.stage))
    for mb in range(schedule.microbatches):
        replicas = sorted(chains[mb])
        if not replicas:
            raise _error(
                schedule,
                f"micro-batch {mb} never runs: add its forward and backward on every stage",
            )
        if len(replicas) > 1:
            raise _error(
                schedule,
                f"micro-batch {mb} runs in replicas {replicas} of the pipeline: each "
                "micro-batch goes through exactly one chain of stages",
            )
        first = replicas[0] * placement.num_model_stages
        for stage in range(first, first + placement.num_model_stages):
            _check_stage_coverage(schedule, where, stage, mb)


def _check_stage_coverage(
    schedule: Schedule, where: dict[Action, tuple[int, int]], stage: int, mb: int
) -> None:
    rank = schedule.placement.rank_of(stage)
    has = {kind for kind in (Kind.F, Kind.B, Kind.I, Kind.W) if Action(stage, kind, mb) in where}

    def missing(kind: Kind, what: str, fix: str) -> ScheduleError:
        action = Action(stage, kind, mb)
        return _error(
            schedule,
            f"rank {rank} never runs {action} ({what} of stage {stage}, micro-batch {mb}): {fix}",
        )

    if Kind.F not in has:
        raise missing(Kind.F, "the forward", "add it")
    if Kind.B in has and has & {Kind.I, Kind.W}:
        split = next(Action(stage, k, mb) for k in (Kind.I, Kind.W) if k in has)
        raise _error(
            schedule,
            f"mixes a full backward with {split}: use either B or I and W for one micro-batch",
            where[Action(stage, Kind.B, mb)],
            Action(stage, Kind.B, mb),
        )
    if Kind.B in has:
        return
    if Kind.I in has and Kind.W not in has:
        raise missing(Kind.W, "the weight backward", "add it after the I")
    if Kind.W in has and Kind.I not in has:
        raise missing(Kind.I, "the input backward", "add it before the W")
    if not has & {Kind.I, Kind.W}:
        raise missing(Kind.B, "the backward", "add it, or an I and a W")


def _check_order(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    """Everything an action needs from its own rank must come earlier on that rank."""
    placement = schedule.placement
    lowered = schedule.is_lowered
    last_backward: dict[int, int] = {}
    for action, (rank, pos) in where.items():
        if action.kind in _BACKWARD_END_KINDS:
            last_backward[action.stage] = max(last_backward.get(action.stage, -1), pos)
        for req in requirements(action, placement, lowered=lowered):
            found = [where[a] for a in req.alternatives if a in where]
            if not found:
                if action.kind in (Kind.RECV_F, Kind.RECV_B):
                    continue  # reported by _check_messages with its fix
                raise _error(
                    schedule,
                    f"needs {req}, which no rank runs: add it"
                    + (" (or lower the schedule again)" if lowered else ""),
                    (rank, pos),
                    action,
                )
            dep_rank, dep_pos = found[0]
            if dep_rank == rank and dep_pos > pos:
                dep = schedule.actions[dep_rank][dep_pos]
                raise _error(
                    schedule,
                    f"{_order_problem(action, dep)}: it needs {dep} (position {dep_pos}) "
                    f"earlier on the same rank; move it after {dep}",
                    (rank, pos),
                    action,
                )
    for action, (rank, pos) in where.items():
        if action.kind is Kind.ALLREDUCE and last_backward.get(action.stage, -1) > pos:
            last = schedule.actions[rank][last_backward[action.stage]]
            raise _error(
                schedule,
                f"the all-reduce comes before {last}, a backward of its stage, and would sum "
                "incomplete gradients: move it after the stage's last backward",
                (rank, pos),
                action,
            )


def _order_problem(action: Action, dep: Action) -> str:
    if action.kind in BACKWARD_INPUT_KINDS and dep.kind is Kind.F and dep.stage == action.stage:
        return "backward before its forward"
    if action.kind is Kind.W:
        return "W before its I"
    if action.kind is Kind.STEP:
        return "STEP before the backward it follows"
    if action.is_comm:
        return "send before the compute it sends"
    if dep.is_comm:
        return "compute before its receive"
    return "comes before an action it needs"


def _check_messages(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    placement = schedule.placement
    for action, at in where.items():
        if not action.is_comm or action.microbatch is None:
            continue
        s, mb = action.stage, action.microbatch
        if action.kind in _SENDS:
            peer = (
                placement.next_stage(s) if action.kind is Kind.SEND_F else placement.prev_stage(s)
            )
            match = None if peer is None else Action(peer, _SENDS[action.kind], mb)
        else:
            peer = (
                placement.prev_stage(s) if action.kind is Kind.RECV_F else placement.next_stage(s)
            )
            send = Kind.SEND_F if action.kind is Kind.RECV_F else Kind.SEND_B
            match = None if peer is None else Action(peer, send, mb)
        if peer is None or placement.rank_of(peer) == placement.rank_of(s):
            raise _error(
                schedule,
                f"{action.kind.value} on stage {s}, whose neighbour in that direction is "
                f"{'missing' if peer is None else 'on the same rank'}: remove it",
                at,
                action,
            )
        if match not in where:
            kind = (
                "send has no receive" if action.kind in _SENDS else "receive has no matching send"
            )
            raise _error(
                schedule,
                f"{kind}: add {match} to rank {placement.rank_of(peer)}",
                at,
                action,
            )
