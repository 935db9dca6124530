"""`pipetrain plan --auto --measure 2 --out x.toml` trains its two fastest layouts, keeps
the faster measured one and writes a config that `pipetrain train --config x.toml` runs
unchanged (2 processes); the run's summary prints the predicted and measured model memory
per process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_records import read_records, train_run

pytestmark = pytest.mark.e2e


def test_plan_auto_writes_a_config_that_trains(work: Path) -> None:
    config = work / "auto.toml"
    planned = subprocess.run(
        [
            sys.executable, "-m", "pipetrain.cli", "plan", "--auto", "--model", "llama-tiny",
            "--world-size", "2", "--batch-size", "8", "--seq-len", "16", "--out", str(config),
            "--measure", "2", "--measure-steps", "2",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert "winner:" in planned.stdout and config.exists()
    rows = [line for line in planned.stdout.splitlines() if line[:3] in (" 1 ", " 2 ")]
    measured = rows[-2:]  # the predicted table's rows come first
    assert all("failed" not in row and "MiB" in row for row in measured), planned.stdout
    # The config written is the measured winner: the faster of the two measured rows.
    speeds = [float(row.split()[-5].replace(",", "")) for row in measured]
    layout = measured[speeds.index(max(speeds))].split()[1:4]  # schedule pp=.. dp=..
    text = config.read_text()
    assert f'schedule = "{layout[0]}"' in text and f"pp = {layout[1][3:]}" in text, text
    result = train_run(
        work, "auto", "--config", str(config), "--steps", "2", "--data", str(work / "data"),
        "--set", "optim.warmup_steps=0", "--set", "run.evaluate=false",
        "--set", "run.sample_tokens=0", "--set", "data.max_bytes=100000",
    )  # fmt: skip
    assert "model memory per process (MiB): predicted" in result.stdout
    records = read_records(work / "auto")
    check = next(r for r in records if r.get("memory_check"))
    assert len(check["measured_peak"]) == 2 and len(check["predicted_peak"]) == 2
    assert all(b > 0 for b in check["predicted_peak"])


def test_plan_auto_profiles_every_microbatch_size_on_as_many_processes() -> None:
    planned = subprocess.run(
        [
            sys.executable, "-m", "pipetrain.cli", "plan", "--auto", "--model", "llama-tiny",
            "--world-size", "2", "--batch-size", "4", "--seq-len", "16", "--balance", "profile",
            "--repeats", "1", "--calibrate-steps", "3", "--calibrate-runs", "2",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    # batch 4 over dp 1 or 2 and 1..4 micro-batches: sizes 1, 2 and 4, each measured.
    assert "measured on cpu at micro-batch 1,2,4 x 16, 2 processes at once" in planned.stdout
    # The curve's shape, a sample through the whole model at each size, for checking.
    shape = planned.stdout.split("; the whole model ")[1].split(" ms a sample")[0]
    assert len([float(ms) for ms in shape.split(", ")]) == 3, shape
    # tp 2 layouts exist at every size: a step sharded over the 2 processes timed at each.
    said = planned.stdout.split("tp 2 measured: a step ")[1].split(";")[0]
    assert "x the tp 1 step at micro-batch 1, " in said and "x at 2, " in said, said
    assert said.rstrip().endswith("x at 4"), said
    # One real run of the reference layout scales the profile's compute.
    assert "calibrated by 1f1b pp=1 dp=2 tp=1 m=1: predicted " in planned.stdout
    assert "over 3 steps (median of 2 runs); " in planned.stdout
    assert "compute x " in planned.stdout and " at micro-batch 2" in planned.stdout
    # A pipelined reference with more actions a process prices an action.
    assert "; by interleaved-1f1b v=2 pp=2 dp=1 tp=1 m=2: predicted " in planned.stdout
    assert "each action (F, B, I or W) " in planned.stdout
    # 2 samples a replica, under 16: a pipeline of one micro-batch of 4 sets that size.
    assert "; by gpipe pp=2 dp=1 tp=1 m=1: predicted " in planned.stdout
    assert " at micro-batch 4" in planned.stdout.split("compute x ")[1].split(";")[0]
    # ... and the bytes its processes held beyond the profile's step enter every layout.
    assert "MiB a process (the profile's step: " in planned.stdout
    assert "winner:" in planned.stdout


def test_an_expert_parallel_layout_of_plan_auto_trains_from_its_config(work: Path) -> None:
    # The fastest ep 2 layout that plan --auto ranks for a MoE model, written as --out
    # writes it, trains unchanged with its experts sharded over the 2 processes.
    from pipetrain.cli.plan_auto import HARDWARE, _write
    from pipetrain.models.config import get_model_config
    from pipetrain.partition.auto import AutoRequest, search
    from pipetrain.partition.estimate import estimate_costs

    model = get_model_config("moe-tiny")

    def costs(tp: int, mb: int = 1):
        return estimate_costs(model, 16, flops_per_second=HARDWARE["cpu"].flops, tp=tp)

    plan = search(model, AutoRequest(2, 4, 16, top=60), costs, HARDWARE["cpu"])
    chosen = next(s for s in plan.ranked if s.layout.ep == 2)
    config = work / "auto-ep.toml"
    _write(config, "moe-tiny", chosen, plan.request)
    assert "ep = 2" in config.read_text()
    train_run(
        work, "auto-ep", "--config", str(config), "--steps", "2", "--data", str(work / "data"),
        "--set", "optim.warmup_steps=0", "--set", "run.evaluate=false",
        "--set", "run.sample_tokens=0", "--set", "data.max_bytes=100000",
    )  # fmt: skip
    losses = [r["loss"] for r in read_records(work / "auto-ep") if "loss" in r]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
