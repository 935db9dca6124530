"""`pipetrain plan --tp` end to end: llama3-70b over 8 x 8 ranks in a real process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_llama3_70b_pp8_tp8_fits_80gib_and_says_so() -> None:
    flags = (
        "--model llama3-70b --pp 8 --tp 8 --memory-limit 80GiB --seq-len 4096 "
        "--microbatches 32 --sequence-parallel --tp-bandwidth 1.5e11"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "plan", *flags.split()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # Per tp rank: 70.55 B parameters / 64 ~ 1.1 B, 16 bytes each ~ 16-18 GiB of state.
    assert "8 x 8 = 64 processes" in done.stdout
    assert "17.9 GiB" in done.stdout and "15.9 GiB" in done.stdout
    assert "recommended: --microbatches 32" in done.stdout
