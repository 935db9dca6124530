"""Suite-wide settings: tests marked ``gpu`` are skipped where CUDA is not available;
hypothesis has no per-example deadline."""

from __future__ import annotations

import pytest
from hypothesis import settings

# The property tests check results, not speed: on a shared 2-core machine an example of a
# few milliseconds took 318 ms once (test_sim_data_parallel under load), and hypothesis's
# 200 ms deadline failed it as flaky.
settings.register_profile("pipetrain", deadline=None)
settings.load_profile("pipetrain")


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
