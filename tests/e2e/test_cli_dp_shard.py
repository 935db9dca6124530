"""`pipetrain train --dp 2 --shard`: sharded stages through the real launcher (4 processes)
equal one process on the full batch, evaluate, sample and save checkpoints.

One 4-process launch: pp2 x dp2 --shard with ZB-H1 (evaluation every 2 steps, a sample at
the end, saves at steps 2 and 4); every step's loss and every evaluation must equal the
one-process run to 1e-5 relative. Launches are the suite's cost: test_cli_dp resumes a
pp=4 checkpoint under --shard, and tests/dist/test_dp_shard.py moves checkpoints between
sharded, DDP and pp=4 layouts through the same save and load functions.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from run_records import read_records, train_run

from pipetrain.checkpoint import list_checkpoints
from pipetrain.cli import main

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--steps", "5", "--batch-size", "8", "--seq-len", "16",
    "--microbatches", "4", "--eval-every", "2", "--set", "data.max_bytes=100000",
    "--set", "optim.warmup_steps=1", "--set", "run.sample_tokens=4",
    "--set", "data.eval_batches=1",
]  # fmt: skip


def _values(run_dir: Path, field: str) -> dict[int, float]:
    return {r["step"]: r[field] for r in read_records(run_dir) if field in r}


def _train(out: Path, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return train_run(out, name, *TINY, *flags)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp_shard")


@pytest.fixture(scope="module")
def reference(out: Path) -> Path:
    """One process, one stage, the full batch."""
    flags = ["--pp", "1", "--name", "ref", "--set", f"run.out_dir={json.dumps(str(out))}"]
    assert main(["train", *TINY, *flags]) == 0
    return out / "ref"


@pytest.fixture(scope="module")
def sharded(out: Path) -> subprocess.CompletedProcess[str]:
    return _train(
        out, "shard", "--pp", "2", "--dp", "2", "--shard", "--schedule", "zb-h1",
        "--checkpoint-dir", str(out / "ckpt_shard"), "--checkpoint-every", "2",
    )  # fmt: skip


def _assert_equal(
    got: dict[int, float], want: dict[int, float], steps: list[int], what: str
) -> None:
    assert sorted(got) == steps, what
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"{what}: step {step}"


def test_sharded_pp2_dp2_equals_one_process(
    out: Path, reference: Path, sharded: subprocess.CompletedProcess[str]
) -> None:
    run = out / "shard"
    _assert_equal(_values(run, "loss"), _values(reference, "loss"), [1, 2, 3, 4, 5], "loss")
    _assert_equal(
        _values(run, "eval_loss"), _values(reference, "eval_loss"), [0, 2, 4, 5], "eval loss"
    )
    dp = next(r for r in read_records(run) if "dp_replicas" in r)
    assert dp["dp_sharded"] is True
    # Every rank stores about half of its stage's parameters and AdamW state.
    assert len(dp["dp_state_bytes"]) == 4 and all(b > 0 for b in dp["dp_state_bytes"])
    assert "sharded (FSDP2)" in sharded.stdout
    # Each rank gathers its stage's parameters and reduce-scatters as many gradient bytes.
    assert "MB of parameters all-gathered and as many of gradients reduce-scattered" in (
        sharded.stdout
    )
    assert dp["dp_all_gather_bytes_per_step"] == dp["dp_bytes_per_step"]
    assert len(dp["dp_bytes_per_step"]) == 2 and all(b > 0 for b in dp["dp_bytes_per_step"])
    # The sample is generated from weights gathered out of the shards.
    assert "sample (temperature" in sharded.stdout
    assert [s for s, _ in list_checkpoints(out / "ckpt_shard").complete] == [2, 4, 5]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shard"], "pipeline.dp is 1: add --dp 2 (or more) or drop --shard"),
        (
            ["--shard", "--dp", "2", "--pp", "2", "--schedule", "chimera"],
            "pipeline.shard does not support 'chimera'",
        ),
        (
            ["--shard", "--dp", "2", "--pp", "2", "--compile"],
            "pipeline.shard with pipeline.compile is not supported",
        ),
        (
            ["--shard", "--dp", "2", "--grad-as-bucket-view"],
            "which --shard does not have: drop --grad-as-bucket-view or --shard",
        ),
    ],
)
def test_bad_shard_settings_are_one_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
