"""One live run per folder (``pipetrain.config.lock``, ``run_folder.announce``): a second
run is refused naming the holder, a killed holder leaves no stale lock, and the config is
written whole or not at all."""

from __future__ import annotations

import errno
import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipetrain.config import ConfigError, load_config
from pipetrain.config.lock import (
    LOCK_NAME,
    RANKS_LOCK_NAME,
    LockedFolder,
    RunLocked,
    lock_folders,
)
from pipetrain.config.run_folder import announce, lock_run, rank_zero_lock, run_folders


def _folder(path: Path) -> LockedFolder:
    return LockedFolder(path, path / LOCK_NAME, "run folder", "--name")


def _config(tmp_path: Path, **more: object):  # type: ignore[no-untyped-def]
    return load_config(
        overrides={"run.name": "r", "run.out_dir": str(tmp_path / "runs"), **more},
        check_paths=False,
    )


def test_a_second_lock_is_refused_naming_the_holders_pid_and_host(tmp_path: Path) -> None:
    held = lock_folders([_folder(tmp_path / "run")])
    with pytest.raises(RunLocked) as refused:
        lock_folders([_folder(tmp_path / "run")])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"the run folder {str(tmp_path / 'run')!r} is in use by a live run")
    assert f"process {os.getpid()} on this host" in message
    assert "pass another --name, wait for that run to end, or stop it" in message
    with pytest.raises(RunLocked, match=r"^--resume into a run that is still alive: .* held by"):
        lock_folders([_folder(tmp_path / "run")], resume=True)
    held.release()
    lock_folders([_folder(tmp_path / "run")]).release()  # free again


def test_all_or_nothing_and_the_same_lock_file_taken_once(tmp_path: Path) -> None:
    other = lock_folders([_folder(tmp_path / "b")])
    with pytest.raises(RunLocked):
        lock_folders([_folder(tmp_path / "a"), _folder(tmp_path / "b")])
    # "a" was let go when "b" was refused.
    lock_folders([_folder(tmp_path / "a")]).release()
    other.release()
    # A folder named twice (two spellings of one path) is one lock, not a self-refusal.
    same = tmp_path / "a" / ".." / "a"
    lock_folders([_folder(tmp_path / "a"), _folder(same)]).release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from pipetrain.config.lock import LOCK_NAME, LockedFolder, lock_folders
        path = Path({str(tmp_path / "run")!r})
        lock = lock_folders([LockedFolder(path, path / LOCK_NAME, "run folder", "--name")])
        print("locked", flush=True)
        time.sleep(60)
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(RunLocked, match=f"process {holder.pid} on this host"):
            lock_folders([_folder(tmp_path / "run")])
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        holder.kill()
    lock_folders([_folder(tmp_path / "run")]).release()  # the kernel let it go
    assert socket.gethostname() in (tmp_path / "run" / LOCK_NAME).read_text()


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"the run folder .*file/run.* cannot be written"):
        lock_folders([_folder(blocker / "run")])


def test_announce_locks_the_run_folder_checkpoints_and_outside_metrics(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        **{"run.checkpoint_dir": str(tmp_path / "ck"), "run.metrics": str(tmp_path / "m.jsonl")},
    )
    assert [f.label for f in run_folders(config)] == [
        "run folder",
        "checkpoint directory",
        "metrics file",
    ]
    with announce(config, io.StringIO()):
        text = (config.run_dir / "config.toml").read_text()
        for folder in run_folders(config):
            with pytest.raises(RunLocked, match=f"pass another {folder.flag},"):
                lock_folders([folder])
        second = _config(tmp_path, **{"run.name": "s", "run.checkpoint_dir": str(tmp_path / "ck")})
        with pytest.raises(RunLocked, match="the checkpoint directory"):
            announce(second, io.StringIO())
        assert not (second.run_dir / "config.toml").exists()
        # The second run's own folder was let go again with its refusal.
        lock_folders([run_folders(second)[0]]).release()
    assert (config.run_dir / "config.toml").read_text() == text
    # Metrics inside the run folder are the folder's: no lock file of their own.
    assert [f.label for f in run_folders(_config(tmp_path))] == ["run folder"]


def test_a_config_that_cannot_be_written_leaves_none_and_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ConfigError) as refused:
        announce(config, io.StringIO())
    assert str(refused.value) == (
        f"{config.run_dir / 'config.toml'} cannot be written (No space left on device): free "
        "space on its disk, or choose another --name (or --set run.out_dir=DIR)"
    )
    assert sorted(p.name for p in config.run_dir.iterdir()) == [LOCK_NAME, RANKS_LOCK_NAME]
    monkeypatch.undo()
    announce(config, io.StringIO()).release()  # the lock went with the failure


def test_ranks_that_outlive_their_launcher_keep_the_folder_until_they_are_gone(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, **{"run.checkpoint_dir": str(tmp_path / "ck")})
    launcher = lock_run(config)
    launcher.hand_over()  # the ranks start: rank 0 takes their locks
    rank_zero = rank_zero_lock(config, io.StringIO(), announced=True)
    launcher.release()  # the launcher is killed; its rank 0 still finishes and saves
    with pytest.raises(RunLocked, match=f"the run folder .*process {os.getpid()} on this host"):
        lock_run(config)
    with pytest.raises(RunLocked, match="--resume into a run that is still alive"):
        lock_run(
            _config(tmp_path, **{"run.resume": True, "run.checkpoint_dir": str(tmp_path / "ck")})
        )
    rank_zero.release()
    lock_run(config).release()
