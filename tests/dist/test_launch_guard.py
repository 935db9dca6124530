"""pipetrain.launch.guard in small processes (no torch): a step that outlives its grace
after SIGTERM ends the process, a released one does not, and a rank whose launcher was
killed stops by itself.

The "step" is the main thread asleep with SIGTERM blocked there, as a long op in C is:
the signal goes to another thread and Python runs no handler in the main thread until
the op returns. The handler only sets a flag, as the trainer's does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

STEP = textwrap.dedent(
    """
    import signal, sys, time
    from pipetrain.launch import guard

    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a flag, obeyed after the step
    grace = guard.StopGrace(float(sys.argv[1]))
    assert grace.start()
    if sys.argv[2] == "released":
        grace.release()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("in the step", flush=True)
    time.sleep(float(sys.argv[3]))
    print("the step ended", flush=True)
    """
)


def _rank_env(tmp_path: Path) -> dict[str, str]:
    return dict(
        os.environ,
        RANK="1",
        WORLD_SIZE="2",
        LOCAL_RANK="1",
        PIPETRAIN_EXIT_RECORDS=str(tmp_path / ".exit"),
    )


def _start(code: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() in ("in the step", "ready"), proc.stderr
    return proc


def test_a_step_that_outlives_its_grace_after_sigterm_ends_the_process(tmp_path: Path) -> None:
    proc = _start(STEP, "1", "armed", "60", env=_rank_env(tmp_path))
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == 143, (proc.returncode, err)
    assert 1.0 <= took < 10, took
    assert err == (
        "pipetrain train (rank 1): SIGTERM came 1 s ago, during a training step that has not "
        "ended: stopped without finishing or saving it (the checkpoints saved before stay; "
        "run.stop_grace_s sets how long a step may finish)\n"
    )
    assert "the step ended" not in out
    assert (tmp_path / ".exit" / "rank1").read_text() == "143\n"


def test_a_stop_obeyed_in_time_is_not_cut_short(tmp_path: Path) -> None:
    proc = _start(STEP, "0.5", "released", "2", env=_rank_env(tmp_path))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "the step ended" in out, (proc.returncode, err)


# A launcher that starts a "rank" and waits; the rank ignores SIGTERM altogether (Linux's
# parent-death signal then does nothing), so only the poll of its parent can stop it.
LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
    print(rank.pid, flush=True)
    time.sleep(600)
    """
)
ORPHAN = textwrap.dedent(
    """
    import signal, sys, time
    from pipetrain.launch import guard

    if sys.argv[1] == "ignores":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    guard.ORPHAN_LIMIT_S = 1.0
    assert guard.watch_launcher()
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("rank_does", ["ignores", "default"])
def test_a_rank_stops_soon_after_its_launcher_is_killed(tmp_path: Path, rank_does: str) -> None:
    env = {**_rank_env(tmp_path), "TORCHELASTIC_RUN_ID": "test"}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, ORPHAN, rank_does],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert launcher.stdout is not None
    rank = int(launcher.stdout.readline())
    time.sleep(1.0)  # the rank is watching
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(rank)
    if alive:
        os.kill(rank, signal.SIGKILL)
    assert not alive
    if rank_does == "ignores":
        assert (tmp_path / ".exit" / "rank1").read_text() == "143\n"


# The trainer's side: a run in one process (no group) that learns of the stop at the end
# of its step releases the grace, and its save may take longer than the grace.
OBEYED = textwrap.dedent(
    """
    import os, signal, time
    import torch
    from pipetrain.checkpoint.trainer import StopSignal

    stop = StopSignal(grace_s=0.5)
    print("in the step", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # the rest of the step
    assert stop.agreed(None, torch.device("cpu"))
    time.sleep(1.5)  # the save
    stop.close()
    print("saved", flush=True)
    """
)


def test_a_stop_obeyed_at_the_end_of_the_step_may_save_past_the_grace(tmp_path: Path) -> None:
    proc = _start(OBEYED, env=_rank_env(tmp_path))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "saved" in out, (proc.returncode, err)
