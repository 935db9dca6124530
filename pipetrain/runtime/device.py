"""The device a process runs its stages on: its choice, its binding, its identity."""

from __future__ import annotations

import os

import torch

__all__ = ["default_device", "gpu_identity", "use_device"]


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        )
    return torch.device("cpu")


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (nothing to do on the CPU).

    Call it before the process group exists. torch's object collectives on nccl
    (``all_gather_object``, ``broadcast_object_list``, ``gather_object``) put their buffers
    on ``torch.cuda.current_device()``, which is cuda:0 until set: every process of a node
    would then meet on GPU 0 and nccl stops them with "Duplicate GPU detected". Pinned
    host buffers and nccl's barrier also go by the current device.

    ``init_process_group(device_id=...)`` would also bind the device, but it makes nccl
    initialise eagerly, and then every point-to-point operation of the group shares the
    group's one communicator and stream (pytorch/pytorch#154132) instead of one per pair
    of ranks, which ``DistTransport``'s per-pair wire orders assume.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


def gpu_identity(device: torch.device) -> str | None:
    """The UUID of the GPU behind ``device``, the same in every process whatever its
    CUDA_VISIBLE_DEVICES numbers it; None on the CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)
