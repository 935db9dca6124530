"""`pipetrain train --grad-report`: the report through the real launcher (2 processes), its
per-stage norms against the global one, the same losses without it; a model with an
unused and a frozen parameter (in this process, --single-process) named by the report;
the rows of tensor-parallel and FSDP2 runs equal to one process's; and the short-run
warm-up: `--steps 5` trains with a note, an explicit warm-up too long for the run is still
refused.

Four launches of 2 processes (pp=2 with and without --grad-report, tp=2, dp=2 sharded) and
three runs in this process (the unused and frozen parameters, the references of tp and
FSDP2).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_errors import one_line_error
from run_records import read_records
from torch import nn

from pipetrain.cli import main
from pipetrain.models import PipelineSpec

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

# No optim.warmup_steps: the default (10) meets a 5-step run.
TINY = [
    "--model", "llama-tiny", "--steps", "5", "--batch-size", "8", "--seq-len", "32",
    "--microbatches", "4", "--eval-every", "0", "--set", "data.max_bytes=100000",
    "--set", "run.sample_tokens=0", "--set", "data.eval_batches=1", "--set", "pipeline.threads=1",
]  # fmt: skip


def _train(out: Path, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *TINY, "--pp", "2", *flags,
        "--name", name, "--set", f"run.out_dir={json.dumps(str(out))}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _report(run: Path) -> list[dict[str, Any]]:
    lines = (run / "grad_report.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_the_report_adds_up_and_changes_no_loss(tmp_path: Path) -> None:
    reported = _train(tmp_path, "report", "--grad-report", "2")
    plain = _train(tmp_path, "plain")
    for result in (reported, plain):
        assert "note: the default warm-up of 10 steps does not fit a 5-step run" in result.stdout
    steps = [r for r in read_records(tmp_path / "report") if "loss" in r]
    assert [r["loss"] for r in steps] == [
        r["loss"] for r in read_records(tmp_path / "plain") if "loss" in r
    ]
    # Every step's metrics: each stage's norm, their squares adding up to the global norm's.
    for record in steps:
        stages = record["grad_norm_stage"]
        assert sorted(stages) == ["0", "1"]
        squares = sum(n**2 for n in stages.values())
        assert squares == pytest.approx(record["grad_norm"] ** 2, rel=1e-6)
    # Steps 1, 2 and 4: every parameter of both stages once, with its stage and global name.
    rows = _report(tmp_path / "report")
    assert sorted({r["step"] for r in rows}) == [1, 2, 4]
    first = [r for r in rows if r["step"] == 1]
    names = [r["name"] for r in first]
    assert len(names) == len(set(names)) == 39
    assert {r["stage"] for r in first if r["name"].startswith("embed.")} == {0}
    assert {r["stage"] for r in first if r["name"].startswith("head.")} == {1}
    assert not [r for r in first if r["flags"]]  # a healthy model: nothing flagged
    for step in (1, 2, 4):
        mine = [r for r in rows if r["step"] == step and r["in_norm"]]
        norm = steps[step - 1]["grad_norm"]
        assert sum(r["grad_norm"] ** 2 for r in mine) == pytest.approx(norm**2, rel=1e-6)
        for stage in (0, 1):
            by_stage = sum(r["grad_norm"] ** 2 for r in mine if r["stage"] == stage)
            want = steps[step - 1]["grad_norm_stage"][str(stage)]
            assert by_stage == pytest.approx(want**2, rel=1e-6)
    assert "gradient report, step 4: 39 parameters, 0 flagged" in reported.stdout


def _with_mistakes(spec: PipelineSpec) -> PipelineSpec:
    """Block 1 gains a parameter its forward never uses; the head's norm gain is frozen."""
    layers = list(spec.layers)
    block = next(i for i, layer in enumerate(layers) if layer.name == "layers.1")
    unused_build, head_build = layers[block].build, layers[-1].build

    def unused() -> nn.Module:
        module = unused_build()
        module.register_parameter("gate", nn.Parameter(torch.empty(4)))
        init = module.init_weights

        def init_weights(generator: torch.Generator) -> None:
            init(generator)
            with torch.no_grad():
                module.gate.fill_(0.5)

        module.init_weights = init_weights
        return module

    def frozen() -> nn.Module:
        module = head_build()
        module.norm.weight.requires_grad_(False)
        return module

    layers[block] = dataclasses.replace(layers[block], build=unused)
    layers[-1] = dataclasses.replace(layers[-1], build=frozen)
    return dataclasses.replace(spec, layers=tuple(layers))


