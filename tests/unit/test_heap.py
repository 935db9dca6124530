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


# Holes: 24 blocks of 512 KiB, every other one freed, then 12 of 768 KiB that no hole
# takes. The resident set's growth in KiB is printed.
_HOLES = """
import ctypes, sys
sys.path.insert(0, {root!r})
from pipetrain.heap import MAPPED_TENSORS, keep_heap
assert keep_heap(MAPPED_TENSORS) if {mapped} else keep_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    return int(line.split()[1])
before = rss()
def block(size):
    b = libc.malloc(size)
    ctypes.memset(b, 1, size)
    return b
small = [block(512 * 1024) for _ in range(24)]
for b in small[::2]:
    libc.free(b)
large = [block(768 * 1024) for _ in range(12)]
print(rss() - before)
"""


def _holes_growth(mapped: bool) -> int:
    code = _HOLES.format(root=str(ROOT), mapped=mapped)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_mapped_tensors_leave_no_holes_in_the_resident_set() -> None:
    live = 12 * 512 + 12 * 768  # KiB still allocated
    holes = 12 * 512  # KiB freed between them
    kept, mapped = _holes_growth(mapped=False), _holes_growth(mapped=True)
    # The kept heap holds its holes (what run.map_tensors measures without); mapped
    # blocks go back to the system when freed.
    assert kept >= live + holes * 9 // 10, (kept, mapped)
    assert live * 9 // 10 <= mapped <= live + holes // 10, (kept, mapped)
