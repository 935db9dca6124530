"""pipetrain.launch.rendezvous against a real c10d store in this process: a second run
started on a port that a first run's store holds is refused in one line, and never posts
into that store.

"Another process" is this one with another process id (``os.getpid`` patched).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from pipetrain.config.checks import ConfigError
from pipetrain.launch import rendezvous
from pipetrain.launch.role import ProcessRole

FIX = "start this run on another port (torchrun --master-port, or MASTER_PORT)"


@pytest.fixture
def first_run(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    """A first run's store (as its launcher hosts it), its ranks' environment set."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "first",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    yield store


ROLE = ProcessRole(rank=1, world_size=2)


def test_a_rank_of_another_launch_is_refused_by_run_id(
    first_run: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendezvous._store(ROLE, 5.0)  # the first run's rank 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "second")
    address = f"127.0.0.1:{first_run.port}"
    with pytest.raises(ConfigError) as refused:
        rendezvous._store(ROLE, 5.0)
    assert str(refused.value) == (
        f"rank 1: the store at {address} belongs to another run (run id first; this one's "
        f"is second): {FIX}"
    )


def test_a_rank_started_by_hand_is_refused_by_the_rank_already_there(
    first_run: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Runs started by hand (RANK, WORLD_SIZE, MASTER_PORT) have no run id to compare.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    first = os.getpid()
    rendezvous._store(ROLE, 5.0)
    rendezvous._store(ROLE, 5.0)  # the same process again: still itself
    monkeypatch.setattr(os, "getpid", lambda: first + 1)
    with pytest.raises(ConfigError, match=r"belongs to another run \(process \d+ on .* joined"):
        rendezvous._store(ROLE, 5.0)
    # Its failure is not posted there: the first run's ranks would stop with it.
    rendezvous.report_failure(ROLE, ConfigError("data.path 'x' does not exist"))
    assert not first_run.check(["pipetrain/start/0/1"])
    assert first_run.add("pipetrain/start/0/failed", 0) == 0


def test_a_port_taken_is_named_with_the_fix(
    first_run: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 of a run started by hand hosts the store: it cannot listen on a taken port.
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError) as refused:
        rendezvous._store(ProcessRole(rank=0, world_size=2), 5.0)
    assert str(refused.value) == (
        f"rank 0: port 127.0.0.1:{first_run.port} is already in use (by another run's store, "
        f"or another program): {FIX}"
    )
