"""``pipetrain plan`` with odd inputs found by a bug hunt: one line and exit 2, or a plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.e2e


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "plan", "--model", "gpt2-tiny", "--pp", "2", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line(done: subprocess.CompletedProcess[str], message: str) -> None:
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks a machine without MPS")
def test_profile_devices_that_cannot_time_layers_are_refused() -> None:
    # --device meta "measured" every layer on tensors without data and printed a plan of
    # noise; a device torch was not built for (mps on Linux) ended in a traceback.
    _one_line(_plan("--balance", "profile", "--device", "meta"), "--device meta runs no kernels")
    _one_line(_plan("--balance", "profile", "--device", "mps"), "--device mps cannot be used")


def test_a_profile_larger_than_the_machine_is_refused_before_it_starts() -> None:
    # A real size (llama3-8b at 8192 tokens) went on to materialise and time its layers
    # until the kernel killed the process for memory. This one needs terabytes anywhere.
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "plan", "--model", "llama3-8b", "--pp", "2",
         "--balance", "profile", "--set", "vocab_size=100000000"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    _one_line(done, "to measure layer head at micro-batch 4 x 8192, more than the")


def test_a_model_name_override_renames_the_plan() -> None:
    # --set name=... is a listed field of the preset; it crashed with a TypeError.
    done = _plan("--set", "name=my-gpt")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("my-gpt: 1f1b on 2 ranks")


def test_a_profile_at_one_sample_takes_the_assumed_fixed_part_out_of_the_measurement() -> None:
    # At micro-batch 1 the fixed part per layer and action cannot be fitted; it was assumed
    # (--overhead-ms) and added to times that already contained it. With 1 s assumed, every
    # measured figure (well under 1 s) is all fixed part: a stage's forward is 1 s per layer.
    done = _plan(
        "--balance", "profile", "--batch-size", "2", "--microbatches", "2", "--repeats", "1",
        "--overhead-ms", "1000", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "fixed part assumed 1000.0 ms" in out["time_source"]
    for stage in out["stages"]:
        assert stage["forward"] == pytest.approx(len(stage["layers"]))
        assert stage["backward"] == pytest.approx(2 * len(stage["layers"]))
