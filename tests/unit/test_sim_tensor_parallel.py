"""`pipetrain simulate --tp`: the tp collectives' time on every F, B and I of a schedule."""

from __future__ import annotations

import json

import pytest

from pipetrain.cli import main
from pipetrain.schedules.execution import Costs
from pipetrain.sim.tensor_parallel import with_tp_time

ONE_F_ONE_B = "--schedule 1f1b --pp 4 --microbatches 8 --costs F=0.05,B=0.1"


def _simulate(capsys: pytest.CaptureFixture[str], flags: str) -> tuple[int, str, str]:
    code = main(["simulate", *flags.split()])
    out, err = capsys.readouterr()
    return code, out, err


def test_tp_time_lengthens_1f1b_as_the_formula_says(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ONE_F_ONE_B + " --tp 8 --tp-bytes 2.1e9 --tp-bandwidth 1.5e11 --json"
    code, out, _ = _simulate(capsys, flags)
    assert code == 0
    result = json.loads(out)
    # One all-reduce of 2.1e9 bytes over 8 ranks: 2 * 7/8 * 2.1e9 / 1.5e11 = 0.0245 per F
    # and per B. 1F1B's makespan with equal stages is (m + p - 1) (F + B) = 11 * 0.199.
    assert result["tensor_parallel"]["time_per_forward"] == pytest.approx(0.0245)
    assert result["tensor_parallel"]["traffic_per_microbatch"] == pytest.approx(2 * 1.75 * 2.1e9)
    assert result["makespan"] == pytest.approx(11 * (0.05 + 0.1 + 2 * 0.0245))


def test_tp_without_bandwidth_changes_no_time(capsys: pytest.CaptureFixture[str]) -> None:
    _, plain, _ = _simulate(capsys, ONE_F_ONE_B + " --json")
    _, tp, _ = _simulate(capsys, ONE_F_ONE_B + " --tp 4 --tp-bytes 1e9 --json")
    assert json.loads(tp)["makespan"] == json.loads(plain)["makespan"]


@pytest.mark.parametrize(
    "extra, words",
    [
        ("--tp-bytes 5", "need --tp 2"),
        ("--tp 0", "--tp 0"),
        ("--tp 2 --tp-bytes -1", "--tp-bytes"),
        ("--tp 2 --tp-bytes 1e6 --tp-bandwidth 0", "--tp-bandwidth"),
    ],
)
def test_bad_tp_flags_are_one_line(
    capsys: pytest.CaptureFixture[str], extra: str, words: str
) -> None:
    code, out, err = _simulate(capsys, f"{ONE_F_ONE_B} {extra}")
    assert code == 2 and not out
    assert err.count("\n") == 1 and words in err


def test_per_stage_costs_get_their_stage_share() -> None:
    costs = with_tp_time(Costs(forward=(1.0, 2.0), backward=3.0, backward_input=1.5), 0.4, 0.5)
    assert costs.forward == (1.2, 2.2)
    assert costs.backward == pytest.approx(3.4)
    assert costs.backward_input == pytest.approx(1.9)
    assert costs.backward_weight == 1.0  # W has no collective
