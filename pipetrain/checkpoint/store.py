"""Save and load checkpoints: crash-safe, verified, and independent of the layout.

Save protocol (every rank calls ``save_checkpoint`` with its own stage modules):

1. rank 0 creates ``ROOT/step_000123.tmp-<nonce>/`` and tells every rank its name;
2. every rank writes and fsyncs its own part with torch.distributed.checkpoint (no
   gathering of tensors) and hashes the files it wrote;
3. rank 0 writes ``manifest.json`` (sha256 and size of every file, format version, model
   config, layout, run config, trainer state) and the ``COMPLETE`` marker, fsyncs them,
   and renames the directory to ``ROOT/step_000123/`` in one atomic step;
4. rank 0 removes checkpoints beyond ``keep`` and the leftovers of crashed saves.

A process killed before step 3 ends leaves only a ``.tmp-`` directory, which loading
ignores with a warning: the previous checkpoint stays the newest valid one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipetrain.checkpoint import state
from pipetrain.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompatibleError,
)
from pipetrain.checkpoint.manifest import (
    FORMAT_VERSION,
    FileEntry,
    Layout,
    Manifest,
    Verification,
    check_files,
    fsync_dir,
    hash_file,
    verify_checkpoint,
    write_manifest,
)

__all__ = [
    "KILL_BEFORE_RENAME_ENV",
    "CheckpointList",
    "LoadResult",
    "ResumeChoice",
    "SaveResult",
    "check_model",
    "choose_resume",
    "dcp_read",
    "list_checkpoints",
    "load_checkpoint",
    "resume_checkpoint",
    "save_checkpoint",
    "tensor_metadata",
]

log = logging.getLogger("pipetrain.checkpoint")

# Test hook: when set to a step number, rank 0 kills its own process with SIGKILL at that
# step's save, after every file and the manifest are written but before the rename: the
# worst moment for a crash, which the crash-safety test needs to hit exactly.
KILL_BEFORE_RENAME_ENV = "PIPETRAIN_CHECKPOINT_KILL_BEFORE_RENAME"

_NAME = re.compile(r"^step_(\d+)$")
_TMP = re.compile(r"^step_(\d+)\.tmp-[0-9a-f]+$")


def _step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


@dataclass(frozen=True)
class _Comm:
    """The process group a collective save/load runs over; a lone process without
    torch.distributed is a group of one."""

    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, group: Any) -> _Comm:
        if dist.is_available() and dist.is_initialized():
            return cls(group, dist.get_rank(group), dist.get_world_size(group))
        return cls(None, 0, 1)

    @property
    def distributed(self) -> bool:
        return self.size > 1 or (dist.is_available() and dist.is_initialized())

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` on every rank, in rank order."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` on rank 0 (an empty list elsewhere)."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.size if self.rank == 0 else []
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather_object(value, out if self.rank == 0 else None, dst=dst, group=self.group)
        return out


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without torch.distributed; one process is a supported use.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass(frozen=True)
class SaveResult:
    path: Path
    step: int
    bytes: int  # all files of the checkpoint, every rank's
    seconds: float
    removed: tuple[Path, ...] = field(default=())  # pruned by ``keep`` or crash leftovers


@dataclass(frozen=True)
class LoadResult:
    path: Path
    manifest: Manifest
    seconds: float
    # Named generators the checkpoint did not hold (their state was left as it was).
    missing_generators: tuple[str, ...] = field(default=())

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def trainer(self) -> Mapping[str, Any]:
        return self.manifest.trainer


@dataclass(frozen=True)
class CheckpointList:
    complete: tuple[tuple[int, Path], ...]  # (step, path), oldest first
    partial: tuple[Path, ...]  # leftovers of saves that did not finish


@dataclass(frozen=True)
class ResumeChoice:
    path: Path | None  # the newest valid checkpoint; None when there is none
    skipped: tuple[str, ...]  # one line per newer checkpoint that failed verification


def list_checkpoints(root: Path | str) -> CheckpointList:
    root = Path(root)
    complete: list[tuple[int, Path]] = []
    partial: list[Path] = []
    if root.is_dir():
        for entry in root.iterdir():
            if not entry.is_dir():
                continue
            if match := _NAME.match(entry.name):
                complete.append((int(match.group(1)), entry))
            elif _TMP.match(entry.name):
                partial.append(entry)
    return CheckpointList(tuple(sorted(complete)), tuple(sorted(partial)))


def choose_resume(root: Path | str, *, checksums: bool = True) -> ResumeChoice:
    """The newest checkpoint under ``root`` that verifies; newer ones that do not are
    reported (and logged) as skipped, as are partial saves."""
    found = list_checkpoints(root)
    for path in found.partial:
        log.warning("ignoring %s: an unfinished save (the process stopped during it)", path)
    skipped: list[str] = []
    for _, path in reversed(found.complete):
        verification = verify_checkpoint(path, checksums=checksums)
        if verification.ok:
            if skipped:
                log.warning("falling back to %s, the newest valid checkpoint", path)
            return ResumeChoice(path, tuple(skipped))
        line = f"skipping {path}: {verification.problems[0]}"
        log.warning("%s", line)
        skipped.append(line)
    return ResumeChoice(None, tuple(skipped))


def _verify(path: Path, comm: _Comm, *, checksums: bool) -> Verification:
    """Collective verification with the hashing shared out: rank 0 checks the marker,
    the manifest and the sizes, then every rank hashes every ``size``-th file."""
    first: Verification | None = (
        verify_checkpoint(path, checksums=False) if comm.rank == 0 else None
    )
    first = comm.broadcast(first)
    assert isinstance(first, Verification)
    if not checksums or not first.ok or first.manifest is None:
        return first
    files = first.manifest.files
    mine = [
        (i, problem)
        for i in range(comm.rank, len(files), comm.size)
        for problem in check_files(path, [files[i]], checksums=True)
    ]
    problems = sorted(p for per_rank in comm.all_gather(mine) for p in per_rank)
    return Verification(path, tuple(problem for _, problem in problems), first.manifest)


def check_model(manifest: Manifest, model: Mapping[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another model, naming the first field that differs."""
    for name in sorted(set(manifest.model) | set(model)):
        saved, now = manifest.model.get(name), _jsonable(model.get(name))
        if saved != now:
            raise CheckpointIncompatibleError(
                f"{path} holds a model with {name}={saved!r} but this run has {name}={now!r}; "
                "use the checkpoint's model settings or another checkpoint directory"
            )


