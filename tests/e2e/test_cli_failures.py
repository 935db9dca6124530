"""`pipetrain train --pp 2` when a rank dies: what the user sees and how the run ends.

A `sitecustomize` module on PYTHONPATH (Python imports it at start-up in every process)
kills rank 1 with SIGKILL where the run gathers every stage's weights for the text sample
at the end, a collective outside the pipeline's own waits. Rank 0 must exit 1 with one
line naming the lost peer, no traceback, and the launcher must exit non-zero, every
process of the run gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--pp", "2", "--steps", "1", "--batch-size", "4",
    "--seq-len", "16", "--microbatches", "2", "--set", "optim.warmup_steps=0",
    "--set", "run.sample_tokens=4", "--set", "data.eval_batches=1",
    "--set", "pipeline.threads=1", "--set", "pipeline.timeout_s=60",
]  # fmt: skip

# Rank 1 (and only a rank of the launch: the launcher has no RANK) dies on entering
# gather_state_dict, looked up where the trainer calls it.
KILL_RANK_1 = textwrap.dedent(
    """
    import os
    if os.environ.get("RANK") == "1":
        import signal
        import pipetrain.train.loop as loop

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        loop.gather_state_dict = die
    """
)


# Rank 1 dies (SIGKILL) on the stop signal instead of finishing its step.
DIE_ON_STOP_RANK_1 = textwrap.dedent(
    """
    import os
    if os.environ.get("RANK") == "1":
        import signal
        from pipetrain.checkpoint.trainer import StopSignal

        def die(self, signum, frame):
            os.kill(os.getpid(), signal.SIGKILL)

        StopSignal._handle = die
    """
)


# Rank 1 passes Ctrl-C to the launcher as it starts, as a user's would come: the launcher
# forwards it to both ranks while they set up, before any training step.
CTRL_C_AT_START = textwrap.dedent(
    """
    import os
    if os.environ.get("RANK") == "1":
        import signal
        import time
        import pipetrain.train.loop as loop

        def train(*args, **kwargs):
            os.kill(os.getppid(), signal.SIGINT)
            time.sleep(60)  # the forwarded signal ends this rank long before

        loop.train = train
    """
)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (ended, not yet reaped by whoever adopted it
    once its launcher died) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _describe(pid: int) -> str:
    """A process left running, for the failure message: its state, wait channel, command."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return f"{pid}: ended meanwhile"
    return f"{pid}: state {state}, waiting in {wchan or '-'}: {cmd}"


