"""pipetrain.launch.rendezvous: every process posts its outcome before any joins the group,
against a store faked in memory (the interleavings of two processes, forced)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from pipetrain.config.checks import ConfigError
from pipetrain.launch import rendezvous
from pipetrain.launch.role import ProcessRole


class _Store:
    """The calls of c10d's store that the start-up makes, on a dict."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = {key: value.encode() for key, value in values.items()}
        self.counters: dict[str, int] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def add(self, key: str, amount: int) -> int:
        self.counters[key] = self.counters.get(key, 0) + amount
        return self.counters[key]


@dataclass(frozen=True)
class _Prefixed:
    """What the process group is given: the run's store under a prefix of its own."""

    prefix: str
    store: _Store


@pytest.fixture(autouse=True)
def _prefix_store(monkeypatch: pytest.MonkeyPatch) -> None:
    # c10d's PrefixStore takes only c10d's own stores.
    monkeypatch.setattr(rendezvous, "PrefixStore", _Prefixed)


def _join(monkeypatch: pytest.MonkeyPatch, store: _Store) -> list[Any]:
    joined: list[Any] = []
    monkeypatch.setattr(rendezvous, "_store", lambda role, timeout_s: store)
    monkeypatch.setattr(
        rendezvous.dist, "init_process_group", lambda *args, **kwargs: joined.append(kwargs)
    )
    rendezvous.join_process_group(ProcessRole(rank=0, world_size=2), "gloo", 5.0)
    return joined


def test_every_process_ready_joins_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Store({"pipetrain/start/0/1": json.dumps({"ready": True})})
    (joined,) = _join(monkeypatch, store)
    assert joined["store"] == _Prefixed("pipetrain/start/0/", store)


def test_a_restarted_group_joins_under_a_prefix_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun's static rendezvous keeps one store across --max-restarts: the process
    # group of attempt 1 must not read the addresses that attempt 0's processes left.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store = _Store(
        {
            "pipetrain/start/0/1": json.dumps({"host": "x", "problem": "old", "input": True}),
            "pipetrain/start/1/1": json.dumps({"ready": True}),
        }
    )
    (joined,) = _join(monkeypatch, store)
    assert joined["store"] == _Prefixed("pipetrain/start/1/", store)


def test_a_failure_posted_but_not_yet_counted_is_not_taken_for_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 1 posts its outcome, then counts itself failed: polled in between, every key
    # is there and the count is 0. Joining then would wait in the group for a process
    # that is exiting, until the timeout (300 s by default).
    failed = {"host": "node1", "problem": "data.path 'x' does not exist", "input": True}
    store = _Store({"pipetrain/start/0/1": json.dumps(failed)})
    with pytest.raises(ConfigError, match=r"rank 1 \(on node1\) could not start: data.path"):
        _join(monkeypatch, store)


def _ready_on(gpus: dict[int, str]) -> _Store:
    return _Store(
        {
            f"pipetrain/start/0/{rank}": json.dumps({"ready": True, "gpu": gpu})
            for rank, gpu in gpus.items()
        }
    )


def test_two_processes_on_one_gpu_are_named_before_joining(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # nccl refuses them only inside the first collective ("Duplicate GPU detected"). The
    # GPUs are compared by UUID: processes that each see one GPU of their own join.
    joined: list[Any] = []
    monkeypatch.setattr(
        rendezvous.dist, "init_process_group", lambda *args, **kwargs: joined.append(kwargs)
    )
    role = ProcessRole(rank=1, world_size=3)
    store = _ready_on({0: "GPU-a", 2: "GPU-b"})
    monkeypatch.setattr(rendezvous, "_store", lambda role, timeout_s: store)
    with pytest.raises(ConfigError, match=r"ranks 0 and 1 would share GPU GPU-a.*one GPU per"):
        rendezvous.join_process_group(role, "nccl", 5.0, "GPU-a")
    # Others' sharing stops this process too: every process decides alike.
    store = _ready_on({0: "GPU-b", 2: "GPU-b"})
    with pytest.raises(ConfigError, match=r"ranks 0 and 2 would share GPU GPU-b"):
        rendezvous.join_process_group(role, "nccl", 5.0, "GPU-a")
    assert joined == []
    store = _ready_on({0: "GPU-b", 2: "GPU-c"})
    rendezvous.join_process_group(role, "nccl", 5.0, "GPU-a")
    assert len(joined) == 1
