"""The expert-parallel all-to-all costs (pipetrain.sim.expert_parallel) and simulate --ep."""

from __future__ import annotations

import json

import pytest

from pipetrain.cli import main
from pipetrain.sim.costs import parse_costs
from pipetrain.sim.expert_parallel import (
    ExpertParallelError,
    alltoall_bytes,
    ep_sent,
    ep_time,
    with_ep_time,
)


def test_a_rank_sends_the_assignments_routed_to_the_other_ranks() -> None:
    # 4096 tokens, top-2, C = 4096, fp32, ep = 8: 7/8 of 4096 x 2 x 4096 x 4 bytes.
    assert alltoall_bytes(4096, 2, 4096, 8) == 117_440_512
    assert alltoall_bytes(4096, 2, 4096, 8, number_bytes=2) == 58_720_256  # bf16
    assert alltoall_bytes(100, 8, 64, 1) == 0.0  # every expert on this rank: nothing sent
    assert ep_sent(1000.0, 4) == 750.0


def test_time_is_bytes_over_bandwidth_and_none_without_a_bandwidth() -> None:
    assert ep_time(2, 750.0, 1e3) == pytest.approx(1.5)
    assert ep_time(2, 750.0, None) == 0.0
    assert ep_time(0, 750.0, 1e3) == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: alltoall_bytes(10, 2, 8, 0),
        lambda: alltoall_bytes(float("nan"), 2, 8, 2),
        lambda: ep_sent(-1.0, 2),
        lambda: ep_time(2, 10.0, 0.0),
        lambda: ep_time(2, float("inf"), 1.0),
    ],
)
def test_nonsense_sizes_are_refused_in_one_line(call: object) -> None:
    with pytest.raises(ExpertParallelError) as caught:
        call()  # type: ignore[operator]
    assert "\n" not in str(caught.value)


def test_the_all_to_alls_lengthen_f_b_and_i_but_not_w() -> None:
    costs = parse_costs("F=1,I=1,W=1")
    timed = with_ep_time(costs, 0.5, 1.0)
    assert (timed.forward, timed.backward, timed.backward_input) == (1.5, 2.5, 1.5)
    assert timed.backward_weight == costs.backward_weight
    # Per-stage costs each get their stage's share of the rank's all-to-alls.
    staged = with_ep_time(parse_costs("F=1/2,B=2/2"), 1.0, 0.5)
    assert staged.forward == (1.5, 2.5) and staged.backward == (2.5, 2.5)


def test_simulate_ep_adds_the_all_to_alls_to_every_pass(capsys: pytest.CaptureFixture[str]) -> None:
    flags = "simulate --schedule 1f1b --pp 2 --microbatches 4 --json"
    ep = "--ep 4 --ep-bytes 1e6 --moe-layers 3 --ep-bandwidth 1e6"
    assert main([*flags.split(), *ep.split()]) == 0
    out = json.loads(capsys.readouterr().out)
    # Each F and B waits 2 all-to-alls x 3 layers x 750000 B / 1e6 = 4.5: F = 5.5, B = 6.5;
    # 1F1B on 2 ranks, 4 micro-batches: (m + p - 1) (F + B) = 5 x 12 = 60.
    assert out["makespan"] == pytest.approx(60.0)
    assert out["expert_parallel"]["sent_per_layer_alltoall"] == 750_000
    assert out["expert_parallel"]["sent_per_step"] == 4 * 3 * 750_000 * 4


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ("--schedule 1f1b --ep-bytes 5", "--ep-bytes needs --ep 2 (or more)"),
        ("--schedule 1f1b --ep-bandwidth 5 --moe-layers 2", "--moe-layers and --ep-bandwidth"),
        ("--schedule 1f1b --ep 2 --ep-bandwidth 0", "--ep-bandwidth 0.0: give a finite number"),
        ("--compare --ep 2", "--dp, --shard, --tp and --ep work with --schedule"),
    ],
)
def test_simulate_ep_misuse_is_one_line_and_exit_2(
    flags: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--pp", "2", "--microbatches", "4", *flags.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
