"""The manifest: what a checkpoint holds, and the checksum of every file in it.

A checkpoint directory is complete when it holds ``manifest.json`` and a ``COMPLETE``
marker whose content is the sha256 of the manifest; rank 0 writes both after every rank
has written and fsynced its own files, just before the directory is renamed into place.
Verification re-hashes every file listed, so a flipped byte or a missing file is found
and named before any tensor is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetrain.checkpoint.errors import CheckpointCorruptError

__all__ = [
    "COMPLETE_MARKER",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FileEntry",
    "Layout",
    "Manifest",
    "Verification",
    "check_files",
    "fsync_dir",
    "hash_file",
    "read_manifest",
    "verify_checkpoint",
    "write_manifest",
]

FORMAT_NAME = "pipetrain-checkpoint"
# Bump when the meaning of keys or files changes; a loader refuses any other version.
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
COMPLETE_MARKER = "COMPLETE"
_CHUNK = 1 << 22  # 4 MiB reads: hashing speed is bounded by the disk, not the call count


@dataclass(frozen=True)
class Layout:
    """How the model was split when the checkpoint was written (informative only:
    tensors are keyed by global names, so any other layout can load them)."""

    pp: int = 1  # pipeline ranks
    chunks: int = 1  # stages per rank (virtual stages)
    schedule: str = ""
    world_size: int = 1
    # stage -> global layer indices, in stage order
    stages: tuple[tuple[int, ...], ...] = ()
    tp: int = 1  # tensor-parallel ranks per stage (1 in checkpoints from before tp)

    def to_json(self) -> dict[str, Any]:
        return {
            "pp": self.pp,
            "chunks": self.chunks,
            "schedule": self.schedule,
            "world_size": self.world_size,
            "stages": [list(s) for s in self.stages],
            "tp": self.tp,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layout:
        return cls(
            pp=int(data.get("pp", 1)),
            chunks=int(data.get("chunks", 1)),
            schedule=str(data.get("schedule", "")),
            world_size=int(data.get("world_size", 1)),
            stages=tuple(tuple(int(i) for i in s) for s in data.get("stages", ())),
            tp=int(data.get("tp", 1)),
        )


@dataclass(frozen=True)
class FileEntry:
    name: str  # relative to the checkpoint directory
    size: int  # bytes
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    model: Mapping[str, Any]  # the model config: fields that must match to load
    layout: Layout
    config: Mapping[str, Any]  # the resolved run config, for inspect and resume
    trainer: Mapping[str, Any]  # JSON-able trainer state: LR schedule, data position, ...
    files: tuple[FileEntry, ...]
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "model": dict(self.model),
            "layout": self.layout.to_json(),
            "config": dict(self.config),
            "trainer": dict(self.trainer),
            "files": {f.name: {"size": f.size, "sha256": f.sha256} for f in self.files},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        files = tuple(
            FileEntry(name, int(v["size"]), str(v["sha256"]))
            for name, v in sorted(data["files"].items())
        )
        return cls(
            step=int(data["step"]),
            model=dict(data.get("model", {})),
            layout=Layout.from_json(data.get("layout", {})),
            config=dict(data.get("config", {})),
            trainer=dict(data.get("trainer", {})),
            files=files,
            format_version=int(data["format_version"]),
        )


@dataclass(frozen=True)
class Verification:
    """The outcome of checking a checkpoint directory against its manifest."""

    path: Path
    problems: tuple[str, ...]  # one line each, naming the file; empty when valid
    manifest: Manifest | None = field(default=None)

    @property
    def ok(self) -> bool:
        return not self.problems


def hash_file(path: Path) -> FileEntry:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(path.name, size, digest.hexdigest())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write the manifest, then the marker that names its hash; both fsynced, in that
    order, so a marker never points at a manifest that is not on disk."""
    text = json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode()
    _write_durably(directory / MANIFEST_NAME, text)
    _write_durably(directory / COMPLETE_MARKER, hashlib.sha256(text).hexdigest().encode())
    fsync_dir(directory)


def read_manifest(directory: Path) -> Manifest:
    """The manifest of a complete checkpoint; CheckpointCorruptError when it is absent,
    does not match its marker, or is not a manifest."""
    marker = directory / COMPLETE_MARKER
    path = directory / MANIFEST_NAME
    if not marker.is_file():
        raise CheckpointCorruptError(
            f"{marker}: missing, so {directory} is an incomplete save; "
            "resume from an earlier checkpoint"
        )
    if not path.is_file():
        raise CheckpointCorruptError(f"{path}: missing; resume from an earlier checkpoint")
    text = path.read_bytes()
    # Compared as bytes: a damaged marker need not be text at all.
    if hashlib.sha256(text).hexdigest().encode() != marker.read_bytes().strip():
        raise CheckpointCorruptError(
            f"{path}: sha256 differs from the one in {COMPLETE_MARKER}; the manifest is damaged"
        )
    try:
        data = json.loads(text)
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"format is {data.get('format')!r}")
        return Manifest.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{path}: not a {FORMAT_NAME} manifest ({exc})") from None


def verify_checkpoint(directory: Path | str, *, checksums: bool = True) -> Verification:
    """Check completeness, format version, and (with ``checksums``) every file's size and
    sha256. Never raises for a bad checkpoint: the problems come back, one line each."""
    directory = Path(directory)
    if not directory.is_dir():
        return Verification(directory, (f"{directory}: not a directory",))
    try:
        manifest = read_manifest(directory)
    except CheckpointCorruptError as exc:
        return Verification(directory, (str(exc),))
    problems: list[str] = []
    if manifest.format_version != FORMAT_VERSION:
        problems.append(
            f"{directory / MANIFEST_NAME}: format_version is {manifest.format_version}, "
            f"this pipetrain reads {FORMAT_VERSION}"
        )
    problems.extend(check_files(directory, manifest.files, checksums=checksums))
    return Verification(directory, tuple(problems), manifest)


def check_files(directory: Path, files: Sequence[FileEntry], *, checksums: bool) -> list[str]:
    """One line per file that is missing, of another size or (with ``checksums``) of
    another sha256 than its manifest entry."""
    problems: list[str] = []
    for entry in files:
        path = directory / entry.name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != entry.size:
            problems.append(f"{path}: {size} bytes, the manifest says {entry.size}")
            continue
        if checksums and hash_file(path).sha256 != entry.sha256:
            problems.append(f"{path}: sha256 differs from the manifest (the file is damaged)")
    return problems
