"""`pipetrain train` on a CPU preloads tcmalloc into the processes it starts where the
system has it (``run.allocator``): their resident set then follows the tensors' bytes,
which the run summary's prediction counts, without mapping every tensor; a named
allocator that is not there, or an unknown name, is refused in one line."""

from __future__ import annotations

import ctypes.util
import platform
from pathlib import Path

import pytest
from cli_errors import one_line_error
from run_records import read_records, train_run

from pipetrain.heap import allocator_library

pytestmark = pytest.mark.e2e


def _installed() -> bool:
    try:
        return bool(allocator_library("tcmalloc"))
    except LookupError:
        return False


_FLAGS = (
    "--model", "llama-default", "--pp", "2", "--schedule", "1f1b", "--microbatches", "2",
    "--steps", "3", "--device", "cpu",
    "--set", "data.batch_size=16", "--set", "data.seq_len=128",
    "--set", "optim.warmup_steps=0", "--set", "run.evaluate=false",
    "--set", "run.sample_tokens=0", "--set", "data.max_bytes=100000",
)  # fmt: skip


@pytest.mark.skipif(
    platform.system() != "Linux" or not _installed(),
    reason="tcmalloc is not installed (Debian: libtcmalloc-minimal4)",
)
def test_tcmalloc_ranks_measure_what_the_model_counts(work: Path) -> None:
    run = train_run(work, "tc", *_FLAGS, "--data", str(work / "data"))
    assert "(C heap: tcmalloc)" in run.stdout, run.stdout[-2000:]
    check = next(r for r in read_records(work / "tc") if r.get("memory_check"))
    assert check["allocator"] == "tcmalloc"
    predicted, measured = check["predicted_peak"], check["measured_peak"]
    assert len(predicted) == len(measured) == 2
    for count, peak in zip(predicted, measured, strict=True):
        assert count == pytest.approx(peak, rel=0.10), (predicted, measured)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (("run.allocator=mimalloc",), "run.allocator is 'mimalloc': use one of auto, tcmalloc"),
        (
            ("run.map_tensors=true", "run.allocator=tcmalloc"),
            "run.map_tensors maps tensors through glibc's malloc, not tcmalloc's",
        ),
        (
            ("run.allocator=jemalloc",),
            "run.allocator is 'jemalloc', but jemalloc is not installed here (Debian: apt "
            "install libjemalloc2): install it or --set run.allocator=auto",
        ),
    ],
)
def test_bad_allocator_is_one_line(
    work: Path,
    settings: tuple[str, ...],
    says: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No allocator library is found here, whatever the machine has installed.
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    extra = [arg for setting in settings for arg in ("--set", setting)]
    argv = ["train", *_FLAGS, "--data", str(work / "data"), "--set", f"run.out_dir={work}", *extra]
    assert says in one_line_error(argv, capsys)
