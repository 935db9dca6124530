"""Early input gradients: which backwards split, what that saves, what it keeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Action, Kind, Schedule
from pipetrain.schedules.early_grads import decision_costs, early_grads, split_backwards
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


def test_interleaved_p2_splits_the_cool_down_of_both_stages_of_rank_1():
    # Rank 0's last backwards (2B3, 0B2, 0B3) wait in turn for 3B3, 1B2 and 1B3: splitting
    # 3B3 alone gains nothing (rank 0 then waits for 1B2), the three together one W.
    plain = build_schedule("interleaved-1f1b", 2, 8)
    early = early_grads(plain)
    assert splits(early) == {"3I7", "1I6", "1I7"}
    assert span(plain) == 51 and span(early) == 50


def test_gpipe_keeps_its_backwards_whole():
    # GPipe's ranks run their Bs in lockstep: only every B of rank 1 split together would
    # let rank 0 finish a W earlier, at m splits' overhead (measured: no gain, more CPU),
    # and the search allows a stage only a few splits in a row that gain nothing.
    for m in (4, 8, 16):
        plain = build_schedule("gpipe", 2, m)
        assert early_grads(plain).actions == plain.actions
    chain = split_backwards(
        build_schedule("gpipe", 2, 4), frozenset(Action(1, Kind.B, k) for k in range(4))
    )
    assert span(chain) == 14  # what the whole chain would give with free splits


@pytest.mark.parametrize(
    ("name", "p", "m"),
    [
        ("gpipe", 2, 16),
        ("gpipe", 4, 8),
        ("interleaved-1f1b", 4, 8),
        ("looped-bfs", 2, 4),
        ("zb-h1", 4, 8),
        ("zb-v", 2, 4),
        ("chimera", 2, 8),
        ("pipedream", 2, 4),
    ],
)
def test_schedules_with_nothing_to_gain_come_back_unchanged(name, p, m):
    # GPipe's chain of splits costs more than it saves past a few micro-batches; the
    # zero-bubble family has split them already; an asynchronous one is left alone.
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


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(min_value=2, max_value=5),
    m=st.integers(min_value=1, max_value=10),
    pick=st.integers(min_value=0, max_value=len(SCHEDULE_NAMES) - 1),
)
def test_the_result_is_valid_never_slower_and_does_the_same_work_in_the_same_order(p, m, pick):
    names = fitting(p, m)
    if not names:
        return
    plain = build_schedule(names[pick % len(names)], p, m)
    early = early_grads(plain)
    validate(early)
    validate(lower(early))
    assert merged(early) == merged(plain)
    costs = decision_costs()
    assert span(early, costs) <= span(plain, costs) + 1e-9
    if early.actions != plain.actions:
        assert span(early, costs) < span(plain, costs)
