"""A full disk through ``pipetrain train`` (in this process, main(argv)): a checkpoint save
that runs out of space stops the run in one line, leaves no partial folder and keeps the
earlier checkpoint, and ``--resume`` after space is freed ends with the losses of an
uninterrupted run; metrics that cannot be written end the run in one line too."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from run_records import losses, read_records
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from pipetrain.checkpoint import list_checkpoints, verify_checkpoint
from pipetrain.checkpoint import save as save_module
from pipetrain.cli import main

pytestmark = pytest.mark.e2e


def _argv(work: Path, name: str, *extra: str) -> list[str]:
    return [
        "train", "--model", "llama-tiny", "--pp", "1", "--steps", "6", "--batch-size", "2",
        "--microbatches", "1", "--seq-len", "8", "--eval-every", "0",
        "--set", "run.sample_tokens=0", "--set", "optim.warmup_steps=1",
        "--data", str(work / "data"), "--set", f"run.out_dir={work / 'runs'}", "--name", name,
        *extra,
    ]  # fmt: skip


def test_a_save_on_a_full_disk_stops_in_one_line_and_resume_continues_the_run(
    work: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(work, "whole")) == 0  # the reference: 6 steps uninterrupted
    ckpt = work / "ckpt_full_disk"

    class FullAtStep4(FileSystemWriter):
        """The disk fills up while step 4 is written (the files are there, half done)."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)
            if "step_000004" in str(self.path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return written

    monkeypatch.setattr(save_module, "FileSystemWriter", FullAtStep4)
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    capsys.readouterr()
    assert main(_argv(work, "full", *flags)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"pipetrain train: error: saving the checkpoint of step 4 into {ckpt} failed: no space "
        "left on the device (rank 0; it needs about "
    )
    assert "the partial save was removed and the earlier checkpoints are kept (newest " in err
    found = list_checkpoints(ckpt)
    assert found.partial == () and [step for step, _ in found.complete] == [2]
    assert verify_checkpoint(found.complete[0][1]).ok

    monkeypatch.undo()  # space freed
    assert main(_argv(work, "full", *flags, "--resume")) == 0
    assert [step for step, _ in list_checkpoints(ckpt).complete] == [2, 4, 6]
    assert losses(work / "runs" / "full") == losses(work / "runs" / "whole")  # bit-exact


def test_metrics_on_a_full_disk_end_the_run_in_one_line(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = work / "runs" / "nospace"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    assert main(_argv(work, "nospace")) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"pipetrain train: error: writing run.metrics {str(run / 'metrics.jsonl')!r} failed (No "
        "space left on device): free space on its disk or pass another --metrics (the lines "
        "written so far are whole)"
    ]
    assert (run / "config.toml").read_text().startswith("[model]")
    assert read_records(work / "runs" / "whole")  # the module's other run is untouched
