"""The runtime across processes (gloo): one launch per world size runs every schedule.

Launching costs seconds and a step on llama-tiny milliseconds, so each world size is one
launch (a module fixture) and the tests read its per-rank reports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from runtime_launch import launch

pytestmark = pytest.mark.dist

RTOL = 1e-5
SCHEDULES = (
    "naive",
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "looped-bfs",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "dualpipe-v",
    "v-half",
    "v-min",
    "chimera",
)


def run_equal(world: int, tmp: Path) -> list[dict[str, dict[str, object]]]:
    result = launch(world, ["equal", str(tmp)])
    assert result.returncodes == (0,) * world, "\n".join(result.stderr)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_equal(2, tmp_path_factory.mktemp("runtime2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_equal(4, tmp_path_factory.mktemp("runtime4"))


def check_one_step(reports, name: str) -> None:
    for rank, report in enumerate(reports):
        res = report[name]
        assert res["loss_rel"] < RTOL, (rank, res)
        assert res["grad_rel"] < RTOL, (rank, res)
        assert res["params"] > 0
        # Same bits as the single-process debug mode, loss included.
        assert res["bitwise"] and res["loss_bitwise"], (rank, res)
        assert res["events"] == res["actions"]


# Early input gradients (pipetrain.schedules.early_grads) of the schedules they change
# at these sizes (the worker adds every one that changes; the test names are fixed).
# The schedules that early input gradients change (some with a W moved to the end).
EARLY_2 = ("naive-early", "gpipe-early", "1f1b-early", "interleaved-1f1b-early", "looped-bfs-early")
EARLY_4 = (*EARLY_2, "chimera-early")


@pytest.mark.parametrize("name", (*SCHEDULES, *EARLY_2, "user-csv"))
def test_two_ranks_equal_one_process(two, name):
    check_one_step(two, name)


def test_early_variants_are_the_ones_named(two, four):
    for reports, names in ((two, EARLY_2), (four, EARLY_4)):
        for report in reports:
            assert sorted(k for k in report if k.endswith("-early")) == sorted(names)


@pytest.mark.parametrize("name", (*SCHEDULES, *EARLY_4))
def test_four_ranks_equal_one_process(four, name):
    check_one_step(four, name)


@pytest.mark.parametrize("name", ("1f1b", "interleaved-1f1b", "chimera"))
def test_two_pipelines_side_by_side(four, name):
    check_one_step(four, "pair-" + name)


@pytest.mark.parametrize("case", ("sequence-change", "sequence-change-unpacked"))
def test_sequence_length_changes_between_steps(two, case):
    for report in two:
        assert report[case]["loss_rel"] < RTOL
        assert report[case]["grad_rel"] < RTOL


@pytest.mark.parametrize("name", ("1f1b", "zb-v", "chimera"))
def test_accumulated_steps_equal_one_process(two, name):
    for rank, report in enumerate(two):
        res = report[f"accumulate-{name}"]
        assert res["grad_rel"] < RTOL, (rank, res)
        assert res["bitwise"], (rank, res)  # the same bits as the debug mode


@pytest.mark.parametrize(
    "name",
    (
        "adamw-zb-h1",
        "adamw-chimera",
        "wire-zb-v-v2",
        "wire-dualpipe-v-v2",
        "wire-interleaved-1f1b-v2",
        "wire-interleaved-1f1b-v3",
        "wire-one-stream-zb-v-v2",
        "wire-one-stream-dualpipe-v-v2",
        "wire-one-stream-interleaved-1f1b-v2",
        "wire-one-stream-interleaved-1f1b-v3",
    ),
)
def test_adamw_steps_equal_one_process(two, name):
    for report in two:
        res = report[name]
        assert res["params_bitwise"] and res["loss_bitwise"], res
        assert res["loss_rel"] < RTOL, res
        # AdamW divides by sqrt(v): 1e-7 gradient noise moves parameters by a few 1e-6.
        assert res["param_abs"] < 2e-5, res


def test_a_killed_rank_stops_every_other_rank(tmp_path):
    result = launch(3, ["kill", str(tmp_path)], timeout_s=180.0)
    killed_at = float((tmp_path / "killed_at").read_text())
    assert result.returncodes[1] != 0
    for rank in (0, 2):
        assert result.returncodes[rank] == 1, result.stderr[rank]
        assert result.exited_at[rank] - killed_at < 60, result
        assert re.search(r"training step 2, .*peer rank 1 was lost", result.stderr[rank]), (
            result.stderr[rank]
        )


def test_a_stalled_rank_times_out_with_an_error_naming_it(tmp_path):
    result = launch(2, ["stall", str(tmp_path)], timeout_s=90.0)
    assert result.returncodes[0] == 1, result.stderr[0]
    assert re.search(
        r"rank 0: .*training step 2, .*peer rank 1 did not answer within 3 s", result.stderr[0]
    ), result.stderr[0]
