"""Early input gradients: which backwards split, what that saves, what it keeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Action, Kind, Schedule
from pipetrain.schedules.early_grads import (
    decision_costs,
    early_grads,
    early_splits,
    live_peaks,
    split_backwards,
)
from pipetrain.schedules.execution import Costs, replay
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.registry import SCHEDULE_NAMES, build_schedule, fitting
from pipetrain.schedules.validate import validate


def span(schedule: Schedule, costs: Costs | None = None) -> float:
    return replay(schedule, costs or Costs()).makespan


def splits(schedule: Schedule) -> set[str]:
    return {str(a) for row in schedule.actions for a in row if a.kind is Kind.I}


def merged(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Each rank's program with every I, W pair of a micro-batch put back as its B."""
    rows = []
    for row in schedule.actions:
        out = []
        for action in row:
            if action.kind is Kind.I:
                out.append(Action(action.stage, Kind.B, action.microbatch))
            elif action.kind is not Kind.W:
                out.append(action)
        rows.append(tuple(out))
    return tuple(rows)


def test_1f1b_p2_splits_only_the_last_backward_of_the_last_stage():
    plain = build_schedule("1f1b", 2, 4)
    early = early_grads(plain)
    assert splits(early) == {"1I3"}
    assert [str(a) for a in early.actions[1][-3:]] == ["1F3", "1I3", "1W3"]
    assert early.actions[0] == plain.actions[0]
    # Unit costs: rank 0's last B starts a W (one unit) earlier.
    assert span(plain) == 15 and span(early) == 14
    assert span(early, decision_costs()) == pytest.approx(14.1)


def test_1f1b_p4_splits_its_cool_down():
    early = early_grads(build_schedule("1f1b", 4, 8))
    assert splits(early) == {"1I5", "1I6", "1I7", "2I6", "2I7", "3I7"}
    assert span(early) == 30  # from (m + p - 1) (F + B) = 33


def test_naive_sends_each_input_gradient_before_the_weight_gradient():
    early = early_grads(build_schedule("naive", 4, 1))
    assert splits(early) == {"1I0", "2I0", "3I0"}
    assert span(early) == 9  # from 12: each of ranks 2, 1, 0 starts its backward a W early


def test_interleaved_p2_splits_the_last_backward_of_stage_3_and_moves_its_w_last():
    # Rank 0's last backwards (2B7, 0B6, 0B7) wait in turn for 3B7, 1B6 and 1B7. With 3W7
    # in place, rank 0 would next wait for 1B6 (three splits were needed for one W); with
    # 3W7 after 1B7, 1B6 and 1B7 come a W sooner whole.
    plain = build_schedule("interleaved-1f1b", 2, 8)
    early = early_grads(plain)
    assert splits(early) == {"3I7"}
    assert [str(a) for a in early.actions[1][-5:]] == ["3F7", "3I7", "1B6", "1B7", "3W7"]
    assert early.actions[0] == plain.actions[0]
    assert span(plain) == 51 and span(early) == 50
    assert early_splits(plain, early) == ["3I7 with 3W7 at the end"]


@pytest.mark.parametrize("m", [4, 8, 16])
def test_gpipe_splits_the_first_backward_of_rank_1_and_moves_its_w_last(m):
    # GPipe's ranks run their Bs in lockstep: rank 0 waits only for the first, 1B0. Its
    # W in place would delay 1B1 as much as the I saves; at the end of rank 1, which
    # finishes a B before rank 0 anyway, it delays nothing. Measured p = 2, m = 4 against
    # whole Bs: wall 1.039 (1.006-1.073, 40 paired steps), the replay's 970 -> 934 ms.
    plain = build_schedule("gpipe", 2, m)
    early = early_grads(plain)
    assert splits(early) == {"1I0"}
    assert early.actions[1][m] == Action(1, Kind.I, 0)
    assert early.actions[1][-1] == Action(1, Kind.W, 0)
    assert span(plain) == 3 * m + 3 and span(early) == 3 * m + 2
    # Its peak of live micro-batches is GPipe's own: all m, from the last F to the first B.
    assert live_peaks(early) == live_peaks(plain) == (m, m)


def test_a_w_moves_last_only_where_the_rank_holds_no_more_micro_batches():
    # 1F1B's steady state holds p - r micro-batches on rank r; a W moved out of it would
    # hold one more, so the search keeps 1F1B's Ws in place (its gains are in place too).
    for p, m in ((2, 4), (4, 8), (8, 16)):
        plain = build_schedule("1f1b", p, m)
        early = early_grads(plain)
        assert live_peaks(early) == live_peaks(plain)
        assert all(" with " not in text for text in early_splits(plain, early))


@pytest.mark.parametrize(
    ("name", "p", "m", "before", "after"),
    [
        ("gpipe", 4, 8, 33, 30),
        ("interleaved-1f1b", 4, 8, 57, 55),
        ("interleaved-1f1b", 8, 16, 117, 113),
        ("looped-bfs", 2, 4, 27, 26),
    ],
)
def test_moving_ws_last_shortens_more_schedules(name, p, m, before, after):
    plain = build_schedule(name, p, m)
    early = early_grads(plain)
    assert (span(plain), span(early)) == (before, after)
    assert live_peaks(early) == live_peaks(plain)


