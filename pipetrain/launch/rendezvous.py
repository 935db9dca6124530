"""The start of a multi-process run: each process says whether its set-up worked before
any of them waits for the others in the process group's rendezvous.

Under torchrun every node resolves its own flags and reads its own files, so one node can
fail where the others succeed (a data file missing there, a run folder that refuses the
run, another --pp). That process exits at once, but the others would wait for it inside
``init_process_group`` until the timeout: 300 s by default, hours where clusters raise it.
So every process first posts its outcome in the launcher's key-value store (the store the
process group then uses): "ready", or its error in one line. A process that reads
another's error stops with it, naming the rank and host, within a fraction of a second.

Best effort by design: a process that dies without posting (killed, a crash in C) leaves
the others waiting as before, up to the timeout, and then they say which ranks never
arrived. A failure to post never hides the error that is being posted.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from pipetrain.config.checks import ConfigError
from pipetrain.errors import InputError
from pipetrain.launch.role import ProcessRole
from pipetrain.runtime.errors import PipelineError

__all__ = ["connect_store", "join_process_group", "report_failure"]

# How long a failing process tries to reach the store: it is exiting anyway.
_REPORT_TIMEOUT_S = 10.0
_POLL_S = 0.02


def _prefix() -> str:
    # An elastic restart starts every process again: a failure of an earlier attempt
    # must not stop this one.
    return f"pipetrain/start/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


# How long to try to reach a launcher's store: it exists before any process is started, so
# one that does not answer has ended (its node's process failed and took it down).
_AGENT_STORE_CONNECT_S = 10.0


def _store(role: ProcessRole, timeout_s: float) -> Any:
    """The run's key-value store, with ``timeout_s`` for its operations."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    connect_s = min(timeout_s, _AGENT_STORE_CONNECT_S) if agent_store else timeout_s
    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        store, _, _ = next(rendezvous("env://", timeout=datetime.timedelta(seconds=connect_s)))
    except Exception as exc:
        if "EADDRINUSE" in str(exc):  # this process was to host the store (rank 0)
            raise ConfigError(
                f"rank {role.rank}: port {address} is already in use (by another run's "
                f"store, or another program): {_OTHER_PORT}"
            ) from exc
        raise PipelineError(
            f"rank {role.rank}: the run's launcher at {address} did not answer within "
            f"{connect_s:g} s (the first node's launcher has ended, probably because a "
            f"process there failed: its log names why)"
        ) from exc
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    refusal = _foreign(store, role, address)
    if refusal is not None:
        raise refusal
    return store


_OTHER_PORT = "start this run on another port (torchrun --master-port, or MASTER_PORT)"


def _foreign(store: Any, role: ProcessRole, address: str) -> ConfigError | None:
    """Why the store at ``address`` is another run's, or None when it is this run's.

    A rank of a second run started on a port that a first run's store holds connects to
    that store as a client, and would take part in the first run's start. Two marks tell
    it apart, each put in by the first process to come (``compare_set``): the run id
    that the launcher gives its ranks (TORCHELASTIC_RUN_ID: the local launcher's random
    one, torchrun's --rdzv-id), and for each rank the process that joined as that rank
    (which also catches runs started by hand, which have no id)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    held = store.compare_set("pipetrain/run", "", run).decode()
    if held != run:
        return ConfigError(
            f"rank {role.rank}: the store at {address} belongs to another run (run id "
            f"{held}; this one's is {run}): {_OTHER_PORT}"
        )
    me = f"process {os.getpid()} on {socket.gethostname()}"
    holder = store.compare_set(f"{_prefix()}rank/{role.rank}", "", me).decode()
    if holder != me:
        return ConfigError(
            f"rank {role.rank}: the store at {address} belongs to another run ({holder} "
            f"joined it as rank {role.rank}): {_OTHER_PORT}"
        )
    return None


def connect_store(role: ProcessRole, timeout_s: float) -> Any:
    """This run's key-value store (a new client), after the checks of ``_store``."""
    return _store(role, timeout_s)


