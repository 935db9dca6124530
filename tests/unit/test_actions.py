"""Actions and placements: text forms round-trip, placements put stages where the papers do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipetrain.schedules import Action, ActionParseError, Kind, Placement, parse_action

_STEPWISE = {Kind.ALLREDUCE}


@st.composite
def actions(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(list(Kind)))
    stage = draw(st.integers(0, 200))
    mb = None if kind in _STEPWISE else draw(st.integers(0, 10_000))
    return Action(stage, kind, mb)


@given(actions())
def test_text_form_round_trips(action: Action) -> None:
    assert parse_action(str(action)) == action


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3F12", Action(3, Kind.F, 12)),
        ("0I4", Action(0, Kind.I, 4)),
        ("1W4", Action(1, Kind.W, 4)),
        ("2B0", Action(2, Kind.B, 0)),
        ("12F3", Action(12, Kind.F, 3)),
        ("0SEND_B4", Action(0, Kind.SEND_B, 4)),
        ("5RECV_F10", Action(5, Kind.RECV_F, 10)),
        ("1ALLREDUCE", Action(1, Kind.ALLREDUCE)),
        ("2STEP7", Action(2, Kind.STEP, 7)),
        (" 3 F 1 ", Action(3, Kind.F, 1)),
    ],
)
def test_parse_known_forms(text: str, expected: Action) -> None:
    assert parse_action(text) == expected


@pytest.mark.parametrize("text", ["", "F1", "3X1", "3F", "-1F0", "1ALLREDUCE2", "3F1.5", "3f1"])
def test_parse_rejects_with_the_expected_form(text: str) -> None:
    with pytest.raises(ActionParseError, match=r"'|e\.g\."):
        parse_action(text)


def test_action_constructor_rejects_missing_or_extra_microbatch() -> None:
    with pytest.raises(ValueError, match="needs a micro-batch"):
        Action(0, Kind.F)
    with pytest.raises(ValueError, match="takes no micro-batch"):
        Action(0, Kind.ALLREDUCE, 1)
    with pytest.raises(ValueError, match="stage must be"):
        Action(-1, Kind.F, 0)


def test_linear_and_looped() -> None:
    lin = Placement.linear(4)
    assert lin.stage_to_rank == (0, 1, 2, 3) and lin.replicas == 1
    looped = Placement.looped(4, 2)
    assert looped.stages_of(1) == (1, 5)
    assert looped.rank_of(6) == 2 and looped.stages_per_rank == 2
    assert looped.prev_stage(4) == 3 and looped.next_stage(7) is None


def test_v_shape_holds_r_and_2p_minus_1_minus_r() -> None:
    p = 4
    v = Placement.v_shape(p)
    for r in range(p):
        assert v.stages_of(r) == (r, 2 * p - 1 - r)
    # The turn of the V is on the last rank: stages p-1 and p neighbour on one rank.
    assert v.rank_of(p - 1) == v.rank_of(p) == p - 1


def test_bidirectional_two_replicas_in_opposite_directions() -> None:
    p = 4
    bi = Placement.bidirectional(p)
    assert bi.replicas == 2 and bi.num_model_stages == p
    for r in range(p):
        down, up = bi.stages_of(r)
        assert bi.model_stage(down) == r and bi.replica(down) == 0
        assert bi.model_stage(up) == p - 1 - r and bi.replica(up) == 1
    # Each replica is its own chain: the first stage of replica 1 has no predecessor.
    assert bi.prev_stage(p) is None and bi.next_stage(p - 1) is None
    assert bi.replicas_of(2) == (2, 6)


def test_placement_rejects_out_of_range_ranks() -> None:
    with pytest.raises(ValueError, match="outside"):
        Placement("custom", 2, (0, 1, 2), 3)
