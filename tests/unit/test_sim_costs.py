"""Cost text and the spreading of a rank's share over a schedule's stages; any subset of
B, I and W describes one backward, and one that does not add up is refused."""

from __future__ import annotations

import pytest

from pipetrain.schedules import registry
from pipetrain.schedules.execution import Costs
from pipetrain.sim.costs import CostsError, parse_costs, stage_costs, stage_share


def test_defaults_are_the_unit_costs() -> None:
    assert parse_costs("") == Costs()


def test_full_text_and_communication() -> None:
    c = parse_costs(
        " f=1.5, B=3 ,I=1, W=2,ALLREDUCE=0.5,step=0.25",
        latency=0.1,
        bandwidth=4.0,
        message_bytes=2.0,
    )
    assert (c.forward, c.backward, c.backward_input, c.backward_weight) == (1.5, 3.0, 1.0, 2.0)
    assert (c.allreduce, c.step) == (0.5, 0.25)
    assert c.transfer() == pytest.approx(0.1 + 2.0 / 4.0)


def test_b_alone_splits_evenly_and_i_w_alone_add_up() -> None:
    c = parse_costs("B=3")
    assert (c.backward_input, c.backward_weight) == (1.5, 1.5)
    c = parse_costs("I=1/2,W=0.5")
    assert c.backward == (1.5, 2.5)
    c = parse_costs("B=4/2")
    assert c.backward_input == (2.0, 1.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("F", "write KEY=NUMBER pairs"),
        ("Q=1", "keys F, B, I, W, ALLREDUCE, STEP"),
        ("F=x", "'x' is not a number"),
        ("F=-1", "finite and >= 0"),
        ("F=inf", "finite and >= 0"),
        ("F=1,F=2", "F is given twice"),
        ("STEP=1/2", "STEP takes one number"),
        ("I=1/2,W=1/2/3", "different numbers of stages"),
    ],
)
def test_bad_text_is_one_line_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(CostsError, match="--costs") as info:
        parse_costs(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"latency": -1.0}, "--latency"),
        ({"bandwidth": 0.0}, "--bandwidth"),
        ({"message_bytes": float("nan")}, "--message-bytes"),
    ],
)
def test_bad_communication_numbers(kwargs: dict[str, float], flag: str) -> None:
    with pytest.raises(CostsError, match=flag):
        parse_costs("", **kwargs)


def test_a_rank_share_is_spread_over_the_stages_of_a_rank() -> None:
    linear = registry.build_schedule("1f1b", 4, 4)
    looped = registry.build_schedule("interleaved-1f1b", 4, 4, 4)
    v_shape = registry.build_schedule("zb-v", 4, 4)
    chimera = registry.build_schedule("chimera", 4, 4)
    assert [stage_share(s) for s in (linear, looped, v_shape, chimera)] == [1, 0.25, 0.5, 1]
    c = Costs(forward=2.0, backward=(4.0,) * 8, latency=1.0, allreduce=3.0)
    spread = stage_costs(c, v_shape)
    assert spread.forward == 1.0
    assert spread.backward_input == 0.5
    # Per-stage numbers are each stage's own; communication is not a share of the model.
    assert spread.backward == (4.0,) * 8
    assert (spread.latency, spread.allreduce) == (1.0, 3.0)
    assert stage_costs(Costs(forward=2.0), chimera).forward == 2.0
    assert stage_costs(Costs(), linear) == Costs()


def test_per_stage_numbers_must_match_the_model_stages() -> None:
    with pytest.raises(CostsError, match="3 numbers for 4 model stages of 1f1b"):
        stage_costs(Costs(forward=(1.0, 1.0, 1.0)), registry.build_schedule("1f1b", 4, 4))


@pytest.mark.parametrize(
    ("text", "b", "i", "w"),
    [
        ("B=4,W=0.5", 4.0, 3.5, 0.5),
        ("B=4,I=3", 4.0, 3.0, 1.0),
        ("I=2", 3.0, 2.0, 1.0),
        ("W=0.5", 1.5, 1.0, 0.5),
        ("B=3,I=1,W=2", 3.0, 1.0, 2.0),
        ("B=4/2,I=1", (4.0, 2.0), 1.0, (3.0, 1.0)),
    ],
)
def test_any_subset_of_b_i_w_describes_one_backward(
    text: str, b: object, i: object, w: object
) -> None:
    # A split-backward schedule (I, W) and a plain one (B) are compared on one model only
    # when B = I + W: "B=4,W=0.5" once left I at 1 and ZB-H1 looked twice as fast as 1F1B.
    c = parse_costs(text)
    assert (c.backward, c.backward_input, c.backward_weight) == (b, i, w)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("B=4,I=1,W=1", "B must equal I + W"),
        ("B=2,I=3", "I is longer than B"),
        ("B=1/1,W=0.5/2", "W is longer than B"),
        ("B=1/1,I=1/1/1", "B and I give different numbers of stages"),
    ],
)
def test_a_backward_that_does_not_add_up_is_refused(text: str, expected: str) -> None:
    with pytest.raises(CostsError, match="--costs") as info:
        parse_costs(text)
    assert expected in str(info.value) and "\n" not in str(info.value)
