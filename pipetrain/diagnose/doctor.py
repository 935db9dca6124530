"""The hang doctor's analysis: who waits for whom, and who holds everyone up.

Pure (no torch, no runtime): it reads the report that ``pipetrain.runtime.hang`` collects
through the rendezvous store when a wait times out or a rank gets SIGUSR1, and that
``pipetrain doctor RUN_DIR`` reads back from ``<run dir>/doctor.json``::

    {"id": 1, "reason": "...", "collector": 0, "time": 1733.0, "window_s": 3.0,
     "ranks": {"0": STATE, "1": null, ...},      # null: posted nothing in the window
     "last_seen": {"1": STATE, ...}}             # a silent rank's last heartbeat

A STATE is one rank's own account (``pipetrain.runtime.hang.snapshot``): ``state``
(waiting, computing, outside, failed), the ``action`` in progress or last ended and
``for_s`` seconds since, ``waits_on`` (the global rank whose message it waits for),
``message``, ``where`` (the step), ``frame`` (the innermost pipetrain function of its main
thread), ``error`` (its failure, if it failed), ``recent`` (its last actions as [action,
seconds since start, seconds since end or null]), ``age_s`` (seconds between the state
and the collection).

Each rank waits on at most one other, so the wait-for graph is a set of chains: each
chain ends at a rank that is not waiting (computing, outside the pipeline's actions,
silent or dead: the culprit) or runs into a cycle (a deadlock).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Blame", "Diagnosis", "RankView", "blame", "diagnose", "format_report", "rank_views"]

# States in which a rank waits on a peer's message (its edge of the graph).
_WAITING = ("waiting", "failed")
# What a peer's error says when the connection to the rank it waited on was closed.
_LOST = ("was lost", "were lost", "closed", "reset by peer")


@dataclass(frozen=True)
class RankView:
    """One rank as the report sees it; ``state`` "silent" when it posted nothing."""

    rank: int
    state: str
    action: str = ""
    for_s: float | None = None
    waits_on: int | None = None
    message: str = ""
    where: str = ""
    frame: str = ""
    error: str = ""
    last_seen_s: float | None = None  # silent: seconds since its last heartbeat
    last_state: str = ""  # silent: what that heartbeat said it was doing


@dataclass(frozen=True)
class Culprit:
    """A rank that others wait on (directly or down a chain) and that is not waiting."""

    rank: int
    waited_by: tuple[int, ...]


@dataclass(frozen=True)
class Diagnosis:
    ranks: tuple[RankView, ...]
    edges: tuple[tuple[int, int], ...]  # (waiting rank, rank it waits on)
    cycles: tuple[tuple[int, ...], ...]
    culprits: tuple[Culprit, ...]
    verdict: tuple[str, ...]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _view(rank: int, state: Mapping[str, Any] | None, seen: Mapping[str, Any] | None) -> RankView:
    if state is None:
        last_seen = None
        last_state = ""
        if seen is not None:
            last_seen = _number(seen.get("age_s"))
            last_state = _doing(_view(rank, seen, None))
        return RankView(rank, "silent", last_seen_s=last_seen, last_state=last_state)
    waits_on = state.get("waits_on")
    return RankView(
        rank=rank,
        state=str(state.get("state", "outside")),
        action=str(state.get("action") or ""),
        for_s=_number(state.get("for_s")),
        waits_on=int(waits_on) if isinstance(waits_on, int) else None,
        message=str(state.get("message") or ""),
        where=str(state.get("where") or ""),
        frame=str(state.get("frame") or ""),
        error=str(state.get("error") or ""),
    )


def rank_views(report: Mapping[str, Any]) -> tuple[RankView, ...]:
    """Every rank of the report, in rank order."""
    ranks: Mapping[str, Any] = report.get("ranks", {})
    seen: Mapping[str, Any] = report.get("last_seen", {})
    return tuple(_view(int(r), ranks[r], seen.get(r)) for r in sorted(ranks, key=lambda r: int(r)))


def diagnose(report: Mapping[str, Any]) -> Diagnosis:
    """The wait-for graph of a report, its cycles, its culprits and the verdict in words."""
    views = rank_views(report)
    by_rank = {v.rank: v for v in views}
    edges = tuple(
        (v.rank, v.waits_on)
        for v in views
        if v.state in _WAITING and v.waits_on is not None and v.waits_on != v.rank
    )
    nxt = dict(edges)
    ends: dict[int, int] = {}  # waiting rank -> the non-waiting rank its chain ends at
    cycles: list[tuple[int, ...]] = []
    for start in nxt:
        path = [start]
        while path[-1] in nxt and nxt[path[-1]] not in path:
            path.append(nxt[path[-1]])
        last = path[-1]
        if last in nxt:  # the next one is on the path: a cycle
            cycle = tuple(path[path.index(nxt[last]) :])
            key = tuple(sorted(cycle))
            if all(tuple(sorted(c)) != key for c in cycles):
                cycles.append(_rotate(cycle))
        else:
            ends[start] = last
    culprits = tuple(
        Culprit(end, tuple(sorted(r for r, e in ends.items() if e == end)))
        for end in sorted(set(ends.values()))
    )
    verdict = [_culprit_line(by_rank.get(c.rank, RankView(c.rank, "silent")), c, views)
               for c in culprits]  # fmt: skip
    verdict += [_cycle_line(cycle, by_rank) for cycle in cycles]
    if not verdict:
        verdict.append(_quiet_line(views))
    return Diagnosis(views, edges, tuple(cycles), culprits, tuple(verdict))


@dataclass(frozen=True)
class Blame:
    """The rank a launcher's last line names, and why in words."""

    rank: int
    text: str


