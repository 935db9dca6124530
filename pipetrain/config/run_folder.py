"""A run's folder and its earlier runs: the first write of a run, and what it refuses.

``announce`` runs once per run, before any rank writes (in the launcher, in the one
process, or on rank 0 under torchrun before the rendezvous), so its checks are the only
ones needed: a run folder, checkpoint directory or metrics file that a live run holds is
refused (``pipetrain.config.lock``), a run without --resume never replaces an earlier
run's metrics or checkpoints, and a --resume that finds no checkpoint keeps the earlier
attempt's metrics in a file of their own.

The process that announces holds the run's locks until the run ends: the launcher for the
ranks it starts, the one process, or rank 0 under torchrun (whose death ends the run
anyway: its peers stop when it is lost).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import IO

from pipetrain.checkpoint.directory import list_checkpoints
from pipetrain.checkpoint.trainer import earlier_checkpoints_error
from pipetrain.config.load import config_to_toml
from pipetrain.config.lock import (
    LOCK_NAME,
    RANKS_LOCK_NAME,
    LockedFolder,
    RunLock,
    lock_folders,
)
from pipetrain.config.schema import ConfigError, TrainConfig
from pipetrain.errors import InputError

__all__ = [
    "announce",
    "earlier_run_error",
    "free_name",
    "lock_run",
    "rank_zero_lock",
    "run_folders",
]


def announce(config: TrainConfig, out: IO[str], lock: RunLock | None = None) -> RunLock:
    """Print the resolved config and save it with the run (rank 0, once per run); the run's
    locks (``lock``, or taken here: ``lock_run``), which the caller holds until it ends.

    The first write of a run, so it first refuses a run that would replace an earlier
    one's checkpoints or metrics (the same --checkpoint-dir, --name or --metrics without
    --resume), and moves aside the metrics of a run resumed with no checkpoint to resume
    from: every rank of a run reaches the process group's rendezvous before the first
    metrics line is written, and the launcher announces before it starts any rank, so one
    check here suffices.
    """
    held = lock if lock is not None else lock_run(config)
    try:
        for folder in held.unsupported:
            out.write(
                f"warning: {folder} is on a file system without file locks: nothing stops "
                f"a second run from writing into it at the same time\n"
            )
        refusal = earlier_run_error(config)
        if refusal is not None:
            raise refusal
        _set_aside_restarted_metrics(config, out)
        path = config.run_dir / "config.toml"
        text = config_to_toml(config)
        _write_whole(path, text)
        out.write(f"# resolved config, saved to {path}\n{text}\n")
        out.flush()
    except BaseException:
        if lock is None:
            held.release()
        raise
    return held


def lock_run(config: TrainConfig) -> RunLock:
    """Lock the run's folders (``run_folders``), the launcher's locks and the ranks', before
    anything reads or writes them: a live run in any of them is refused, naming its pid
    and host. A launcher hands the ranks' locks over (``RunLock.hand_over``) just before
    it starts them."""
    folders = run_folders(config) + run_folders(config, ranks=True)
    return lock_folders(folders, resume=config.run.resume)


def rank_zero_lock(config: TrainConfig, out: IO[str], *, announced: bool) -> RunLock:
    """The locks rank 0 holds for the whole run: all of them, taken as it announces the
    run (one process, torchrun), or the ranks' locks its launcher handed over."""
    if not announced:
        return announce(config, out)
    return lock_folders(run_folders(config, ranks=True), resume=config.run.resume)


def run_folders(config: TrainConfig, *, ranks: bool = False) -> list[LockedFolder]:
    """What one live run owns: its folder, its checkpoint directory, and its metrics file
    where --metrics puts it outside the folder (its lock file beside it); ``ranks``: the
    ranks' lock files of them (``pipetrain.config.lock``)."""
    name = RANKS_LOCK_NAME if ranks else LOCK_NAME
    run_dir = config.run_dir
    folders = [LockedFolder(run_dir, run_dir / name, "run folder", "--name", ranks)]
    if config.run.checkpoint_dir:
        directory = Path(config.run.checkpoint_dir)
        folders.append(
            LockedFolder(
                directory, directory / name, "checkpoint directory", "--checkpoint-dir", ranks
            )
        )
    metrics = config.metrics_path
    if metrics.parent.resolve() != run_dir.resolve():
        lock_path = metrics.with_name(f".{metrics.name}{name.removeprefix('.pipetrain')}")
        folders.append(LockedFolder(metrics, lock_path, "metrics file", "--metrics", ranks))
    return folders


def _write_whole(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file renamed over it: a full disk leaves the old
    file or none, never an empty or cut one; a failure is one line."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())  # the data on disk before the name points to it
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(
            f"{path} cannot be written ({exc.strerror}): free space on its disk, or choose "
            f"another --name (or --set run.out_dir=DIR)"
        ) from None


def earlier_run_error(config: TrainConfig) -> InputError | None:
    """Why this run would replace (or mix itself into) an earlier run's metrics or
    checkpoints; None when it would not."""
    path = config.metrics_path
    if path.is_dir():
        # Its size is the folder's, which would read as "an earlier run's metrics".
        return ConfigError(
            f"run.metrics {str(path)!r} is a directory: pass --metrics with a file path, "
            f"or choose another --name"
        )
    written = _holds_records(path)
    directory = config.run.checkpoint_dir
    if config.run.resume:
        return None  # it continues its own run (``_set_aside_restarted_metrics``)
    if directory:
        # The trainer checks again on rank 0 (a run started without this announcement);
        # here it is refused before anything of the run is written.
        refusal = earlier_checkpoints_error(directory)
        if refusal is not None:
            return refusal
    if written:
        return ConfigError(
            f"run.metrics {str(path)!r} already holds an earlier run's metrics: pass --resume "
            f"with that run's --checkpoint-dir to continue it, choose another --name (or "
            f"--metrics), or move the file away"
        )
    own = config.run_dir / "metrics.jsonl"
    if own != path and _holds_records(own):
        # Metrics sent elsewhere (--metrics) still leave config.toml in the run folder,
        # where it would replace the earlier run's, next to that run's metrics.
        return ConfigError(
            f"{config.run_dir} holds an earlier run (its {own.name}), whose config.toml this "
            f"run would replace: choose another --name, or move that folder away"
        )
    return None


def _set_aside_restarted_metrics(config: TrainConfig, out: IO[str]) -> None:
    """A --resume that finds no checkpoint trains from step 0, as documented: a job that
    its scheduler restarts with --resume before the first save must start again rather
    than stop. Appended to the earlier attempt's records, its steps would make two
    trajectories in one file, so those records are moved to a file of their own."""
    path = config.metrics_path
    if not (config.run.resume and _holds_records(path)):
        return
    if list_checkpoints(config.run.checkpoint_dir).complete:
        return
    aside = free_name(path, "before")
    path.rename(aside)
    out.write(
        f"note: --resume found no checkpoint in {config.run.checkpoint_dir}, so this run "
        f"starts from step 0; the metrics already in {path} were moved to {aside}\n"
    )


def _holds_records(path: Path) -> bool:
    """Whether a metrics file has any content (a run refused before its first record
    leaves an empty one, which loses nothing)."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False  # none yet (or unreadable: MetricsFile names that problem)


def free_name(path: Path, label: str) -> Path:
    """``<stem>.<label>-<date-time>[-n]<suffix>`` beside ``path``, not taken yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = path.with_name(f"{path.stem}.{label}-{stamp}{path.suffix}")
    n = 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}.{label}-{stamp}-{n}{path.suffix}")
    return candidate
