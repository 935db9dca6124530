"""Suite-wide settings: tests marked ``gpu`` are skipped where CUDA is not available."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only paid for when some collected test needs a GPU

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; none on this machine")
    for item in gpu_items:
        item.add_marker(skip)