def _descendants(pid: int) -> list[int]:
    """Processes whose parent chain reaches ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def _train_with(work: Path, tmp_path: Path, site: str, flags: list[str]) -> subprocess.Popen[str]:
    """``pipetrain train`` in its own session, every process importing ``site`` first."""
    (tmp_path / "sitecustomize.py").write_text(site)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", "train", *flags, "--data", "data"],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )


def test_a_rank_killed_during_the_sample_ends_the_run_with_one_line(
    work: Path, tmp_path: Path
) -> None:
    proc = _train_with(work, tmp_path, KILL_RANK_1, [*TINY, "--name", "k"])
    workers: set[int] = set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        workers.update(_descendants(proc.pid))
        time.sleep(0.2)
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise

    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    # Training itself went through; the failure is in the sample's gather.
    assert "step 1/1" in out, out[-2000:]
    # Rank 0 learns of the loss from gloo at once and says so in one line. The launcher,
    # which polls its processes, may see rank 1's death first and stop rank 0 (SIGTERM:
    # the sample runs after training, where a stop ends the rank with a line of its own),
    # before or just after that line. Either way the launcher's own line names the rank
    # that died first.
    lines = [line for line in err.splitlines() if line.startswith("pipetrain train (rank 0)")]
    lost = [
        line
        for line in lines
        if re.fullmatch(
            r"pipetrain train \(rank 0\): rank 0: waiting on other ranks in gather_state_dict "
            r"\(pipetrain/train/sample\.py:\d+\): a peer was lost \(.*\)",
            line,
        )
    ]
    stop = (
        "pipetrain train (rank 0): stopped by SIGTERM outside the training steps "
        "(starting up, or after the last one): no step was cut short"
    )
    stopped = [line for line in lines if line == stop]
    assert len(lost) + len(stopped) == len(lines) >= 1, err[-3000:]
    assert len(lost) <= 1 and len(stopped) <= 1, err[-3000:]
    if stopped:
        assert "Sending process" in err and "closing signal SIGTERM" in err, err[-3000:]
    assert "pipetrain train: rank 1 was killed by SIGKILL first" in err, err[-3000:]
    # No process of the run outlives the launcher.
    assert workers, "the launcher started no process"
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert not alive, alive


def _as_rank_1(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)


def test_a_second_ctrl_c_stops_a_rank_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The worker's own handling, in this process: StopSignal raises KeyboardInterrupt on a
    # second Ctrl-C, wherever the rank is.
    from pipetrain.launch import worker
    from pipetrain.train import loop

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    _as_rank_1(monkeypatch)
    monkeypatch.setattr(loop, "train", interrupted)  # main imports it when it runs
    monkeypatch.setattr(worker, "watch_launcher", lambda: False)  # not on pytest
    # pytest's own faulthandler stays as it is (the worker's would want a real stderr).
    monkeypatch.setattr(worker.faulthandler, "enable", lambda: None)
    config = tmp_path / "config.toml"
    config.write_text("")
    assert worker.main(["pipetrain.train.loop:train", str(config)]) == 130
    assert capsys.readouterr().err == (
        "pipetrain train (rank 1): interrupted by a second Ctrl-C: the step in progress "
        "was neither finished nor saved\n"
    )


def test_an_unexpected_traceback_is_followed_by_the_rank_that_printed_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipetrain.launch import worker

    def bug(*args: object, **kwargs: object) -> int:
        raise ValueError("a bug\nwith a second line")

    _as_rank_1(monkeypatch)
    monkeypatch.setattr(worker, "main", bug)
    assert worker._run() == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):"), err
    assert err.endswith(
        "\npipetrain train (rank 1): failed on ValueError: a bug (the traceback above says where)\n"
    ), err


def test_the_launcher_blames_the_killed_rank_not_the_peer_that_lost_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Both failures seen in the same poll (same whole-second timestamp), the peer that
    # reported the loss first in the mapping, as the elastic agent gives them.
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pipetrain.launch.local import LaunchFailed, launch_local

    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file="<N/A>"),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGKILL, error_file="<N/A>"),
    }
    for failure in failures.values():
        failure.timestamp = 1_000

    def launch(config: object, entrypoint: object) -> object:
        def run(*args: str) -> None:
            raise ChildFailedError("pipetrain.launch.worker", failures)

        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", launch)
    with pytest.raises(LaunchFailed) as caught:
        launch_local(tmp_path / "config.toml", 2, entry="pipetrain.train.loop:train")
    assert str(caught.value) == (
        "rank 1 was killed by SIGKILL first (exit status -9); 2 of 2 processes failed"
    )
    assert caught.value.exit_code == 1


@pytest.mark.parametrize(
    ("signals", "rank_1"),
    [
        (1, "rank 1 was killed before it finished"),
        (2, "rank 1 was killed before it finished"),
        # The third ends the launcher's wait: rank 1 runs on and saves after the line.
        (3, "rank 1 had not finished (it may still be finishing its step and saving, with "
            "output after this line)"),
    ],
)  # fmt: skip
def test_the_launcher_stopped_again_does_not_call_a_running_rank_killed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, signals: int, rank_1: str
) -> None:
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from pipetrain.launch.local import LaunchFailed, launch_local
    from pipetrain.launch.process_exit import exit_record

    config = tmp_path / "config.toml"

    def launch(launch_config: object, entrypoint: object) -> object:
        def run(*args: str) -> None:
            # Rank 0 finished; rank 1 left no record. Each signal comes while the launcher
            # handles the one before, as torch's handler raises them.
            exit_record(config, 0).parent.mkdir()
            exit_record(config, 0).write_text("0\n")
            last: BaseException | None = None
            for _ in range(signals):
                exc = SignalException("signalled", sigval=signal.SIGINT)
                exc.__context__ = last
                last = exc
            assert last is not None
            raise last

        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", launch)
    with pytest.raises(LaunchFailed) as failed:
        launch_local(config, 2, entry="pipetrain.train.loop:train")
    assert str(failed.value) == (
        f"stopped by signal SIGINT, but not cleanly: {rank_1} "
        "(the last checkpoint may be older than the last step)"
    )


def test_a_stop_that_a_rank_does_not_survive_is_not_a_clean_exit(
    work: Path, tmp_path: Path
) -> None:
    # SIGTERM/Ctrl-C to the launcher: the ranks should finish the step and exit 0 (then
    # so does the launcher). Here rank 1 dies instead: the launcher must say so, status 1.
    flags = [*TINY, "--steps", "100000", "--set", "run.eval_every=0", "--name", "s"]
    proc = _train_with(work, tmp_path, DIE_ON_STOP_RANK_1, flags)
    metrics = work / "runs" / "s" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and '"loss"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert re.search(
        r"^pipetrain train: stopped by signal SIGINT, but not cleanly: .*"
        r"rank 1 was killed before it finished",
        err,
        re.MULTILINE,
    ), err[-3000:]


def test_a_stop_before_the_first_step_is_one_line_per_rank_and_a_clean_exit(
    work: Path, tmp_path: Path
) -> None:
    # No step can be cut short before the first: each rank says so and exits 0, as does
    # the launcher (it was a KeyboardInterrupt traceback, or death by SIGTERM, per rank
    # and "stopped ... but not cleanly", status 1).
    proc = _train_with(work, tmp_path, CTRL_C_AT_START, [*TINY, "--name", "start"])
    try:
        _, err = proc.communicate(timeout=120)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("pipetrain train")]
    assert sorted(ours) == [
        *(
            f"pipetrain train (rank {rank}): stopped by SIGINT outside the training steps "
            "(starting up, or after the last one): no step was cut short"
            for rank in (0, 1)
        ),
        "pipetrain train: stopped by signal SIGINT",
    ], err[-3000:]


def test_ranks_do_not_outlive_a_killed_launcher(work: Path) -> None:
    # torch's launcher stops its ranks when signalled, but SIGKILL (or the OOM killer)
    # gives it no chance: the ranks, in sessions of their own, would train on as orphans.
    flags = [*TINY, "--steps", "100000", "--set", "run.eval_every=0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", "train", *flags, "--data", "data", "--name", "o"],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    metrics = work / "runs" / "o" / "metrics.jsonl"
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and '"loss"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        workers = _descendants(proc.pid)
        assert len(workers) >= 2, workers
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_running(pid) for pid in workers):
            time.sleep(0.2)
        left = [pid for pid in workers if _running(pid)]
        assert not left, [_describe(pid) for pid in left]
    finally:
        for pid in workers:  # when the test fails: no orphan of ours either
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# Rank 1 dies as it would start its first data-parallel all-reduce: rank 0's ones wait.
KILL_RANK_1_IN_DP = textwrap.dedent(
    """
    import os
    if os.environ.get("RANK") == "1":
        import signal
        from pipetrain.parallel.replicated import ReplicaGradients

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        ReplicaGradients._start = die
    """
)


def test_a_replica_lost_in_the_gradient_all_reduce_is_one_line(work: Path, tmp_path: Path) -> None:
    flags = [*TINY, "--pp", "1", "--dp", "2", "--name", "dp"]
    proc = _train_with(work, tmp_path, KILL_RANK_1_IN_DP, flags)
    try:
        _, err = proc.communicate(timeout=240)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("pipetrain train (rank 0)")]
    assert len(lines) == 1, err[-3000:]
    # The step as the progress counts it, and the peer's fate in words, not gloo's text.
    assert re.fullmatch(
        r"pipetrain train \(rank 0\): rank 0: training step 1, data-parallel all-reduce of "
        r".* with the other replicas \(dp group of pp rank 0\): a peer was lost \(.*\)",
        lines[0],
    ), lines[0]