@pytest.mark.parametrize(
    ("name", "p", "m"),
    [
        ("zb-h1", 4, 8),
        ("zb-v", 2, 4),
        ("chimera", 2, 8),
        ("pipedream", 2, 4),
    ],
)
def test_schedules_with_nothing_to_gain_come_back_unchanged(name, p, m):
    # The zero-bubble family has split them already; an asynchronous one is left alone.
    plain = build_schedule(name, p, m)
    assert early_grads(plain).actions == plain.actions


def test_the_search_is_bounded_on_long_pipelines():
    import time

    for name in ("1f1b", "interleaved-1f1b"):
        plain = build_schedule(name, 8, 16)
        start = time.perf_counter()
        early = early_grads(plain)
        assert time.perf_counter() - start < 30  # under 0.5 s here; at most _MOST_REPLAYS
        assert span(early, decision_costs()) <= span(plain, decision_costs())
    assert span(early_grads(build_schedule("1f1b", 8, 16))) == 63  # from 69


def test_a_split_whose_input_gradient_comes_no_sooner_is_not_made():
    plain = build_schedule("1f1b", 2, 4)
    # The split's overhead on W lies off the critical path, but an I as long as B gains nothing.
    dear = Costs(forward=1.0, backward=2.0, backward_input=2.0, backward_weight=0.5)
    assert early_grads(plain, dear).actions == plain.actions
    cheap = Costs(forward=1.0, backward=2.0, backward_input=1.9, backward_weight=1.0)
    assert splits(early_grads(plain, cheap)) == {"1I3"}


def test_a_lowered_schedule_is_left_as_it_is():
    lowered = lower(build_schedule("1f1b", 2, 4))
    assert early_grads(lowered) is lowered


def test_split_backwards_keeps_each_b_in_its_place():
    plain = build_schedule("1f1b", 2, 2)
    chosen = frozenset({Action(1, Kind.B, 0)})
    early = split_backwards(plain, chosen)
    assert [str(a) for a in early.actions[1]] == ["1F0", "1I0", "1W0", "1F1", "1B1"]
    assert (early.name, early.placement, early.microbatches) == (
        plain.name,
        plain.placement,
        plain.microbatches,
    )


def test_a_deferred_w_goes_last_but_before_the_all_reduce_that_follows():
    plain = build_schedule("chimera", 2, 4)
    row = plain.actions[0]
    backwards = [a for a in row if a.kind is Kind.B]
    first, last = backwards[0], backwards[-1]
    early = split_backwards(plain, frozenset({first, last}), deferred=frozenset({first}))
    out = list(early.actions[0])
    weight = Action(first.stage, Kind.W, first.microbatch)
    k = out.index(weight)
    # After every compute action of the rank, ahead of its all-reduces.
    assert all(a.kind is Kind.ALLREDUCE for a in out[k + 1 :]) and out[k + 1 :]
    assert all(a.kind is not Kind.ALLREDUCE for a in out[:k])
    # The W of a B not deferred stays right after its I.
    i = out.index(Action(last.stage, Kind.I, last.microbatch))
    assert out[i + 1] == Action(last.stage, Kind.W, last.microbatch)
    validate(early)


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(min_value=2, max_value=5),
    m=st.integers(min_value=1, max_value=10),
    pick=st.integers(min_value=0, max_value=len(SCHEDULE_NAMES) - 1),
)
def test_the_result_is_valid_never_slower_and_does_the_same_work_in_the_same_order(p, m, pick):
    # The same order of F, B and I (a W may move to the end of its rank), at no higher
    # peak of live micro-batches on any rank.
    names = fitting(p, m)
    if not names:
        return
    plain = build_schedule(names[pick % len(names)], p, m)
    early = early_grads(plain)
    validate(early)
    validate(lower(early))
    assert merged(early) == merged(plain)
    assert all(a <= b for a, b in zip(live_peaks(early), live_peaks(plain), strict=True))
    costs = decision_costs()
    assert span(early, costs) <= span(plain, costs) + 1e-9
    if early.actions != plain.actions:
        assert span(early, costs) < span(plain, costs)


@pytest.mark.parametrize(
    ("name", "p", "m"),
    [
        ("gpipe", 2, 4),
        ("1f1b", 4, 8),
        ("interleaved-1f1b", 4, 8),
        ("zb-h2", 4, 8),
        ("chimera", 4, 4),
    ],
)
def test_live_peaks_agree_with_the_simulators_peak_activations(name, p, m):
    from pipetrain.sim.metrics import peak_activations

    for schedule in (build_schedule(name, p, m), early_grads(build_schedule(name, p, m))):
        for costs in (Costs(), decision_costs()):
            assert live_peaks(schedule) == peak_activations(replay(schedule, costs))