def blame(report: Mapping[str, Any]) -> Blame | None:
    """The rank that stopped answering first, for the launcher's last line; None when the
    report names none (a deadlock, or nothing stuck).

    Of the silent ranks, the one heard from longest ago: once a rank stops, its peers
    time out, fail and exit one after the other, and a report collected after some of
    them exited finds those silent too, but heard from more recently. With no silent
    rank, the first rank that others wait on (computing, or outside the actions)."""
    d = diagnose(report)
    silent = [v for v in d.ranks if v.state == "silent"]
    if silent:
        first = max(silent, key=lambda v: -1.0 if v.last_seen_s is None else v.last_seen_s)
        seen = (
            f" for {_seconds(first.last_seen_s)}; last seen {first.last_state}"
            if first.last_seen_s is not None
            else ""
        )
        return Blame(
            first.rank,
            f"rank {first.rank} stopped answering first (the hang doctor heard nothing from "
            f"it{seen})",
        )
    if not d.culprits:
        return None
    culprit = d.culprits[0]
    view = next(v for v in d.ranks if v.rank == culprit.rank)
    return Blame(
        culprit.rank,
        f"rank {culprit.rank} held the others up (the hang doctor: it was {_doing(view)}; "
        f"{_ranks(culprit.waited_by)} waited on it)",
    )


def _rotate(cycle: tuple[int, ...]) -> tuple[int, ...]:
    """A cycle starting at its lowest rank, so that one cycle has one spelling."""
    i = cycle.index(min(cycle))
    return cycle[i:] + cycle[:i]


def _ranks(ranks: Sequence[int]) -> str:
    names = [str(r) for r in ranks]
    words = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"rank {words}" if len(names) == 1 else f"ranks {words}"


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g} s" if value < 10 else f"{value:.0f} s"


def _doing(v: RankView) -> str:
    """What a rank was doing, in a few words."""
    if v.state == "computing":
        return f"in {v.action} for {_seconds(v.for_s)}"
    if v.state in _WAITING and v.action:
        return f"waiting in {v.action} for {_seconds(v.for_s)}"
    if v.action:
        where = f" in {v.frame}" if v.frame else ""
        return f"outside the pipeline's actions{where}, {_seconds(v.for_s)} after {v.action} ended"
    return f"outside the pipeline's actions{f' in {v.frame}' if v.frame else ''}"