def test_an_unused_and_a_frozen_parameter_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pipetrain.train.session as session

    real = session.model_spec
    monkeypatch.setattr(
        session, "model_spec", lambda config, **kw: _with_mistakes(real(config, **kw))
    )
    argv = [
        "train", *TINY, "--steps", "2", "--pp", "2", "--single-process", "--grad-report", "1",
        "--name", "mistakes", "--set", f"run.out_dir={json.dumps(str(tmp_path))}",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gradient report, step 1: 40 parameters, 2 flagged" in out
    assert "! layers.1.gate (stage 0): no-grad; grad norm -, weight norm 1" in out
    assert "! head.norm.weight (stage 1): no-grad, frozen" in out
    flagged = {(r["step"], r["name"]): r["flags"] for r in _report(tmp_path / "mistakes")}
    assert {k: v for k, v in flagged.items() if v} == {
        (1, "layers.1.gate"): ["no-grad"],
        (1, "head.norm.weight"): ["no-grad", "frozen"],
        (2, "layers.1.gate"): ["no-grad"],
        (2, "head.norm.weight"): ["no-grad", "frozen"],
    }


def test_an_explicit_warmup_longer_than_the_run_is_still_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = one_line_error(["train", *TINY, "--set", "optim.warmup_steps=10"], capsys)
    assert "optim.warmup_steps 10 leaves no step after the warm-up of a 5-step run" in line


def test_grad_report_is_refused_where_it_cannot_report(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(["train", *TINY, "--grad-report", "-1"], capsys)
    assert "run.grad_report is -1: it must be at least 0" in line
    line = one_line_error(["train", *TINY, "--set", "run.grad_vanishing=-1"], capsys)
    assert "run.grad_vanishing" in line
    flags = ["--pp", "2", "--schedule", "pipedream", "--grad-report", "1"]
    line = one_line_error(["train", *TINY, *flags], capsys)
    assert "run.grad_report: an asynchronous schedule" in line


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--dp", "2", "--shard"]], ids=["tp", "fsdp"])
def test_sharded_parameters_report_the_whole_tensor(tmp_path: Path, flags: list[str]) -> None:
    # DTensor shards (tensor parallel, FSDP2) added up over their ranks, a tensor that every
    # tp rank holds whole counted once: the rows of one process, sizes and norms.
    one = ["--steps", "1", "--set", "optim.warmup_steps=0", "--grad-report", "1"]
    assert main(["train", *TINY, *one, "--pp", "1", "--name", "one", *_out(tmp_path)]) == 0
    command = [*TINY, *one, "--pp", "1", *flags, "--name", "sharded", *_out(tmp_path)]
    subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "train", *command],
        check=True,
        capture_output=True,
        timeout=280,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    want = {r["name"]: r for r in _report(tmp_path / "one")}
    got = _report(tmp_path / "sharded")
    assert sorted(r["name"] for r in got) == sorted(want)
    for row in got:
        ref = want[row["name"]]
        assert row["numel"] == ref["numel"], row["name"]
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), row["name"]
        assert row["weight_norm"] == pytest.approx(ref["weight_norm"], rel=1e-6), row["name"]
    (record,) = [r for r in read_records(tmp_path / "sharded") if "loss" in r]
    squares = sum(r["grad_norm"] ** 2 for r in got if r["in_norm"])
    assert squares == pytest.approx(record["grad_norm"] ** 2, rel=1e-6)


def _out(folder: Path) -> list[str]:
    return ["--set", f"run.out_dir={json.dumps(str(folder))}"]
