"""Reading a run's metrics file in the CLI end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_records(run: Path) -> list[dict[str, Any]]:
    """The JSON records of a run's ``metrics.jsonl`` (``run``: the run directory or the file)."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    return [json.loads(line) for line in path.read_text().splitlines()]
