"""Invariants of the accounting on every built-in schedule under random costs."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Kind, registry
from pipetrain.schedules.execution import Costs
from pipetrain.sim.metrics import live_activations
from pipetrain.sim.render import chrome_trace, text_grid
from pipetrain.sim.simulator import simulate

durations = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, int, int, int | None, Costs]:
    name = draw(st.sampled_from(registry.SCHEDULE_NAMES))
    p = draw(st.integers(1, 5))
    m = draw(st.integers(1, 12))
    v = draw(st.sampled_from([None, 2, 3]))
    f, i, w = draw(durations), draw(durations), draw(durations)
    costs = Costs(
        forward=f,
        backward=i + w,
        backward_input=i,
        backward_weight=w,
        latency=draw(st.sampled_from([0.0, 0.25])),
    )
    return name, p, m, v, costs


@settings(max_examples=60, deadline=None)
@given(cases())
def test_accounting_adds_up(case: tuple[str, int, int, int | None, Costs]) -> None:
    name, p, m, v, costs = case
    spec = registry.get_spec(name)
    assume(spec.check(p, m, v) is None)
    schedule = registry.build_schedule(name, p, m, v)
    r = simulate(schedule, costs)
    work = sum(e.duration for e in r.timeline.events if not e.action.is_comm)
    assert sum(r.busy) == pytest.approx(work)
    for rank in range(p):
        assert r.busy[rank] + r.idle[rank] == pytest.approx(r.makespan)
        assert -1e-9 <= r.span_idle[rank] <= r.idle[rank] + 1e-9
    b = r.bubble
    assert b.idle_fraction == pytest.approx(sum(r.idle) / (p * r.makespan))
    assert b.over_ideal == pytest.approx(sum(r.idle) / sum(r.busy))
    assert b.per_rank_span_time == pytest.approx(max(r.span_idle))
    assert 0 <= b.per_rank_span_fraction <= b.idle_fraction * p + 1e-9
    # Every micro-batch's activations are freed by the end; the peak is bounded by all of
    # them being live at once on every stage of the rank.
    stages = schedule.placement.stages_per_rank
    for curve in live_activations(r.timeline):
        assert curve[-1][1] == 0
    assert all(1 <= a <= schedule.microbatches * stages for a in r.peak_activations)
    assert all(w >= 1 for w in r.weight_versions)
    if not schedule.asynchronous:
        assert r.weight_versions == (1,) * p
    trace = chrome_trace(r.timeline)
    # Every compute action is a slice; communication (sends, receives, all-reduces) only
    # where it takes time: it sits on a comm track, and zero-length slices only clutter it.
    shown = [
        e
        for e in r.timeline.events
        if not (e.action.is_comm or e.action.kind is Kind.ALLREDUCE) or e.duration > 0
    ]
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(shown)
    assert len(text_grid(r.timeline, width=60).splitlines()) >= p + 2