def _jsonable(value: Any) -> Any:
    """A value as it reads back from the manifest's JSON (tuples become lists)."""
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def tensor_metadata(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Key -> (size, dtype) of every tensor in a checkpoint, read from DCP's metadata."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise CheckpointCorruptError(f"{path / '.metadata'}: unreadable ({exc})") from None
    return {
        key: (item.size, item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def dcp_read(path: Path, targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` from the checkpoint in this process alone (no process group)."""
    try:
        with _quiet_single_process():
            dcp_load(targets, storage_reader=FileSystemReader(str(path)), no_dist=True)
    except CheckpointException as exc:  # a BaseException: `except Exception` misses it
        raise CheckpointCorruptError(f"loading {path} failed: {exc}") from None


def _as_list(modules: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [modules] if isinstance(modules, nn.Module) else list(modules)


def _hash_own_files(directory: Path, rank: int) -> list[FileEntry]:
    # DCP names each rank's data files "__<rank>_<n>.distcp": each rank hashes its own,
    # in parallel with the others, so rank 0 does not read the whole checkpoint.
    return [hash_file(p) for p in sorted(directory.glob(f"__{rank}_*.distcp"))]


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
    group: Any = None,
) -> SaveResult:
    """Collective: every rank of ``group`` calls it with its own stage modules.

    ``model`` is the model config (checked field by field on load); ``trainer`` is
    JSON-able state such as the LR schedule's ``state_dict()`` and the data position;
    ``generators`` are named torch generators (the data sampler's) saved per rank.
    """
    if step < 0:
        raise CheckpointError(f"step is {step}; a checkpoint step must be >= 0")
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep is {keep}; keep at least 1 checkpoint, or leave it unset")
    start = time.perf_counter()
    comm = _Comm.of(group)
    root = Path(root)
    tmp_name = ""
    if comm.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp_name = f"{_step_dir_name(step)}.tmp-{uuid.uuid4().hex[:12]}"
        (root / tmp_name).mkdir()
    tmp = root / comm.broadcast(tmp_name)

    index = state.index_parameters(_as_list(modules))
    entries = state.model_entries(index)
    if optimizer is not None:
        entries.update(state.optimizer_entries(optimizer, index))
    entries.update(state.rng_entries(comm.rank, generators or {}))
    try:
        with _quiet_single_process():
            dcp_save(
                entries,
                storage_writer=FileSystemWriter(str(tmp), sync_files=True),
                process_group=comm.group,
                no_dist=not comm.distributed,
            )
    except CheckpointException as exc:  # a BaseException: `except Exception` misses it
        raise CheckpointError(f"saving step {step} into {tmp} failed: {exc}") from None

    hashed = comm.gather(_hash_own_files(tmp, comm.rank))
    outcome: tuple[str, int, tuple[str, ...]] | str = ""
    if comm.rank == 0:
        try:
            outcome = _finish_save(root, tmp, step, hashed, model, layout, config, trainer, keep)
        except OSError as exc:
            outcome = f"finishing the save of step {step} in {tmp} failed: {exc}"
    # Doubles as the barrier: no rank returns before the checkpoint is visible.
    outcome = comm.broadcast(outcome)
    if isinstance(outcome, str):
        raise CheckpointError(outcome)
    final, total, removed = outcome
    return SaveResult(
        Path(final), step, total, time.perf_counter() - start, tuple(Path(p) for p in removed)
    )


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
        model=_jsonable(dict(model)),
        layout=layout or Layout(world_size=len(hashed)),
        config=_jsonable(dict(config or {})),
        trainer=_jsonable(dict(trainer or {})),
        files=tuple(files[name] for name in sorted(files)),
        format_version=FORMAT_VERSION,
    )
    write_manifest(tmp, manifest)
    if os.environ.get(KILL_BEFORE_RENAME_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)

    final = root / _step_dir_name(step)
    removed: list[Path] = []
    if final.exists():
        # Saving a step again (a run resumed from an older checkpoint): move the old one
        # aside first, since a rename cannot replace a non-empty directory.
        aside = root / f"{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        final.rename(aside)
    tmp.rename(final)
    fsync_dir(root)
    removed.extend(_prune(root, keep))
    total = sum(f.size for f in manifest.files)
    return str(final), total, tuple(str(p) for p in removed)


def _prune(root: Path, keep: int | None) -> list[Path]:
    found = list_checkpoints(root)
    doomed = list(found.partial)
    if keep is not None:
        doomed.extend(path for _, path in found.complete[:-keep])
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def load_checkpoint(
    path: Path | str,
    *,
    modules: nn.Module | Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    model: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    restore_rng: bool = True,
    checksums: bool = True,
    group: Any = None,
) -> LoadResult:
    """Collective: load a verified checkpoint into this rank's stage modules (any layout).

    Every file's checksum is verified first, the hashing shared by the ranks (sizes
    only with ``checksums=False``, for a checkpoint verified just before); a damaged or missing file raises
    CheckpointCorruptError naming it, another format version or a different ``model``
    config raises CheckpointIncompatibleError naming the field.
    """
    start = time.perf_counter()
    comm = _Comm.of(group)
    path = Path(path)
    verification = _verify(path, comm, checksums=checksums)
    manifest = verification.manifest
    if manifest is not None and manifest.format_version != FORMAT_VERSION:
        raise CheckpointIncompatibleError(
            f"{path} has format_version {manifest.format_version} but this pipetrain reads "
            f"version {FORMAT_VERSION}; load it with the pipetrain that wrote it"
        )
    if not verification.ok or manifest is None:
        raise CheckpointCorruptError(verification.problems[0])
    if model is not None:
        check_model(manifest, model, path)

    available = tensor_metadata(path)
    index = state.index_parameters(_as_list(modules))
    targets = state.model_entries(index)
    for key, tensor in targets.items():
        if key not in available:
            raise CheckpointIncompatibleError(
                f"{path} has no tensor {key[len(state.MODEL) :]!r}; "
                "the checkpoint is of another model"
            )
        size, _ = available[key]
        if tuple(size) != tuple(tensor.shape):
            raise CheckpointIncompatibleError(
                f"{path}: {key[len(state.MODEL) :]} has shape {tuple(size)} in the checkpoint, "
                f"{tuple(tensor.shape)} here; the checkpoint is of another model shape"
            )
    if optimizer is not None:
        targets.update(state.optimizer_targets(optimizer, index, available))
    # Each rank's random streams only mean something under the same world size; under
    # another layout every rank takes rank 0's (same data order, fresh per-rank noise).
    rng_rank = comm.rank if manifest.layout.world_size == comm.size else 0
    if restore_rng:
        targets.update(state.rng_targets(rng_rank, available))
    try:
        with _quiet_single_process():
            dcp_load(
                targets,
                storage_reader=FileSystemReader(str(path)),
                process_group=comm.group,
                no_dist=not comm.distributed,
            )
    except CheckpointException as exc:  # a BaseException: `except Exception` misses it
        raise CheckpointCorruptError(f"loading {path} failed: {exc}") from None
    state.copy_tied(index)
    if optimizer is not None:
        state.apply_optimizer_state(optimizer, index, targets)
    missing: tuple[str, ...] = ()
    if restore_rng:
        missing = state.apply_rng_state(rng_rank, targets, generators or {})
    return LoadResult(path, manifest, time.perf_counter() - start, missing)


def resume_checkpoint(
    root: Path | str,
    *,
    modules: nn.Module | Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    model: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    group: Any = None,
) -> LoadResult | None:
    """Collective: load the newest valid checkpoint under ``root`` (None when there is
    none). Damaged newer ones are skipped with a warning that names the file."""
    comm = _Comm.of(group)
    found = comm.broadcast(list_checkpoints(root) if comm.rank == 0 else None)
    assert isinstance(found, CheckpointList)
    if comm.rank == 0:
        for partial in found.partial:
            log.warning("ignoring %s: an unfinished save (the process stopped during it)", partial)
    choice: Path | None = None
    for _, path in reversed(found.complete):
        verification = _verify(path, comm, checksums=True)
        if verification.ok:
            choice = path
            break
        if comm.rank == 0:
            log.warning("skipping %s: %s", path, verification.problems[0])
    if choice is None:
        return None
    if comm.rank == 0 and choice != found.complete[-1][1]:
        log.warning("falling back to %s, the newest valid checkpoint", choice)
    return load_checkpoint(
        choice,
        modules=modules,
        optimizer=optimizer,
        model=model,
        generators=generators,
        checksums=False,  # every file was hashed just above
        group=group,
    )
