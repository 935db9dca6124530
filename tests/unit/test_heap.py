"""pipetrain.heap: freed heap memory is reused without new page faults once kept.

Each case runs in a fresh interpreter (the thresholds are process-wide, and glibc's
dynamic ones depend on what the process freed before), without importing torch.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc thresholds",
)

ROOT = Path(__file__).resolve().parents[2]

# A training step in miniature: 24 blocks of 512 KiB (a GPipe step's activations) are
# allocated, written and freed, three times; the minor page faults of the last round are
# printed. Under glibc's own thresholds the first round's frees raise the mmap threshold
# and the heap's top is trimmed at the end of each round, so every round faults its pages
# in again.
_PROBE = """
import ctypes, resource, sys
sys.path.insert(0, {root!r})
from pipetrain.heap import keep_heap
if {keep}:
    assert keep_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 512 * 1024
for round in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(24)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in reversed(blocks):
        libc.free(b)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults)
assert "torch" not in sys.modules
"""


def _last_round_faults(keep: bool) -> int:
    code = _PROBE.format(root=str(ROOT), keep=keep)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_kept_heap_reuses_its_pages() -> None:
    pages = 24 * 512 * 1024 // 4096  # 3072: what a round touches
    kept = _last_round_faults(keep=True)
    default = _last_round_faults(keep=False)
    assert kept < pages // 10, (kept, default)
    # The probe itself shows the problem the setting removes (else it proves nothing).
    assert default > pages // 2, (kept, default)
