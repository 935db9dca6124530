"""pipetrain.runtime.waits: polling waits with a deadline, and host reads of headers."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from pipetrain.runtime.waits import finish, host_ints, to_device
from pipetrain.runtime.wire_format import describe_failure


class _Work:
    """A transfer that completes ``after_s`` from now (never with None), and records how
    it was waited for."""

    def __init__(self, after_s: float | None) -> None:
        self._done = threading.Event()
        self.waits: list[datetime.timedelta | None] = []
        if after_s is not None:
            threading.Timer(after_s, self._done.set).start()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        self.waits.append(timeout)


def test_polling_returns_once_complete_then_orders_the_stream() -> None:
    work = _Work(0.05)
    start = time.monotonic()
    finish(work, 5.0, polls=True)
    assert 0.04 < time.monotonic() - start < 2.0
    # Only then wait() without a timeout: on NCCL a stream dependency, not a host wait.
    assert work.waits == [None]


def test_polling_gives_up_at_the_deadline_in_words_the_errors_understand() -> None:
    work = _Work(None)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        finish(work, 0.2, polls=True)
    assert 0.2 <= time.monotonic() - start < 2.0
    assert work.waits == []
    assert describe_failure(info.value, 0.2).startswith("did not answer within 0.2 s")


def test_without_polling_the_backend_waits_with_the_timeout() -> None:
    # gloo: is_completed stays False until wait, so its own timed wait is used.
    work = _Work(None)
    finish(work, 3.0, polls=False)
    assert work.waits == [datetime.timedelta(seconds=3.0)]


def test_host_reads_and_device_copies_on_the_cpu() -> None:
    values = [0x5049_5045, -1, 2**40, 7]
    on_device = to_device(values, torch.device("cpu"))
    assert on_device.dtype == torch.int64 and on_device.tolist() == values
    assert host_ints(on_device) == values