def report_failure(role: ProcessRole, exc: BaseException) -> None:
    """Tell the other processes of the run that this one could not start (``exc``)."""
    if not role.distributed or dist.is_initialized():
        return
    lines = str(exc).strip().splitlines()
    outcome = {
        "host": socket.gethostname(),
        "problem": lines[0] if lines else type(exc).__name__,
        "input": isinstance(exc, InputError),
    }
    try:
        store = _store(role, _REPORT_TIMEOUT_S)
        store.set(f"{_prefix()}{role.rank}", json.dumps(outcome))
        store.add(f"{_prefix()}failed", 1)
    except Exception:
        pass


def join_process_group(
    role: ProcessRole, backend: str, timeout_s: float, gpu: str | None = None
) -> None:
    """Post "ready", wait until every process has posted, then make the default process
    group on the same store. Raises ``ConfigError`` (exit status 2) when another process
    reports bad input or shares this process's ``gpu`` (the UUID of its device, None on
    the CPU), ``PipelineError`` for any other failure of its set-up or when some process
    has posted nothing within ``timeout_s``."""
    store = _store(role, timeout_s)
    try:
        problem = _await_everyone(store, role, timeout_s, gpu)
    except RuntimeError as exc:  # c10d's store errors: its server went away
        raise PipelineError(
            f"rank {role.rank}: lost the run's launcher while waiting for the other ranks to "
            f"start (the first node's launcher ended, probably because a process there "
            f"failed: its log names why)"
        ) from exc
    if problem is not None:
        raise problem
    dist.init_process_group(
        backend,
        # torchrun's static rendezvous keeps one store across --max-restarts: without a
        # prefix of its own, a restarted group read the dead attempt's gloo addresses and
        # failed to connect ("Connection refused") until the timeout.
        store=PrefixStore(_prefix(), store),
        rank=role.rank,
        world_size=role.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _failure(store: Any, keys: list[str]) -> Exception:
    """The first failure posted, as this process's error."""
    for rank, key in enumerate(keys):
        if not store.check([key]):
            continue
        outcome = json.loads(store.get(key))
        if outcome.get("ready"):
            continue
        text = f"rank {rank} (on {outcome['host']}) could not start: {outcome['problem']}"
        return ConfigError(text) if outcome["input"] else PipelineError(text)
    return PipelineError("another rank could not start (its log names the error)")


def _shared_gpu(outcomes: list[dict[str, Any]]) -> Exception | None:
    """Two ready processes on one GPU, or None. nccl refuses them only inside the first
    collective ("Duplicate GPU detected"). Compared by UUID, which names the device
    whatever each process's CUDA_VISIBLE_DEVICES calls it, so one process per GPU is
    also recognised where every process sees only its own (SLURM's per-task binding)."""
    first: dict[str, int] = {}
    for rank, outcome in enumerate(outcomes):
        gpu = outcome.get("gpu")
        if gpu is None:
            continue
        if gpu in first:
            return ConfigError(
                f"ranks {first[gpu]} and {rank} would share GPU {gpu}, and nccl needs one GPU "
                f"per process: start at most one process per GPU of a node (--pp x --dp, or "
                f"torchrun --nproc-per-node), use --single-process, or --device cpu"
            )
        first[gpu] = rank
    return None


def _await_everyone(
    store: Any, role: ProcessRole, timeout_s: float, gpu: str | None = None
) -> Exception | None:
    """Post "ready" and wait for every process's outcome; why this process must not
    start (another's failure, two processes on one GPU, or silence past ``timeout_s``),
    or None."""
    prefix = _prefix()
    ready: dict[str, Any] = {"ready": True} if gpu is None else {"ready": True, "gpu": gpu}
    store.set(f"{prefix}{role.rank}", json.dumps(ready))
    keys = [f"{prefix}{rank}" for rank in range(role.world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        if int(store.add(f"{prefix}failed", 0)) > 0:
            return _failure(store, keys)
        if store.check(keys):
            # A failing process posts its outcome before it counts itself failed: seen in
            # between, every key is there and the count still 0. Joining then would wait
            # in the group for a process that is exiting, until the timeout.
            outcomes = [json.loads(store.get(key)) for key in keys]
            if all(outcome.get("ready") for outcome in outcomes):
                return _shared_gpu(outcomes)
            return _failure(store, keys)
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            return PipelineError(
                f"rank {role.rank}: ranks {', '.join(map(str, missing))} did not start within "
                f"{timeout_s:g} s (stopped, hung or never launched; raise pipeline.timeout_s "
                f"if their set-up is just slow)"
            )
        time.sleep(_POLL_S)
