"""simulate() on hand-written schedules: timing from the replay, accounting from metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_sim_metrics import GPIPE_2_2, ONE_F_ONE_B_2_2

from pipetrain.errors import InputError
from pipetrain.schedules.actions import parse_action
from pipetrain.schedules.execution import Costs
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule, ScheduleError
from pipetrain.sim.simulator import scale_costs, simulate


def schedule(name: str, placement: Placement, m: int, rows: list[str], **kw: bool) -> Schedule:
    actions = [[parse_action(t) for t in row.split()] for row in rows]
    return Schedule.build(name, placement, m, actions, **kw)


GPIPE = schedule("gpipe", Placement.linear(2), 2, ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"])
ONE_F_ONE_B = schedule("1f1b", Placement.linear(2), 2, ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"])


def test_replayed_timelines_match_the_hand_worked_ones() -> None:
    assert set(simulate(GPIPE).timeline.events) == set(GPIPE_2_2.events)
    assert set(simulate(ONE_F_ONE_B).timeline.events) == set(ONE_F_ONE_B_2_2.events)


def test_result_fields_and_json() -> None:
    r = simulate(ONE_F_ONE_B)
    assert (r.schedule, r.num_ranks, r.microbatches, r.chunks) == ("1f1b", 2, 2, 1)
    assert r.makespan == 9
    assert r.busy == (6, 6)
    assert r.idle == (3, 3)
    assert r.span_idle == (3, 0)
    assert r.peak_activations == (2, 1)
    assert r.weight_versions == (1, 1)
    assert r.peak_activation_bytes is None and r.weight_bytes is None
    out = json.loads(json.dumps(r.to_json()))
    assert out["bubble"] == {
        "idle_fraction": pytest.approx(1 / 3),
        "over_ideal": pytest.approx(1 / 2),
        "per_rank_span": pytest.approx(1 / 3),
        "per_rank_span_time": 3.0,
        "idle_time": 3.0,
    }
    assert out["peak_activations"] == [2, 1]


def test_per_stage_costs_and_bytes() -> None:
    # Stage 1 twice as slow: rank 0 waits longer; bytes weigh the live micro-batches.
    costs = Costs(forward=(1.0, 2.0), backward=(2.0, 4.0))
    r = simulate(ONE_F_ONE_B, costs, activation_bytes=(100.0, 10.0), weight_bytes=[5.0, 7.0])
    # 1F0 1-3, 1B0 3-7, 1F1 7-9, 1B1 9-13; 0B0 7-9, 0B1 13-15.
    assert r.makespan == 15
    assert r.busy == (6, 12)
    assert r.peak_activation_bytes == (200.0, 10.0)
    assert r.weight_bytes == (5.0, 7.0)


def test_bytes_per_stage_must_match_the_model_stages() -> None:
    with pytest.raises(
        InputError, match=r"activation_bytes: give one number or one per model stage \(2\), got 3"
    ):
        simulate(GPIPE, activation_bytes=[1.0, 2.0, 3.0])


def test_latency_delays_every_cross_rank_edge() -> None:
    r = simulate(GPIPE, Costs(latency=0.5))
    # Forward: 1F0 at 1.5, 1F1 at 2.5-3.5; backward 1B0 3.5-5.5, 1B1 5.5-7.5; 0B0 at 6.
    assert r.makespan == pytest.approx(10.0)
    assert r.busy == (6, 6)


def test_batch_scale_multiplies_compute_and_activations() -> None:
    naive = schedule("naive", Placement.linear(2), 1, ["0F0 0B0", "1F0 1B0"])
    r = simulate(naive, batch_scale=4)
    assert r.makespan == 4 * (1 + 1 + 2 + 2)
    assert r.microbatches == 4
    assert r.peak_activations == (4, 4)
    assert r.bubble.idle_fraction == pytest.approx(1 / 2)  # (p-1)/p
    assert scale_costs(Costs(forward=(1.0, 3.0)), 2).forward == (2.0, 6.0)


def test_weight_versions_with_steps() -> None:
    pipedream = schedule(
        "pipedream",
        Placement.linear(2),
        3,
        [
            "0F0 0F1 0B0 0STEP0 0F2 0B1 0STEP1 0B2 0STEP2",
            "1F0 1B0 1STEP0 1F1 1B1 1STEP1 1F2 1B2 1STEP2",
        ],
        asynchronous=True,
    )
    r = simulate(pipedream, weight_bytes=10.0)
    assert r.weight_versions == (2, 1)
    assert r.weight_bytes == (20.0, 10.0)


def test_a_deadlock_is_a_schedule_error() -> None:
    bad = schedule("bad", Placement.linear(2), 1, ["0B0 0F0", "1F0 1B0"])
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(bad)


def test_the_simulator_and_its_command_import_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, pipetrain.sim, pipetrain.cli.simulate; "
        "bad = [m for m in ('torch', 'matplotlib') if m in sys.modules]; "
        "sys.exit(', '.join(bad) or None)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
