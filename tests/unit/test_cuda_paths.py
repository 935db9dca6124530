"""Decisions of the CUDA paths, checked on the CPU with torch.cuda faked where needed.

No GPU runs these tiers (tests/gpu/ does, where there is one), so what can be decided
without one is pinned here: which device a process makes current before it meets the
others, and which calls a CPU-only run never reaches.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from pipetrain.config import load_config
from pipetrain.launch.role import ProcessRole


class _Joined(Exception):
    """Stops a run where it would meet the other processes."""


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[Any]:
    """A node with ``count`` GPUs as far as device choice goes; the devices made current."""
    current: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)

    class _Properties:
        def __init__(self, device: torch.device) -> None:
            self.uuid = f"GPU-{device.index}"

    monkeypatch.setattr(torch.cuda, "get_device_properties", _Properties)
    return current


def test_a_training_rank_makes_its_gpu_current_before_it_joins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # all_gather_object on nccl (the settings check right after the join) puts its buffer
    # on torch.cuda.current_device(): left at cuda:0, both ranks of the node meet on GPU 0
    # and nccl stops them ("Duplicate GPU detected").
    from pipetrain.train import loop

    current = _fake_gpus(monkeypatch, 2)
    at_join: list[list[Any]] = []

    def join(role: ProcessRole, backend: str, timeout_s: float, gpu: str | None) -> None:
        at_join.append([backend, gpu, *current])
        raise _Joined

    monkeypatch.setattr(loop, "join_process_group", join)
    config = load_config(overrides={"run.name": "t", "pipeline.device": "cuda", "pipeline.pp": 2})
    role = ProcessRole(rank=1, world_size=2, local_rank=1, local_world_size=2)
    with pytest.raises(_Joined):
        loop.train(config, role, out=io.StringIO(), announced=True)
    # The GPU is posted at the rendezvous, which names two processes on one.
    assert at_join == [["nccl", "GPU-1", torch.device("cuda", 1)]]


def test_a_cpu_run_never_touches_the_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipetrain.runtime.device import use_device

    current = _fake_gpus(monkeypatch, 2)
    use_device(torch.device("cpu"))
    assert current == []
    use_device(torch.device("cuda", 1))
    assert current == [torch.device("cuda", 1)]


def test_generate_makes_its_gpu_current_before_it_joins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # Loading the checkpoint broadcasts objects over the group: on nccl from the current device.
    import argparse

    from pipetrain.cli import ckpt, generate
    from pipetrain.launch import rendezvous

    current = _fake_gpus(monkeypatch, 2)
    at_join: list[list[Any]] = []

    def join(role: ProcessRole, backend: str, timeout_s: float, gpu: str | None) -> None:
        at_join.append([role.rank, backend, gpu, *current])
        raise _Joined

    monkeypatch.setattr(ckpt, "resolve_checkpoint", lambda directory: tmp_path)
    monkeypatch.setattr(rendezvous, "join_process_group", join)
    # Per-task binding would give each rank one GPU: its UUID, not a count, tells.
    for name, value in (
        ("WORLD_SIZE", "2"),
        ("RANK", "1"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "8"),
    ):
        monkeypatch.setenv(name, value)
    args = argparse.Namespace(
        checkpoint=str(tmp_path),
        prompt="a",
        max_new_tokens=1,
        temperature=0.0,
        seed=0,
        pp=None,
        device="auto",
    )
    with pytest.raises(_Joined):
        generate.run(args)
    assert at_join == [[1, "nccl", "GPU-1", torch.device("cuda", 1)]]


def test_peak_memory_is_read_from_the_process_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a device, torch reads the current one: cuda:0 on a process that never made
    # its own current reports another GPU's peak (or none).
    from pipetrain.train.metrics import peak_memory_bytes

    asked: list[Any] = []

    def peak(device: Any = None) -> int:
        asked.append(device)
        return 123

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak)
    assert peak_memory_bytes("cuda:1") == 123
    assert asked == ["cuda:1"]
    assert peak_memory_bytes("cpu") > 0
    assert asked == ["cuda:1"]


def test_the_gradient_check_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each read of a CUDA value on the host waits for the queued work: the check runs every
    # step over every gradient, so only its final result may be read (one .tolist()).
    import math

    from pipetrain.train.optim import Gradients, check_gradients

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    for p, value in zip(params, (1.0, 2.0, math.inf, 4.0), strict=True):
        p.grad = torch.full((3,), value)
    reads: list[str] = []
    for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _name: str = name, _f: Any = original) -> Any:
            reads.append(_name)
            return _f(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # Replica 1 of a data-parallel run: counts no squares, checks every gradient.
    check = check_gradients(Gradients.of(params, not_counted=params[1:]), 0.5, None)
    assert reads == ["tolist"]
    assert not check.finite and check.norm == pytest.approx(math.sqrt(3.0))
    reads.clear()
    check = check_gradients(Gradients.of(params[:2], not_counted=params[1:2]), 0.5, None)
    assert reads == ["tolist"]
    assert check.finite and check.norm == pytest.approx(math.sqrt(3.0))
    reads.clear()
    check = check_gradients(Gradients.of(params), math.nan, None)
    assert reads == ["tolist"]
    assert not check.finite and check.norm == 0.0
