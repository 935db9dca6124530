"""`pipetrain train --microbatches auto` through the real launcher (2 processes): the probe's
record and line, the count in every step record, and losses equal to a fixed count's;
what cannot choose is one line and exit status 2."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from cli_errors import one_line_error
from run_records import assert_same_steps, losses, read_records, train_run

from pipetrain.config import load_config

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--steps", "7", "--batch-size", "8", "--seq-len", "16",
    "--eval-every", "0", "--set", "data.max_bytes=100000", "--set", "optim.warmup_steps=1",
    "--set", "run.sample_tokens=0", "--set", "data.eval_batches=1", "--pp", "2",
]  # fmt: skip


def test_auto_probes_three_counts_and_trains_like_a_fixed_count(work: Path) -> None:
    out = work / "runs"
    result = train_run(out, "auto", *TINY, "--microbatches", "auto", "--data", str(work / "data"))
    records = read_records(out / "auto")
    (decision,) = [r["microbatches_auto"] for r in records if "microbatches_auto" in r]
    # From the default 8: 8, then 2 and 4 (1F1B on 2 ranks takes no fewer), 2 steps each.
    assert sorted(decision["tried"], key=int) == ["2", "4", "8"]
    assert all(t > 0 for t in decision["tried"].values()) and decision["steps"] == [1, 6]
    chosen = decision["chosen"]
    counts = [r["microbatches"] for r in records if "loss" in r]
    assert counts == [8, 8, 2, 2, 4, 4, chosen]
    assert records[-1]["summary"] and records[-1]["microbatches"] == chosen
    line = [s for s in result.stdout.splitlines() if s.startswith("--microbatches auto:")]
    assert len(line) == 1 and line[0].endswith(f"training on with {chosen} micro-batches")
    # The run folder's config loads back, still asking for auto from the same start.
    saved = load_config(out / "auto" / "config.toml", check_paths=False).pipeline
    assert (saved.microbatches, saved.microbatches_auto) == (8, True)
    # The same steps with a fixed count, in one process (the debug mode): equal losses.
    from pipetrain.launch.role import ProcessRole
    from pipetrain.train.loop import train

    fixed = load_config(
        out / "auto" / "config.toml",
        {
            "run.name": "fixed",
            "pipeline.microbatches_auto": False,
            "pipeline.single_process": True,
            "pipeline.threads": 1,
        },
    )
    train(fixed, ProcessRole(), out=io.StringIO())
    assert_same_steps(losses(out / "auto"), losses(out / "fixed"), list(range(1, 8)), "auto")


def test_a_schedule_with_one_count_is_refused(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_line_error(
        ["train", *TINY, "--schedule", "naive", "--microbatches", "auto",
         "--set", f"run.out_dir={json.dumps(str(work / 'refused'))}"],
        capsys,
    )  # fmt: skip
    assert line == (
        "pipetrain train: error: pipeline.microbatches_auto (--microbatches auto): schedule "
        "naive runs the whole batch as 1 micro-batch: nothing to choose; drop --microbatches "
        "auto or pick another --schedule"
    )
    assert not (work / "refused").exists()
