"""`pipetrain train --dp`: pp=2 x dp=2 through the real launcher (4 processes) equals one
process on the full batch, and checkpoints move between (pp=2, dp=2) and (pp=4, dp=1).

Three 4-process launches in all, chained through checkpoints: pp2 x dp2 from scratch
(saving at steps 2 and 4), pp4 resumed from its step 2 (saving at 4), pp2 x dp2 with
sharded stages (--shard) resumed from that step 4. Every step's loss must equal the
one-process run to 1e-5 relative.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from run_records import assert_same_steps as _assert_losses
from run_records import losses as _losses
from run_records import read_records, train_run

from pipetrain.checkpoint import list_checkpoints, read_manifest
from pipetrain.cli import main

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--steps", "5", "--batch-size", "8", "--seq-len", "16",
    "--microbatches", "4", "--eval-every", "0", "--set", "data.max_bytes=100000",
    "--set", "optim.warmup_steps=1", "--set", "run.sample_tokens=0",
    "--set", "data.eval_batches=1",
]  # fmt: skip


def _train(out: Path, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return train_run(out, name, *TINY, *flags)


def _checkpoint_copy(source: Path, step: int, target: Path) -> Path:
    """A checkpoint directory holding only ``source``'s checkpoint of ``step``."""
    name = f"step_{step:06d}"
    target.mkdir()
    shutil.copytree(source / name, target / name)
    return target


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp")


@pytest.fixture(scope="module")
def reference(out: Path) -> dict[int, float]:
    """One process, one stage, the full batch."""
    assert (
        main(
            [
                "train",
                *TINY,
                "--pp",
                "1",
                "--name",
                "ref",
                "--set",
                f"run.out_dir={json.dumps(str(out))}",
            ]
        )
        == 0
    )
    return _losses(out / "ref")


@pytest.fixture(scope="module")
def pp2_dp2(out: Path) -> subprocess.CompletedProcess[str]:
    ckpt = out / "ckpt_pp2dp2"
    return _train(
        out,
        "pp2dp2",
        "--pp",
        "2",
        "--dp",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
    )


def test_pp2_dp2_starts_4_processes_and_equals_one_process(
    out: Path, reference: dict[int, float], pp2_dp2: subprocess.CompletedProcess[str]
) -> None:
    _assert_losses(_losses(out / "pp2dp2"), reference, [1, 2, 3, 4, 5], "pp=2 dp=2")
    records = read_records(out / "pp2dp2")
    summary = next(r for r in records if r.get("summary"))
    assert len(summary["peak_memory"]) == 4  # one entry per process
    # Tokens count the whole batch of every step, all replicas together.
    assert [r["tokens"] for r in records if "loss" in r] == [8 * 16] * 5
    dp = next(r for r in records if "dp_replicas" in r)
    assert dp["dp_replicas"] == 2 and len(dp["dp_bytes_per_step"]) == 2  # by pipeline rank
    assert all(b > 0 for b in dp["dp_bytes_per_step"]) and len(dp["dp_wait_s"]) == 2
    assert "data parallel: 2 replicas" in pp2_dp2.stdout
    ckpt = out / "ckpt_pp2dp2"
    assert [s for s, _ in list_checkpoints(ckpt).complete] == [2, 4, 5]
    layout = read_manifest(ckpt / "step_000002").layout
    assert (layout.pp, layout.world_size) == (2, 4)


def test_checkpoints_move_between_pp2_dp2_and_pp4(
    out: Path, reference: dict[int, float], pp2_dp2: subprocess.CompletedProcess[str]
) -> None:
    # Saved under pp=2 x dp=2 at step 2, resumed under pp=4 x dp=1.
    pp4 = _checkpoint_copy(out / "ckpt_pp2dp2", 2, out / "ckpt_pp4")
    result = _train(
        out, "pp4", "--pp", "4", "--checkpoint-dir", str(pp4), "--checkpoint-every", "2", "--resume"
    )
    assert "at step 2" in result.stdout and "saved with pp=2" in result.stdout
    _assert_losses(_losses(out / "pp4"), reference, [3, 4, 5], "pp=4 resumed from pp=2 dp=2")

    # And back: saved under pp=4 at step 4, resumed under pp=2 x dp=2 with sharded stages
    # (FSDP2 loads its shards of the whole tensors pp=4 saved).
    back = _checkpoint_copy(pp4, 4, out / "ckpt_back")
    result = _train(
        out, "back", "--pp", "2", "--dp", "2", "--shard", "--checkpoint-dir", str(back), "--resume"
    )
    assert "at step 4" in result.stdout and "saved with pp=4" in result.stdout
    assert "sharded (FSDP2)" in result.stdout
    _assert_losses(_losses(out / "back"), reference, [5], "pp=2 dp=2 --shard resumed from pp=4")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dp", "0"], "pipeline.dp is 0: it must be at least 1"),
        (
            ["--dp", "3", "--pp", "2"],
            "data.batch_size 8 does not split into pipeline.dp 3 replicas",
        ),
        (
            ["--dp", "2", "--pp", "2", "--single-process"],
            "pipeline.single_process runs one pipeline",
        ),
    ],
)
def test_bad_dp_settings_are_one_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_simulate_adds_the_dp_all_reduce(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2"]
    assert (
        main([*flags, "--weight-bytes", "100", "--dp", "2", "--dp-bandwidth", "50", "--json"]) == 0
    )
    dp = json.loads(capsys.readouterr().out)["data_parallel"]
    # Rank 1's all-reduce (2 units) hides under rank 0's cool-down; rank 0's sticks out.
    assert dp == {
        "dp": 2,
        "bytes_per_rank": [100.0, 100.0],
        "traffic_per_rank": [100.0, 100.0],
        "allreduce_time": [2.0, 2.0],
        "step_time": 11.0,
        "exposed": 2.0,
    }
    assert main([*flags, "--weight-bytes", "100", "--dp", "2", "--dp-bandwidth", "50"]) == 0
    assert "step 11 (2 past the pipeline)" in capsys.readouterr().out
    assert main([*flags, "--dp", "2"]) == 2
    assert "--dp needs --weight-bytes" in capsys.readouterr().err
