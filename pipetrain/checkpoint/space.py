"""Room for a checkpoint: what a save will write, what is free, and what ``keep`` may prune
first.

A save needs about the bytes of the tensors every rank holds (parameters, optimizer state,
random states): DCP writes them raw, with a small header per tensor, and the previous
checkpoint of the same run measures the same thing exactly, so the larger of the two is
the estimate. Rank 0 compares it with the free space of the checkpoint directory's file
system before any rank writes, and decides for every rank: save, prune older checkpoints
first (``keep``: those the save would remove anyway, oldest first, only as many as needed),
or stop in one line with the earlier checkpoints untouched.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetrain.checkpoint.directory import list_checkpoints
from pipetrain.tensors import local_tensor

__all__ = [
    "NO_SPACE",
    "Room",
    "first_failure",
    "folder_bytes",
    "free_bytes",
    "megabytes",
    "no_room_line",
    "optimizer_bytes",
    "plan_room",
    "tensor_bytes",
    "write_failed_line",
]

# The errors of a full disk (or of a full quota, which reads the same to the user).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

# What a save writes besides the tensors' bytes: measured on the CPU (llama-tiny, 198
# tensors, and llama-default, 558), torch.save's header of 1.57 KB per tensor in the data
# files and 0.22 KB per tensor in DCP's .metadata; the manifest and marker are under 1 KB.
_PER_TENSOR = 2048
_PER_SAVE = 64 * 1024


@dataclass(frozen=True)
class Room:
    """Rank 0's answer before a save: whether it fits, and what to prune first."""

    needed: int  # bytes the save is estimated to write
    free: int  # bytes free on the directory's file system now
    prune: tuple[Path, ...]  # older checkpoints to remove first (``keep``), oldest first
    prunable: int  # bytes ``keep`` could free at most
    fits: bool


def tensor_bytes(values: Iterable[Any]) -> int:
    """Bytes of the tensors among ``values`` as a save writes them (a DTensor's local
    shard), plus a header for each."""
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            local = local_tensor(value)
            total += local.numel() * local.element_size() + _PER_TENSOR
    return total


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state as a save writes it (its tensors, and each parameter's
    group settings as a small JSON tensor); before the first step, when Adam(W) has made
    none yet, its two moments (each the size of its parameter) and step count."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = len(params) * _PER_TENSOR
    if optimizer.state:
        return groups + tensor_bytes(
            v for state in optimizer.state.values() for v in state.values()
        )
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return groups
    return groups + 2 * tensor_bytes(params) + len(params) * _PER_TENSOR


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def free_bytes(root: Path) -> int:
    """Free bytes for an unprivileged writer on ``root``'s file system (its nearest
    existing parent while it does not exist yet)."""
    probe = root.absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def plan_room(root: Path, step: int, state: int, keep: int | None) -> Room:
    """Whether the save of ``step`` (``state``: the tensor bytes of every rank) fits in
    ``root``, pruning first what ``keep`` would remove after it (checkpoints before
    ``step`` beyond the newest ``keep - 1``), oldest first and only as many as needed."""
    found = list_checkpoints(root)
    earlier = [path for saved, path in found.complete if saved < step]
    previous = folder_bytes(earlier[-1]) if earlier else 0
    needed = max(state + _PER_SAVE, previous)
    free = free_bytes(root)
    if needed <= free:
        return Room(needed, free, (), 0, True)
    doomed = earlier[: len(earlier) - (keep - 1)] if keep else []
    sizes = [folder_bytes(path) for path in doomed]
    prune: list[Path] = []
    freed = 0
    for path, size in zip(doomed, sizes, strict=True):
        if free + freed >= needed:
            break
        prune.append(path)
        freed += size
    fits = free + freed >= needed
    return Room(needed, free, tuple(prune) if fits else (), sum(sizes), fits)


def megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"


def no_room_line(room: Room, root: Path, step: int, keep: int | None) -> str:
    """Why the save of ``step`` does not start, and the fix, in one line."""
    pruned = (
        f" (and {megabytes(room.free + room.prunable)} with the older checkpoints that "
        f"--keep {keep} removes)"
        if keep
        else ""
    )
    return (
        f"not enough space for the checkpoint of step {step} in {root}: it needs about "
        f"{megabytes(room.needed)} and {megabytes(room.free)} are free{pruned}; "
        f"{_kept(root, step)}; free space there, pass --keep N to remove older checkpoints "
        f"first, or another --checkpoint-dir, then continue with --resume"
    )


def _kept(root: Path, step: int) -> str:
    earlier = [path for saved, path in list_checkpoints(root).complete if saved < step]
    if not earlier:
        return "no checkpoint of this run was saved yet"
    return f"the earlier checkpoints are kept (newest {earlier[-1].name})"


def write_failed_line(step: int, root: Path, rank: int, exc: BaseException, needed: int) -> str:
    """A save that failed while writing (``exc`` on ``rank``), its partial folder removed."""
    if isinstance(exc, OSError) and exc.errno in NO_SPACE:
        what = (
            f"no space left on the device (rank {rank}; it needs about {megabytes(needed)}, "
            f"{megabytes(free_bytes(root))} are free now)"
        )
        fix = "free space there, pass --keep N to remove older checkpoints first, or another --checkpoint-dir"
    else:
        text = str(exc).strip().splitlines()
        what = f"rank {rank}: {type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
        fix = "fix that, or pass another --checkpoint-dir"
    return (
        f"saving the checkpoint of step {step} into {root} failed: {what}; the partial save "
        f"was removed and {_kept(root, step)}; {fix}, then continue with --resume"
    )


def first_failure(failures: Mapping[int, Any]) -> tuple[int, BaseException]:
    """The exception to name among DCP's ``failures`` (rank -> (exception, trace)): a full
    disk first, else the lowest rank's."""
    found: list[tuple[bool, int, BaseException]] = []
    for rank, wrapped in failures.items():
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if not isinstance(exc, BaseException):
            exc = RuntimeError(str(exc))
        full = isinstance(exc, OSError) and exc.errno in NO_SPACE
        found.append((not full, rank, exc))
    _, rank, exc = min(found, key=lambda item: (item[0], item[1]))
    return rank, exc