def _culprit_line(v: RankView, culprit: Culprit, views: Sequence[RankView]) -> str:
    waiters = _ranks(culprit.waited_by)
    verb = "waits" if len(culprit.waited_by) == 1 else "wait"
    tail = f"; {waiters} {verb} on it"
    if v.state == "silent":
        seen = (
            f"; last seen {_seconds(v.last_seen_s)} ago, {v.last_state}"
            if v.last_seen_s is not None
            else ""
        )
        lost = any(w.waits_on == v.rank and any(s in w.error for s in _LOST) for w in views)
        if lost:
            return f"rank {v.rank} is dead: its peers lost the connection to it{seen}{tail}"
        return (
            f"rank {v.rank} is silent: it posted no state (stopped, e.g. by SIGSTOP, hung "
            f"outside Python, or dead){seen}{tail}"
        )
    if v.state == "computing":
        return (
            f"rank {v.rank} is not waiting: it has been in {v.action} for {_seconds(v.for_s)}{tail}"
        )
    return f"rank {v.rank} is not waiting on a pipeline message: it is {_doing(v)}{tail}"


def _cycle_line(cycle: tuple[int, ...], by_rank: Mapping[int, RankView]) -> str:
    who = "wait on each other" if len(cycle) == 2 else "wait in a cycle"
    loop = " -> ".join(f"rank {r}" for r in (*cycle, cycle[0]))
    parts = []
    for r in cycle:
        v = by_rank[r]
        what = f" for {v.message}" if v.message else ""
        parts.append(f"rank {r} waits in {v.action or '?'}{what}")
    return (
        f"{_ranks(sorted(cycle))} {who} ({loop}): a deadlock in the order of their messages, "
        f"not a slow rank: {'; '.join(parts)}"
    )


def _quiet_line(views: Sequence[RankView]) -> str:
    silent = [v.rank for v in views if v.state == "silent"]
    if silent:
        return f"no rank waits on another; {_ranks(silent)} posted no state"
    return "no rank waits on another's message: nothing is stuck in the pipeline"


# ----------------------------------------------------------------------------- text


def format_report(report: Mapping[str, Any]) -> str:
    """The wait-for table, the graph and the verdict, as lines for a terminal."""
    d = diagnose(report)
    head = (
        f"hang doctor, report {report.get('id', '?')}: {report.get('reason', '')} "
        f"(collected by rank {report.get('collector', '?')}, {len(d.ranks)} ranks)"
    )
    rows = [("rank", "state", "action", "for", "waits on", "what / where")]
    for v in d.ranks:
        if v.state == "silent":
            last = (
                f"last seen {_seconds(v.last_seen_s)} ago, {v.last_state}" if v.last_state else ""
            )
            rows.append((str(v.rank), "silent", "-", "-", "-", last))
            continue
        what = v.message or (f"{v.where}, in {v.frame}" if v.frame else v.where)
        rows.append(
            (
                str(v.rank),
                v.state,
                v.action or "-",
                _seconds(v.for_s) if v.for_s is not None else "-",
                "-" if v.waits_on is None else f"rank {v.waits_on}",
                what,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [head]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  " + "  ".join([*cells, row[5]]).rstrip())
    lines.append("wait-for graph:")
    if not d.edges:
        lines.append("  (no rank waits on another)")
    for waiter, peer in d.edges:
        lines.append(f"  rank {waiter} -> rank {peer}")
    for line in d.verdict:
        lines.append(f"verdict: {line}")
    errors = [(v.rank, v.error) for v in d.ranks if v.error]
    for rank, error in errors:
        lines.append(f"rank {rank}'s error: {error.splitlines()[0]}")
    return "\n".join(lines)
