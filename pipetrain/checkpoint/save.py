"""Save a checkpoint: every rank its own part, visible only once complete.

Save protocol (every rank calls ``save_checkpoint`` with its own stage modules):

0. every rank counts the bytes it will write; rank 0 removes the leftovers of crashed
   saves, compares the sum with the free space (``pipetrain.checkpoint.space``: with
   ``keep``, older checkpoints are pruned first when that makes it fit) and tells every
   rank, before any of them writes, when it does not fit: one line, nothing touched;
1. rank 0 creates ``ROOT/step_000123.tmp-<nonce>/`` and tells every rank its name;
2. every rank writes and fsyncs its own part with torch.distributed.checkpoint (no
   gathering of tensors) and hashes the files it wrote;
3. rank 0 writes ``manifest.json`` (sha256 and size of every file, format version, model
   config, layout, run config, trainer state) and the ``COMPLETE`` marker, fsyncs them,
   and renames the directory to ``ROOT/step_000123/`` in one atomic step;
4. rank 0 removes the leftovers of crashed saves and, with ``keep``, all but the newest
   ``keep`` checkpoints up to this step (later steps, left from before a resume that fell
   back past them, are neither counted nor removed).

A process killed before step 3 ends leaves only a ``.tmp-`` directory, which loading
ignores with a warning: the previous checkpoint stays the newest valid one. A save that
fails (a full disk, any OS error: DCP gives every rank the same verdict) removes its
``.tmp-`` directory and raises one line on every rank naming what failed, where, and the
fix; the earlier checkpoints stay.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipetrain.checkpoint import state
from pipetrain.checkpoint.comm import Comm, as_modules, jsonable, quiet_single_process
from pipetrain.checkpoint.directory import list_checkpoints, step_dir_name
from pipetrain.checkpoint.errors import CheckpointError
from pipetrain.checkpoint.manifest import (
    FORMAT_VERSION,
    FileEntry,
    Layout,
    Manifest,
    fsync_dir,
    hash_file,
    write_manifest,
)
from pipetrain.checkpoint.space import (
    first_failure,
    no_room_line,
    plan_room,
    tensor_bytes,
    write_failed_line,
)
from pipetrain.errors import on_every_rank

__all__ = [
    "KILL_BEFORE_RENAME_ENV",
    "SaveResult",
    "save_checkpoint",
]

# Test hook: when set to a step number, rank 0 kills its own process with SIGKILL at that
# step's save, after every file and the manifest are written but before the rename: the
# worst moment for a crash, which the crash-safety test needs to hit exactly.
KILL_BEFORE_RENAME_ENV = "PIPETRAIN_CHECKPOINT_KILL_BEFORE_RENAME"


@dataclass(frozen=True)
class SaveResult:
    path: Path
    step: int
    bytes: int  # all files of the checkpoint, every rank's
    seconds: float
    removed: tuple[Path, ...] = field(default=())  # pruned by ``keep`` or crash leftovers
    made_room: tuple[Path, ...] = field(default=())  # of those, pruned before the save for room
    needed: int = 0  # bytes the save was estimated to need before it started


def _hash_own_files(directory: Path, rank: int, threads: int) -> list[FileEntry]:
    # DCP names each rank's data files "__<rank>_<n>.distcp": each rank hashes its own,
    # in parallel with the others, so rank 0 does not read the whole checkpoint. hashlib
    # lets go of the GIL on large buffers, so threads hash a rank's files side by side.
    files = sorted(directory.glob(f"__{rank}_*.distcp"))
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files)))) as pool:
        return list(pool.map(hash_file, files))


def save_checkpoint(
    root: Path | str,
    step: int,
    *,
    modules: nn.Module | Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    model: Mapping[str, Any],
    layout: Layout | None = None,
    config: Mapping[str, Any] | None = None,
    trainer: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    keep: int | None = None,
    threads: int = 1,
    group: Any = None,
) -> SaveResult:
    """Collective: every rank of ``group`` calls it with its own stage modules.

    ``model`` is the model config (checked field by field on load); ``trainer`` is
    JSON-able state such as the LR schedule's ``state_dict()`` and the data position;
    ``generators`` are named torch generators (the data sampler's) saved per rank.
    ``threads``: files each rank writes (and hashes) at once; more than 1 pays off where
    the rank has idle cores.
    """
    _check_arguments(step, threads, keep)
    start = time.perf_counter()
    comm = Comm.of(group)
    root = Path(root)
    index = state.index_parameters(as_modules(modules))
    entries = state.model_entries(index)
    if optimizer is not None:
        entries.update(state.optimizer_entries(optimizer, index))
    entries.update(state.rng_entries(comm.rank, generators or {}))
    # Rank 0 decides for every rank, before any writes: where to write, what to prune
    # first to make room (``keep``), or why there is no room (step 0 of the module doc).
    sizes = comm.gather(tensor_bytes(entries.values()))
    made: _Made = _make_room(root, step, sum(sizes), keep) if comm.rank == 0 else _Made()
    made = comm.broadcast(made)
    if made.error:
        raise on_every_rank(CheckpointError(made.error))
    tmp = root / made.tmp_name

    _write_entries(entries, tmp, comm, threads, step, root, made.needed)
    hashed = comm.gather(_hash_own_files(tmp, comm.rank, threads))
    outcome: tuple[str, int, tuple[str, ...]] | str = ""
    failure: Exception | None = None
    if comm.rank == 0:
        try:
            outcome = _finish_save(root, tmp, step, hashed, model, layout, config, trainer, keep)
        except Exception as exc:  # told to every rank below, so that none waits forever
            failure = exc
            outcome = f"finishing the save of step {step} in {tmp} failed on rank 0: {exc}"
            if isinstance(exc, OSError):  # a full disk (the manifest): no partial folder left
                shutil.rmtree(tmp, ignore_errors=True)
                outcome = write_failed_line(step, root, 0, exc, made.needed)
    # Doubles as the barrier: no rank returns before the checkpoint is visible.
    outcome = comm.broadcast(outcome)
    if failure is not None and not isinstance(failure, OSError):
        raise failure  # a bug (say, trainer state that is not JSON), not a bad input
    if isinstance(outcome, str):
        raise CheckpointError(outcome)
    final, total, removed = outcome
    return SaveResult(
        Path(final),
        step,
        total,
        time.perf_counter() - start,
        tuple(Path(p) for p in (*made.removed, *removed)),
        made_room=tuple(Path(p) for p in made.pruned),
        needed=made.needed,
    )


def _check_arguments(step: int, threads: int, keep: int | None) -> None:
    if step < 0:
        raise CheckpointError(f"step is {step}; a checkpoint step must be >= 0")
    if threads < 1:
        raise CheckpointError(f"threads is {threads}; use at least 1 writer thread per rank")
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep is {keep}; keep at least 1 checkpoint, or leave it unset")


def _write_entries(
    entries: dict[str, Any], tmp: Path, comm: Comm, threads: int, step: int, root: Path, needed: int
) -> None:
    """Every rank writes its entries into ``tmp`` through DCP; a failed write removes the
    partial folder and raises one line on every rank."""
    try:
        with quiet_single_process():
            dcp_save(
                entries,
                storage_writer=FileSystemWriter(str(tmp), sync_files=True, thread_count=threads),
                process_group=comm.group,
                no_dist=not comm.distributed,
            )
    except CheckpointException as exc:  # a BaseException: `except Exception` misses it
        # Every rank gets DCP's verdict alike (its write results are gathered), so every
        # rank is here: rank 0 removes the partial folder, which would keep the disk full,
        # and tells every rank the one line once it is gone.
        failed_rank, cause = first_failure(exc.failures)
        line = ""
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            line = write_failed_line(step, root, failed_rank, cause, needed)
        raise on_every_rank(CheckpointError(comm.broadcast(line))) from None


@dataclass(frozen=True)
class _Made:
    """Rank 0's answer before a save, broadcast: the folder to write into, or an error."""

    tmp_name: str = ""
    error: str = ""
    needed: int = 0
    removed: tuple[str, ...] = ()  # crash leftovers, and older checkpoints pruned for room
    pruned: tuple[str, ...] = ()  # of those, the checkpoints pruned for room (``keep``)


def _make_room(root: Path, step: int, state_bytes: int, keep: int | None) -> _Made:
    """Rank 0: remove crash leftovers (a failed save's folder kept the disk full, and
    every resume failed at the same step and left another), check the room for this save,
    prune older checkpoints first where ``keep`` allows and that makes it fit, and create
    the folder to write into."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        leftovers = list_checkpoints(root).partial
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        room = plan_room(root, step, state_bytes, keep)
        if not room.fits:
            return _Made(error=no_room_line(room, root, step, keep), needed=room.needed)
        for path in room.prune:
            shutil.rmtree(path, ignore_errors=True)
        tmp_name = f"{step_dir_name(step)}.tmp-{uuid.uuid4().hex[:12]}"
        (root / tmp_name).mkdir()
    except OSError as exc:
        return _Made(error=f"cannot create a checkpoint in {root} ({exc}); check --checkpoint-dir")
    pruned = tuple(str(p) for p in room.prune)
    return _Made(tmp_name, "", room.needed, (*map(str, leftovers), *pruned), pruned)


def _finish_save(
    root: Path,
    tmp: Path,
    step: int,
    hashed: list[list[FileEntry]],
    model: Mapping[str, Any],
    layout: Layout | None,
    config: Mapping[str, Any] | None,
    trainer: Mapping[str, Any] | None,
    keep: int | None,
) -> tuple[str, int, tuple[str, ...]]:
    files = {entry.name: entry for per_rank in hashed for entry in per_rank}
    for path in sorted(tmp.iterdir()):
        if path.name not in files:
            files[path.name] = hash_file(path)
    manifest = Manifest(
        step=step,
        model=jsonable(dict(model)),
        layout=layout or Layout(world_size=len(hashed)),
        config=jsonable(dict(config or {})),
        trainer=jsonable(dict(trainer or {})),
        files=tuple(files[name] for name in sorted(files)),
        format_version=FORMAT_VERSION,
    )
    write_manifest(tmp, manifest)
    if os.environ.get(KILL_BEFORE_RENAME_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)

    final = root / step_dir_name(step)
    removed: list[Path] = []
    if final.exists():
        # Saving a step again (a run resumed from an older checkpoint): move the old one
        # aside first, since a rename cannot replace a non-empty directory.
        aside = root / f"{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        final.rename(aside)
    tmp.rename(final)
    fsync_dir(root)
    removed.extend(_prune(root, keep, step))
    total = sum(f.size for f in manifest.files)
    return str(final), total, tuple(str(p) for p in removed)


def _prune(root: Path, keep: int | None, step: int) -> list[Path]:
    found = list_checkpoints(root)
    doomed = list(found.partial)
    if keep is not None:
        # Count back from the checkpoint just saved. A later step is left over from before
        # a resume that fell back past it (damaged): counting it as the newest would delete
        # the save just made, and with keep=1 every save of the run.
        upto = [path for saved, path in found.complete if saved <= step]
        doomed.extend(upto[:-keep])
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
