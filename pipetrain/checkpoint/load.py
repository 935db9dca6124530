"""Load a checkpoint into any layout, after verifying every file; resume from the newest
valid one of a directory, falling back past damaged ones."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from pipetrain.checkpoint import state
from pipetrain.checkpoint.comm import Comm, as_modules, jsonable, quiet_single_process
from pipetrain.checkpoint.directory import CheckpointList, list_checkpoints, log
from pipetrain.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIncompatibleError,
)
from pipetrain.checkpoint.manifest import (
    FORMAT_VERSION,
    Manifest,
    Verification,
    check_files,
    verify_checkpoint,
)
from pipetrain.errors import on_every_rank

__all__ = [
    "LoadResult",
    "check_model",
    "dcp_read",
    "load_checkpoint",
    "resume_checkpoint",
    "tensor_metadata",
]


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


def _verify(path: Path, comm: Comm, *, checksums: bool, threads: int = 1) -> Verification:
    """Collective verification with the hashing shared out: rank 0 checks the marker,
    the manifest and the sizes, then every rank hashes every ``size``-th file (``threads``
    of them at once)."""
    first: Verification | None = (
        verify_checkpoint(path, checksums=False) if comm.rank == 0 else None
    )
    first = comm.broadcast(first)
    assert isinstance(first, Verification)
    if not checksums or not first.ok or first.manifest is None:
        return first
    files = first.manifest.files
    share = list(range(comm.rank, len(files), comm.size))
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(share)))) as pool:
        found = pool.map(lambda i: check_files(path, [files[i]], checksums=True), share)
        mine = [(i, p) for i, problems in zip(share, found, strict=True) for p in problems]
    problems = sorted(p for per_rank in comm.all_gather(mine) for p in per_rank)
    return Verification(path, tuple(problem for _, problem in problems), first.manifest)


def check_model(manifest: Manifest, model: Mapping[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another model, naming the first field that differs.

    A field the checkpoint does not name was added to the model's settings after it was
    saved: it holds that field's default (a checkpoint from before Llama 3 rope scaling
    and q/k/v biases existed is a model without them)."""
    defaults = _model_defaults()
    for name in sorted(set(manifest.model) | set(model)):
        saved = manifest.model.get(name, defaults.get(name))
        now = jsonable(model.get(name))
        if saved != now:
            raise CheckpointIncompatibleError(
                f"{path} holds a model with {name}={saved!r} but this run has {name}={now!r}; "
                "use the checkpoint's model settings or another checkpoint directory"
            )


def _model_defaults() -> dict[str, Any]:
    from pipetrain.models.config import ModelConfig

    return {
        f.name: jsonable(f.default)
        for f in dataclasses.fields(ModelConfig)
        if f.default is not dataclasses.MISSING
    }


def tensor_metadata(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Key -> (size, dtype) of every tensor in a checkpoint, read from DCP's metadata."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        # DCP's metadata is a pickle: a damaged one fails with whatever the unpickler
        # trips on (UnpicklingError, KeyError, AttributeError, ...), not one known type.
        raise CheckpointCorruptError(
            f"{path / '.metadata'}: unreadable ({type(exc).__name__}: {exc}); "
            "the checkpoint is damaged, use an earlier one"
        ) from None
    return {
        key: (item.size, item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def dcp_read(path: Path, targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` from the checkpoint in this process alone (no process group)."""
    try:
        with quiet_single_process():
            dcp_load(targets, storage_reader=FileSystemReader(str(path)), no_dist=True)
    except CheckpointException as exc:  # a BaseException: `except Exception` misses it
        raise CheckpointCorruptError(f"loading {path} failed: {exc}") from None


def load_checkpoint(
    path: Path | str,
    *,
    modules: nn.Module | Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    model: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    restore_rng: bool = True,
    checksums: bool = True,
    threads: int = 1,
    group: Any = None,
) -> LoadResult:
    """Collective: load a verified checkpoint into this rank's stage modules (any layout).

    Every file's checksum is verified first, the hashing shared by the ranks (sizes
    only with ``checksums=False``, for a checkpoint verified just before); a damaged or missing file raises
    CheckpointCorruptError naming it, another format version or a different ``model``
    config raises CheckpointIncompatibleError naming the field.
    """
    start = time.perf_counter()
    comm = Comm.of(group)
    path = Path(path)
    verification = _verify(path, comm, checksums=checksums, threads=threads)
    manifest = verification.manifest
    # The verification is rank 0's, broadcast: every rank refuses alike (rank 0 says it).
    if manifest is not None and manifest.format_version != FORMAT_VERSION:
        raise on_every_rank(
            CheckpointIncompatibleError(
                f"{path} has format_version {manifest.format_version} but this pipetrain reads "
                f"version {FORMAT_VERSION}; load it with the pipetrain that wrote it"
            )
        )
    if not verification.ok or manifest is None:
        raise on_every_rank(CheckpointCorruptError(verification.problems[0]))
    if model is not None:
        try:
            check_model(manifest, model, path)
        except CheckpointIncompatibleError as exc:
            raise on_every_rank(exc) from None

    available = tensor_metadata(path)
    index = state.index_parameters(as_modules(modules))
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
        with quiet_single_process():
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
    none). Damaged newer ones are skipped with a warning that names the file; when every
    checkpoint is damaged, CheckpointCorruptError says so rather than starting over."""
    comm = Comm.of(group)
    found = comm.broadcast(list_checkpoints(root) if comm.rank == 0 else None)
    assert isinstance(found, CheckpointList)
    if comm.rank == 0:
        for partial in found.partial:
            log.warning("ignoring %s: an unfinished save (the process stopped during it)", partial)
    choice: Path | None = None
    skipped: list[str] = []
    for _, path in reversed(found.complete):
        verification = _verify(path, comm, checksums=True)
        if verification.ok:
            choice = path
            break
        skipped.append(verification.problems[0])
        if comm.rank == 0:
            log.warning("skipping %s: %s", path, verification.problems[0])
    if choice is None and skipped:
        # Every rank verified the same files, so every rank raises. Starting from step 0
        # instead would quietly throw away the run the caller asked to continue.
        more = f" (and {len(skipped) - 1} more damaged)" if len(skipped) > 1 else ""
        raise on_every_rank(
            CheckpointCorruptError(
                f"no valid checkpoint in {root}: {skipped[0]}{more}; restore the damaged files, "
                "or move the checkpoints away (or pass another checkpoint directory) to start over"
            )
        )
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
