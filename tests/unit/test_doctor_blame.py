"""The hang doctor's blame (pipetrain.diagnose.doctor.blame), which the local launcher's
last line gives, and the first failure report of a launch kept over later ones
(pipetrain.runtime.hang)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipetrain.diagnose.doctor import blame
from pipetrain.runtime.hang import _keeps_first_failure


def _report(ranks: dict[int, Any], seen: dict[int, Any], **fields: Any) -> dict[str, Any]:
    return {
        "id": 1,
        "by": "failure",
        "run": "abc/pipetrain/doctor/0/",
        "ranks": {str(r): s for r, s in ranks.items()},
        "last_seen": {str(r): s for r, s in seen.items()},
        **fields,
    }


FAILED = {"state": "failed", "action": "1W2", "for_s": 5.5, "error": "a peer did not answer"}


def _beat(age_s: float) -> dict[str, Any]:
    return {"state": "computing", "action": "0F2", "for_s": 0.1, "age_s": age_s}


def test_of_the_silent_ranks_the_one_heard_from_longest_ago_is_blamed() -> None:
    # Rank 0 stopped 9 s ago; rank 1 failed on it and exited 2 s ago; rank 2 reports.
    report = _report({0: None, 1: None, 2: FAILED}, {0: _beat(9.0), 1: _beat(2.0)})
    found = blame(report)
    assert found is not None and found.rank == 0
    assert found.text == (
        "rank 0 stopped answering first (the hang doctor heard nothing from it for 9 s; "
        "last seen in 0F2 for 0.1 s)"
    )


def test_without_a_silent_rank_the_rank_the_others_wait_on_is_blamed() -> None:
    waiting = {"state": "waiting", "action": "0RECV_F1", "for_s": 5.0, "waits_on": 1}
    computing = {"state": "computing", "action": "1F1", "for_s": 41.0}
    found = blame(_report({0: waiting, 1: computing}, {}))
    assert found is not None and found.rank == 1
    assert found.text == (
        "rank 1 held the others up (the hang doctor: it was in 1F1 for 41 s; rank 0 waited on it)"
    )


def test_a_deadlock_or_a_quiet_run_blames_no_one() -> None:
    cycle = {
        0: {"state": "waiting", "action": "0RECV_B0", "waits_on": 1},
        1: {"state": "waiting", "action": "1RECV_F0", "waits_on": 0},
    }
    assert blame(_report(cycle, {})) is None
    assert blame(_report({0: {"state": "outside"}}, {})) is None


def test_a_later_failure_report_of_the_same_launch_does_not_replace_the_first(
    tmp_path: Path,
) -> None:
    path = tmp_path / "doctor.json"
    first = _report({0: None}, {0: _beat(9.0)})
    assert not _keeps_first_failure(path, first)  # nothing there yet
    path.write_text(json.dumps(first))
    assert _keeps_first_failure(path, {**first, "id": 2})
    # Another launch, or a report asked for by SIGUSR1: written as before.
    assert not _keeps_first_failure(path, {**first, "id": 2, "run": "def/pipetrain/doctor/0/"})
    assert not _keeps_first_failure(path, {**first, "id": 2, "by": "signal"})
