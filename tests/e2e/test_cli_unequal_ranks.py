"""``--rank-speed`` and ``--rank-memory`` end to end: ``plan`` gives a slow or small rank
fewer layers and shows the split for equal ranks beside it, ``simulate`` runs a slow rank
slower and checks each rank's peak; bad values are one line and exit status 2."""

from __future__ import annotations

import json

import pytest
from cli_errors import one_line_error

from pipetrain.cli import main

pytestmark = pytest.mark.e2e

PLAN = ["plan", "--model", "llama-default", "--pp", "4"]


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_gives_a_slow_rank_fewer_layers(capsys: pytest.CaptureFixture[str]) -> None:
    even = _json(PLAN, capsys)
    out = _json([*PLAN, "--rank-speed", "1,1,0.5,1"], capsys)
    layers = [len(s["layers"]) for s in out["stages"]]
    effect = out["unequal_ranks"]
    assert effect["layers"] == layers
    assert effect["equal_ranks"]["layers"] == [len(s["layers"]) for s in even["stages"]]
    assert layers[2] < min(layers[r] for r in (0, 1, 3))
    # The split for equal ranks, run on these ranks, is slower than the one made for them.
    assert out["step_time"] < effect["equal_ranks"]["step_time"]
    assert out["rank_speed"] == [1, 1, 0.5, 1]
    assert main([*PLAN, "--rank-speed", "1,1,0.5,1"]) == 0
    text = capsys.readouterr().out
    assert "unequal ranks (speed 1,1,0.5,1):" in text
    assert "  split for equal ranks: layers " in text


def test_plan_gives_a_small_rank_fewer_layers(capsys: pytest.CaptureFixture[str]) -> None:
    even = _json(PLAN, capsys)
    need = even["ranks"][0]["peak_bytes"]  # 1F1B: rank 0 holds the most
    small = f"{int(need * 0.8)},8GiB,8GiB,8GiB"
    out = _json([*PLAN, "--rank-memory", small], capsys)
    assert out["ranks"][0]["peak_bytes"] <= need * 0.8
    assert len(out["stages"][0]["layers"]) < len(even["stages"][0]["layers"])
    assert out["unequal_ranks"]["equal_ranks"]["fits"] is False
    assert main([*PLAN, "--rank-memory", small]) == 0
    assert "(rank 0 needs " in capsys.readouterr().out


def test_simulate_runs_each_rank_at_its_speed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]
    assert _json(argv, capsys)["makespan"] == 33
    assert _json([*argv, "--rank-speed", "1,1,0.5,1"], capsys)["makespan"] == 55
    # Activations of 1e9 bytes per rank's share and micro-batch: 1F1B's rank 0 holds 4.
    out = _json(
        [*argv, "--activation-bytes", "1e9", "--rank-memory", "3GiB,8GiB,8GiB,8GiB"], capsys
    )
    assert [r["fits"] for r in out["rank_memory"]] == [False, True, True, True]
    # V-Min holds (p+4)//3 = 2 stage-equivalents: it fits where 1F1B does not.
    v_min = ["simulate", "--schedule", "v-min", "--pp", "4", "--microbatches", "8"]
    out = _json(
        [*v_min, "--activation-bytes", "1e9", "--rank-memory", "3GiB,3GiB,3GiB,3GiB"], capsys
    )
    assert all(r["fits"] for r in out["rank_memory"])


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--rank-speed", "1,1,1"], "--rank-speed '1,1,1' gives 3 values for --pp 4"),
        (["--rank-speed", "1,-1,1,1"], "'-1' is not a speed > 0"),
        (["--rank-speed", "1,1,x,1"], "'x' is not a speed > 0"),
        (["--rank-memory", "8GiB,8GiB"], "--rank-memory '8GiB,8GiB' gives 2 values"),
        (["--rank-memory", "8GiB,0,8GiB,8GiB"], "'0' is not a size"),
        (["--rank-memory", "1,1,1,1"], "raise --rank-memory"),
        (
            ["--rank-memory", "8GiB,8GiB,8GiB,8GiB", "--memory-limit", "8GiB"],
            "give one of them",
        ),
    ],
)
def test_bad_rank_values_are_one_line(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert words in one_line_error([*PLAN, *flags], capsys)


def test_simulate_refuses_bad_rank_values_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--schedule", "zb-v", "--pp", "2", "--microbatches", "4"]
    assert "gives 3 values for --pp 2" in one_line_error([*argv, "--rank-speed", "1,1,1"], capsys)
    line = one_line_error([*argv, "--rank-memory", "1GiB,1GiB"], capsys)
    assert "--rank-memory needs --activation-bytes" in line
