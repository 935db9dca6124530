"""The C heap of a training process on a CPU: which allocator holds it, and how.

glibc trims the top of its heap and maps large blocks afresh by thresholds it adjusts on
its own, so a training step that frees and allocates the same activations each time can
pay for its pages again at every step (measured: docs/heap.md).

``keep_heap`` fixes both thresholds, so a step reuses the pages the previous one freed:
the process keeps its high-water mark of heap, which a training run reaches at every step
anyway. Blocks of ``mmap_threshold`` and more (large weights, checkpoint buffers) are
still mapped and unmapped on their own. The trainer's processes call it; a user's own
process may (the runtime never changes the allocator on its own).

glibc's best fit leaves holes between the activations that its small objects split, so
its kept heap holds 23-61% more than the tensors (docs/memory_model.md). An allocator with
size classes, tcmalloc or jemalloc, keeps small and large blocks apart: the processes the
trainer starts on a CPU preload one where the system has it (``run.allocator``,
``allocator_library``), and ``running_allocator`` says which one a process runs with.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
from collections.abc import Iterator

__all__ = [
    "ALLOCATORS",
    "MAPPED_TENSORS",
    "allocator_library",
    "keep_heap",
    "preloading",
    "release_free_heap",
    "running_allocator",
    "with_preload",
]

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

# run.allocator's values: "auto" preloads tcmalloc where found, "system" nothing.
ALLOCATORS = ("auto", "tcmalloc", "jemalloc", "system")
# Per allocator: the name ctypes.util.find_library looks for, and the Debian package.
_LIBRARIES = {
    "tcmalloc": ("tcmalloc_minimal", "libtcmalloc-minimal4"),
    "jemalloc": ("jemalloc", "libjemalloc2"),
}
# jemalloc's MALLCTL_ARENAS_ALL: "arena.<i>.purge" with it purges every arena.
_ALL_ARENAS = 4096


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (whose malloc these calls tune), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def running_allocator() -> str:
    """The malloc this process runs with: "tcmalloc" or "jemalloc" (preloaded), "glibc",
    or "other" (another C library's own)."""
    this = ctypes.CDLL(None)  # the process's global symbols, preloaded libraries first
    if hasattr(this, "MallocExtension_ReleaseFreeMemory"):
        return "tcmalloc"
    if hasattr(this, "mallctl"):
        return "jemalloc"
    return "glibc" if _glibc() is not None else "other"


def allocator_library(setting: str) -> str:
    """The shared library to preload for ``run.allocator`` = ``setting``: "" for "system",
    and for "auto" where tcmalloc is not installed; ``LookupError`` (naming the package)
    where a named one is not."""
    if setting == "system" or platform.system() != "Linux":
        return ""
    name = "tcmalloc" if setting == "auto" else setting
    library, package = _LIBRARIES[name]
    found = ctypes.util.find_library(library)
    if found:
        return found
    if setting == "auto":
        return ""
    raise LookupError(f"{name} is not installed here (Debian: apt install {package})")


def setup_line() -> str:
    """What the set-up (``make``) says about ``run.allocator=auto`` here: the library CPU
    runs will preload, or that tcmalloc is missing, what that costs, and its package."""
    found = allocator_library("auto")
    if found:
        return f"CPU runs preload {found} (run.allocator=auto)"
    return (
        "note: tcmalloc is not installed, so CPU runs keep the glibc heap and their measured "
        f"peaks hold its holes (Debian: apt install {_LIBRARIES['tcmalloc'][1]})"
    )


def with_preload(library: str, current: str) -> str:
    """``LD_PRELOAD`` for a process that is to run with ``library`` ahead of ``current``
    (the launcher's own value): unchanged where it already preloads an allocator."""
    names = [os.path.basename(part) for part in current.replace(":", " ").split()]
    if not library or any(
        n.startswith(("libtcmalloc", "libjemalloc", "libmimalloc")) for n in names
    ):
        return current
    return f"{library} {current}".strip()


@contextlib.contextmanager
def preloading(library: str) -> Iterator[None]:
    """Processes started inside preload ``library`` ahead of this one's ``LD_PRELOAD``
    (``with_preload``); "" changes nothing. The variable is restored on the way out."""
    before = os.environ.get("LD_PRELOAD")
    if library:
        os.environ["LD_PRELOAD"] = with_preload(library, before or "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def keep_heap(mmap_threshold: int = _MMAP_THRESHOLD, trim_threshold: int = _TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds (module doc); False where the process's malloc
    is not glibc's or refuses, in which case nothing changed."""
    libc = _glibc()
    if libc is None or running_allocator() != "glibc":
        return False
    # mallopt returns 1 on success; setting either threshold turns glibc's dynamic
    # adjustment of both off.
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
        and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel now, as between two runs in one
    process whose peaks are measured apart, and before a run's baseline (pages freed while
    the run was built would otherwise serve its steps without counting): glibc's
    ``malloc_trim``, tcmalloc's ``ReleaseFreeMemory``, jemalloc's purge of every arena.
    False where the allocator is another or had nothing to give back."""
    which = running_allocator()
    this = ctypes.CDLL(None)
    if which == "tcmalloc":
        this.MallocExtension_ReleaseFreeMemory()
        return True
    if which == "jemalloc":
        key = f"arena.{_ALL_ARENAS}.purge".encode()
        return bool(this.mallctl(key, None, None, None, ctypes.c_size_t(0)) == 0)
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))
