"""`pipetrain train --set run.map_tensors=true` on a CPU: every tensor of 128 KiB or more is
mapped on its own, so each process's measured peak is its tensors' bytes, which the memory
model's count (the run summary's prediction) meets within 10% for a 1F1B pipeline; with the
heap kept, as training runs by default, the same processes measure more (the holes between
freed tensors, docs/memory_model.md)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from run_records import read_records, train_run

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
        reason="glibc's mmap threshold",
    ),
]


def _peaks(work: Path, name: str, *extra: str) -> tuple[list[float], list[float]]:
    run = train_run(
        work, name, "--model", "llama-default", "--pp", "2", "--schedule", "1f1b",
        "--microbatches", "2", "--steps", "3", "--data", str(work / "data"),
        "--device", "cpu",
        "--set", "data.batch_size=16", "--set", "data.seq_len=128",
        "--set", "optim.warmup_steps=0", "--set", "run.evaluate=false",
        "--set", "run.sample_tokens=0", "--set", "data.max_bytes=100000", *extra,
    )  # fmt: skip
    assert "run.map_tensors has no effect" not in run.stdout + run.stderr  # glibc: it took
    check = next(r for r in read_records(work / name) if r.get("memory_check"))
    return check["predicted_peak"], check["measured_peak"]


def test_mapped_tensors_measure_what_the_model_counts(work: Path) -> None:
    # Micro-batches of 8 sequences of 128: every activation is 512 KiB or more.
    predicted, mapped = _peaks(work, "mapped", "--set", "run.map_tensors=true")
    assert len(predicted) == len(mapped) == 2
    for count, measured in zip(predicted, mapped, strict=True):
        assert count == pytest.approx(measured, rel=0.10), (predicted, mapped)
    # glibc's kept heap (a preloaded tcmalloc's would follow the tensors: test_cli_allocator)
    _, kept = _peaks(work, "kept", "--set", "run.allocator=system")
    assert all(k > m for k, m in zip(kept, mapped, strict=True)), (kept, mapped)
