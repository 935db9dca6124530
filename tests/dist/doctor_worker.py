"""One rank of the hang doctor's fault checks: ``doctor_worker.py FAULT OUT``.

A 1F1B pipeline of llama-tiny on every rank of the world (waits time out after
``TIMEOUT_S``) runs two training steps; in the second, rank 1 meets ``FAULT`` at its second
forward: ``sleep`` (sleeps inside the action), ``stop`` (SIGSTOP to itself), ``kill``
(SIGKILL). ``deadlock``: the schedule file ``OUT/deadlock.csv`` (the test writes it), whose
two ranks each receive before they send, loaded as a user's file is with the validator
switched off (it refuses the file) and with the wire order of the valid schedule (the
transport refuses it too). The moment of the fault goes to ``OUT/fault_at``; the doctor's
report to ``OUT/doctor.json``. A failed rank writes its one-line error and exits 1.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pipetrain.runtime.executor as executor
import pipetrain.schedules.io as schedule_io
import pipetrain.schedules.prepare as prepare
from pipetrain.launch.process_exit import exit_rank
from pipetrain.models import get_model_config, model_spec
from pipetrain.runtime import build_pipeline
from pipetrain.runtime.errors import PipelineError
from pipetrain.schedules.prepare import prepare_schedule
from pipetrain.schedules.wire import wire_orders

TIMEOUT_S = 5.0
SLEEP_S = 14.0


def deadlocked(path: Path) -> str:
    """``path``, a schedule file for 2 ranks and 2 micro-batches that deadlocks, made
    loadable: the runtime then prepares it as any file, without the checks that refuse it."""
    schedule_io.validate = prepare.validate = lambda schedule: None  # type: ignore[assignment]
    valid = prepare_schedule("1f1b", 2, 2, early=False)
    # The transport's wire order comes from the schedule, and refuses this one: use the
    # valid one's, as a hand-made runtime without the check would.
    executor.wire_orders = lambda schedule: wire_orders(valid.lowered)  # type: ignore[assignment]
    return str(path)


def main(fault: str, out: Path) -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    microbatches = 2 if fault == "deadlock" else 3
    pipe = build_pipeline(
        model_spec(get_model_config("llama-tiny")),
        schedule=deadlocked(out / "deadlock.csv") if fault == "deadlock" else "1f1b",
        microbatches=microbatches,
        group=dist.group.WORLD,
        device=torch.device("cpu"),
        seed=0,
        timeout_s=TIMEOUT_S,
    )
    assert pipe.hang_watch is not None
    pipe.hang_watch.report_dir = out
    calls = []

    def fault_hook(module: object, inputs: object) -> None:
        calls.append(1)
        if rank != 1 or len(calls) != microbatches + 2:  # the second forward of step 2
            return
        (out / "fault_at").write_text(repr(time.time()))
        if fault == "sleep":
            time.sleep(SLEEP_S)
        elif fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    pipe.modules[0].register_forward_pre_hook(fault_hook)
    ids = torch.randint(0, 256, (2 * microbatches, 9), generator=torch.Generator().manual_seed(0))
    try:
        for step in range(2):
            if fault == "deadlock" and rank == 0 and step == 0:
                (out / "fault_at").write_text(repr(time.time()))
            pipe.step(ids[:, :-1], ids[:, 1:])
    except PipelineError as exc:
        sys.stderr.write(f"rank {rank}: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    exit_rank(main(sys.argv[1], Path(sys.argv[2])))
