"""Fixtures shared by the CLI end-to-end tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder per test module whose ``data/`` holds a small corpus of 24 text files.

    Fixed words in a seeded order: every run sees the same bytes, so losses can be compared
    across runs, and the files are big enough for several batches of short sequences.
    """
    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    data.mkdir()
    rng = random.Random(0)
    words = ["def", "class", "return", "import", "for", "while", "if", "lambda", "self", "x"]
    for i in range(24):
        lines = (" ".join(rng.choice(words) for _ in range(10)) for _ in range(60))
        (data / f"doc{i:02d}.txt").write_text("\n".join(lines))
    return root
