"""Keep the C heap's freed memory in the process between training steps (glibc, CPU).

glibc trims the top of its heap and maps large blocks afresh by thresholds it adjusts on
its own, so a training step that frees and allocates the same activations each time can
pay for its pages again at every step (measured: docs/heap.md).

``keep_heap`` fixes both thresholds, so a step reuses the pages the previous one freed:
the process keeps its high-water mark of heap, which a training run reaches at every step
anyway. Blocks of ``mmap_threshold`` and more (large weights, checkpoint buffers) are
still mapped and unmapped on their own. The trainer's processes call it; a user's own
process may (the runtime never changes the allocator on its own).
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["MAPPED_TENSORS", "keep_heap", "release_free_heap"]

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc's own ceiling for the dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1024 * 1024 * 1024
# glibc's own default mmap threshold: at it every activation of a pipeline stage is mapped
# on its own and unmapped when freed (run.map_tensors), so the resident set follows the
# tensors' bytes; each allocation then faults its pages in afresh.
MAPPED_TENSORS = 128 * 1024


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (whose malloc these calls tune), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_heap(mmap_threshold: int = _MMAP_THRESHOLD, trim_threshold: int = _TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds (module doc); False where the C library is not
    glibc or refuses, in which case nothing changed."""
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success; setting either threshold turns glibc's dynamic
    # adjustment of both off.
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
        and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel now (glibc's ``malloc_trim``), as
    between two runs in one process whose peaks are measured apart; False where the C
    library is not glibc or had nothing to give back."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))
