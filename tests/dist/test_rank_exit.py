"""A rank's process ends cleanly while gloo's threads still hold Python-owned tensors.

The hazard (``pipetrain.launch.process_exit.exit_rank``): a gloo worker thread finishes a
collective whose tensors Python has dropped; freeing them takes the GIL, and a thread
that waits for the GIL when the interpreter finalizes is ended with ``pthread_exit``
through a noexcept destructor: SIGABRT, "terminate called without an active exception".
In a training run that window is a moment after the last collective, hit rarely under
load; here it is made certain. Two processes start an all-reduce and keep the GIL (a
sleep in C that does not let go of it) while their gloo threads complete it, so both
threads are waiting for the GIL when their process ends. Rank 0 ends through
``exit_rank``, rank 1 through a plain exit: the control, which shows that the scenario
still aborts a process that finalizes (else this test would prove nothing).
"""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
from runtime_launch import launch

pytestmark = pytest.mark.dist

SCRIPT = textwrap.dedent(
    """
    import ctypes, os, sys, time
    import torch
    import torch.distributed as dist
    from pipetrain.launch.process_exit import exit_rank

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(4))
    # Python drops the tensor at once, long before the gloo thread is done with it (the
    # peer that posts first waits for the other; 64 MB take the other tens of ms): the
    # gloo thread holds the last reference.
    dist.all_reduce(torch.ones(1 << 24), async_op=True)
    # No thread takes the GIL from this one until it blocks (no 5 ms hand-over).
    sys.setswitchinterval(1000.0)
    # 2 s asleep in C with the GIL held: the collective completes meanwhile, and the gloo
    # thread, done with it, waits for the GIL to free the tensor.
    ctypes.PyDLL(None).usleep(2_000_000)


    class LetsGoOfTheGil:
        # Finalization lets go of the GIL at times (torch's C++ destructors do); this
        # object does it for sure.
        def __del__(self):
            time.sleep(0.2)


    held = LetsGoOfTheGil()
    if rank == 0:
        exit_rank(0)
    sys.exit(0)
    """
)


def test_exit_rank_ends_a_process_whose_gloo_thread_waits_for_the_gil(tmp_path: Path) -> None:
    script = tmp_path / "exit_race.py"
    script.write_text(SCRIPT)
    run = launch(2, [], timeout_s=120.0, worker=script)
    # Rank 0, through exit_rank: a clean exit.
    assert run.returncodes[0] == 0, run.stderr[0][-2000:]
    assert "terminate called" not in run.stderr[0]
    # Rank 1, the same moment through the interpreter's finalization: the abort.
    assert run.returncodes[1] == -signal.SIGABRT, (run.returncodes, run.stderr[1][-2000:])
    assert "terminate called without an active exception" in run.stderr[1]
