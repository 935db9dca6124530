"""The hang doctor on real faults: a rank sleeping inside an action, stopped with SIGSTOP,
killed, and a schedule file whose two ranks wait on each other (doctor_worker.py).

Each report must name the culprit (or the cycle) and its state within the pipeline's
timeout plus 10 s of the fault, and every process must exit non-zero: the waiting ranks
with their one-line error, the culprit when it wakes (SIGCONT for the stopped one) to
find its peers gone, or by the signal that killed it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_port import reserved_port

from pipetrain.diagnose.doctor import diagnose, format_report
from pipetrain.schedules import ScheduleError
from pipetrain.schedules.prepare import prepare_schedule

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("doctor_worker.py")
TIMEOUT_S = 5.0  # doctor_worker.TIMEOUT_S


def _stopped(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    return False


def _run(fault: str, world: int, out: Path, limit_s: float = 90.0) -> tuple[list[int], list[str]]:
    """Start ``world`` workers; a rank left stopped once the others ended gets SIGCONT."""
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(reserved_port())
        logs = [out / f"rank{r}.log" for r in range(world)]
        procs = []
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            log = stack.enter_context(logs[rank].open("w"))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), fault, str(out)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
        deadline = time.monotonic() + limit_s
        try:
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                running = [p for p in procs if p.poll() is None]
                if all(_stopped(p.pid) for p in running):
                    for p in running:
                        p.send_signal(signal.SIGCONT)
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return [p.returncode for p in procs], [log.read_text() for log in logs]


def _report(out: Path, errs: list[str]) -> dict:
    path = out / "doctor.json"
    assert path.exists(), "\n".join(e[-2000:] for e in errs)
    report: dict = json.loads(path.read_text())
    fault_at = float((out / "fault_at").read_text())
    assert report["collected_at"] - fault_at < TIMEOUT_S + 10, (report, fault_at)
    return report


@pytest.mark.parametrize("fault", ["sleep", "stop", "kill"])
def test_the_report_names_the_rank_that_holds_the_others_up(tmp_path: Path, fault: str) -> None:
    codes, errs = _run(fault, 3, tmp_path)
    report = _report(tmp_path, errs)
    d = diagnose(report)
    text = format_report(report)
    assert [c.rank for c in d.culprits] == [1], text
    assert d.culprits[0].waited_by == (0, 2), text
    assert not d.cycles, text
    # The waiting ranks name what they wait for: rank 0 a gradient, rank 2 activations.
    assert "gradient of micro-batch" in d.ranks[0].message, text
    assert "activations of micro-batch" in d.ranks[2].message, text
    verdict = d.verdict[0]
    if fault == "sleep":
        assert d.ranks[1].state == "computing" and d.ranks[1].action == "1F1", text
        assert verdict.startswith("rank 1 is not waiting: it has been in 1F1 for "), verdict
    elif fault == "stop":
        assert d.ranks[1].state == "silent", text
        assert verdict.startswith("rank 1 is silent: it posted no state"), verdict
        assert "last seen" in verdict, verdict
    else:
        assert d.ranks[1].state == "silent", text
        assert verdict.startswith("rank 1 is dead: its peers lost the connection to it"), verdict
    assert verdict.endswith("; ranks 0 and 2 wait on it"), verdict
    # Printed by the collecting rank too, among its own lines.
    assert any(f"[doctor] verdict: {verdict}" in e for e in errs), errs
    assert all(code != 0 for code in codes), (codes, [e[-1500:] for e in errs])
    expected = -signal.SIGKILL if fault == "kill" else 1
    assert codes[1] == expected, (codes, errs[1][-2000:])


# Rank 0 waits for micro-batch 0's gradient before it sends any activations: 1F1B for 2
# ranks and 2 micro-batches (early=False) with rank 0's first RECV_B moved up.
DEADLOCK_CSV = (
    "0F0,0F1,0RECV_B0,0SEND_F0,0SEND_F1,0B0,0RECV_B1,0B1\n"
    "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n"
)


def test_the_report_names_two_ranks_that_wait_on_each_other(tmp_path: Path) -> None:
    schedule = tmp_path / "deadlock.csv"
    schedule.write_text(DEADLOCK_CSV)
    # The validator refuses the file: the workers load it with the validator switched off.
    with pytest.raises(ScheduleError, match="deadlock"):
        prepare_schedule(str(schedule), 2, 2)
    codes, errs = _run("deadlock", 2, tmp_path)
    report = _report(tmp_path, errs)
    d = diagnose(report)
    text = format_report(report)
    assert d.cycles == ((0, 1),), text
    assert not d.culprits, text
    assert d.verdict[0].startswith("ranks 0 and 1 wait on each other (rank 0 -> rank 1 -> rank 0)")
    assert "rank 0 waits in 0RECV_B0 for gradient of micro-batch 0" in d.verdict[0], text
    assert "rank 1 waits in 1RECV_F0 for activations of micro-batch 0" in d.verdict[0], text
    assert codes == [1, 1], (codes, errs)
