"""The hang doctor's analysis (pipetrain.diagnose.doctor) on hand-made reports: the
wait-for graph, the culprit at the end of each chain, cycles, and the words."""

from __future__ import annotations

from typing import Any

from pipetrain.diagnose.doctor import diagnose, format_report


def _waiting(action: str, peer: int, message: str = "", error: str = "") -> dict[str, Any]:
    return {
        "state": "failed" if error else "waiting",
        "action": action,
        "for_s": 5.0,
        "waits_on": peer,
        "message": message or f"something from rank {peer}",
        "where": "training step 3",
        "error": error,
    }


def _report(ranks: dict[int, Any], last_seen: dict[int, Any] | None = None) -> dict[str, Any]:
    return {
        "id": 1,
        "reason": "rank 0 failed: ...",
        "collector": 0,
        "ranks": {str(r): s for r, s in ranks.items()},
        "last_seen": {str(r): s for r, s in (last_seen or {}).items()},
    }


def test_a_computing_rank_is_the_culprit_of_everyone_down_its_chains() -> None:
    # 0 -> 1 -> 2 and 3 -> 2: rank 2 computes; 0 waits on it through 1.
    report = _report(
        {
            0: _waiting("0RECV_B5", 1),
            1: _waiting("1RECV_B5", 2),
            2: {"state": "computing", "action": "2B5", "for_s": 41.2, "where": "training step 3"},
            3: _waiting("3RECV_F6", 2),
        }
    )
    d = diagnose(report)
    assert d.edges == ((0, 1), (1, 2), (3, 2))
    assert [(c.rank, c.waited_by) for c in d.culprits] == [(2, (0, 1, 3))]
    assert d.cycles == ()
    assert d.verdict == (
        "rank 2 is not waiting: it has been in 2B5 for 41 s; ranks 0, 1 and 3 wait on it",
    )


def test_a_silent_rank_is_named_with_its_last_heartbeat_and_dead_when_peers_lost_it() -> None:
    beat = {"state": "computing", "action": "1F3", "for_s": 0.5, "age_s": 6.5}
    stopped = _report({0: _waiting("0RECV_B2", 1), 1: None}, last_seen={1: beat})
    d = diagnose(stopped)
    assert d.ranks[1].state == "silent"
    assert d.verdict == (
        "rank 1 is silent: it posted no state (stopped, e.g. by SIGSTOP, hung outside Python, "
        "or dead); last seen 6.5 s ago, in 1F3 for 0.5 s; rank 0 waits on it",
    )
    lost = "rank 0: step 2, receiving ...: peer rank 1 was lost (its process died ...)"
    dead = _report({0: _waiting("0RECV_B2", 1, error=lost), 1: None})
    assert diagnose(dead).verdict == (
        "rank 1 is dead: its peers lost the connection to it; rank 0 waits on it",
    )


def test_two_ranks_waiting_on_each_other_are_a_cycle_with_no_culprit() -> None:
    report = _report(
        {
            0: _waiting("0RECV_B0", 1, "gradient of micro-batch 0"),
            1: _waiting("1RECV_F0", 0, "activations of micro-batch 0"),
            2: _waiting("2RECV_F0", 1),  # leads into the cycle
        }
    )
    d = diagnose(report)
    assert d.cycles == ((0, 1),)
    assert d.culprits == ()
    assert d.verdict[0].startswith(
        "ranks 0 and 1 wait on each other (rank 0 -> rank 1 -> rank 0): a deadlock"
    )
    assert "rank 0 waits in 0RECV_B0 for gradient of micro-batch 0" in d.verdict[0]
    three = _report({0: _waiting("a", 2), 1: _waiting("b", 0), 2: _waiting("c", 1)})
    assert diagnose(three).cycles == ((0, 2, 1),)
    assert "wait in a cycle (rank 0 -> rank 2 -> rank 1 -> rank 0)" in diagnose(three).verdict[0]


def test_a_rank_outside_the_actions_and_a_healthy_run() -> None:
    outside = {
        "state": "outside",
        "action": "1B7",
        "for_s": 12.0,
        "frame": "GuardedUpdate.apply (pipetrain/train/optim.py:90)",
    }
    d = diagnose(_report({0: _waiting("0RECV_B7", 1), 1: outside}))
    assert d.verdict == (
        "rank 1 is not waiting on a pipeline message: it is outside the pipeline's actions in "
        "GuardedUpdate.apply (pipetrain/train/optim.py:90), 12 s after 1B7 ended; rank 0 waits on it",
    )
    healthy = _report({0: {"state": "computing", "action": "0F1", "for_s": 0.01}, 1: outside})
    assert diagnose(healthy).verdict == (
        "no rank waits on another's message: nothing is stuck in the pipeline",
    )


def test_the_text_has_a_row_per_rank_the_graph_and_the_verdict() -> None:
    report = _report({0: _waiting("0RECV_B5", 1, "gradient of micro-batch 5"), 1: None})
    lines = format_report(report).splitlines()
    assert lines[0] == "hang doctor, report 1: rank 0 failed: ... (collected by rank 0, 2 ranks)"
    assert lines[1].split() == [
        "rank",
        "state",
        "action",
        "for",
        "waits",
        "on",
        "what",
        "/",
        "where",
    ]
    assert lines[2].split()[:6] == ["0", "waiting", "0RECV_B5", "5", "s", "rank"]
    assert lines[3].split() == ["1", "silent", "-", "-", "-"]
    assert lines[4:6] == ["wait-for graph:", "  rank 0 -> rank 1"]
    assert lines[6].startswith("verdict: rank 1 is silent")
