"""A timeline's makespan when its processes share fewer cores than there are of them.

On a CPU the run's processes are time-sliced over the machine's cores. Its costs are
profiled with every process busy at once, so each process ran at ``cores / processes``
of a core; in a real step, while some ranks wait in the pipeline's bubble, the busy ones
get the idle ones' share (up to a whole core each). Measured here (llama-default, four
processes on two cores): 1F1B over four stages ran 10-17% faster than its replay at the
profiled speed, layouts without a bubble 10-20% slower than the bubble-heavy ones were
predicted against them.

The model is processor sharing: at each instant the busy processes split the cores
evenly. Every busy process then progresses at the same rate, so the real timeline is the
replayed one with time itself stretched or shrunk segment by segment (the order of events
and every dependency are kept): a segment of the replay with n processes busy takes
``speed(processes) / speed(n)`` of its length, where ``speed(n) = min(1, cores / n)``.
Exact under that model; what it leaves out (caches and memory bandwidth shared unevenly,
the operating system's own scheduling) is in docs/plan_auto.md.
"""

from __future__ import annotations

from pipetrain.schedules.events import Timeline

__all__ = ["shared_core_makespan", "shared_speedup_limit"]


def _speed(busy: float, cores: float) -> float:
    return min(1.0, cores / busy) if busy > 0 else 1.0


def shared_speedup_limit(processes: int, cores: float) -> float:
    """The most a segment can shrink: the profiled speed over one process's full core."""
    return _speed(processes, cores)


def shared_core_makespan(
    timeline: Timeline, *, processes_per_rank: int, processes: int, cores: float
) -> float:
    """``timeline``'s makespan when each of its ranks stands for ``processes_per_rank``
    processes that run alike (data- and tensor-parallel peers), all ``processes`` share
    ``cores`` cores, and its durations were measured with every process busy.

    Sends and receives take no core (the replay's convention); a segment where nothing
    computes (a message in flight) keeps its length.
    """
    if processes <= cores or not timeline.events:
        return timeline.makespan
    profiled = _speed(processes, cores)
    # +1 where a piece of work starts, -1 where it ends; sweep the boundaries in order.
    changes: dict[float, int] = {}
    for e in timeline.events:
        if e.action.is_comm or e.end <= e.start:
            continue
        changes[e.start] = changes.get(e.start, 0) + 1
        changes[e.end] = changes.get(e.end, 0) - 1
    origin = min(e.start for e in timeline.events)
    end = max(e.end for e in timeline.events)
    total, busy, last = 0.0, 0, origin
    for time in sorted(changes):
        ratio = profiled / _speed(busy * processes_per_rank, cores) if busy else 1.0
        total += (time - last) * ratio
        busy += changes[time]
        last = time
    return total + (end - last)
