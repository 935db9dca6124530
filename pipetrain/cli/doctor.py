"""``pipetrain doctor RUN_DIR``: print the hang doctor's last report of a run.

A multi-process run's hang doctor (pipetrain.runtime.hang) writes ``RUN_DIR/doctor.json``
when a wait of the pipeline times out or a rank gets SIGUSR1: every rank's state, who
waits on whom for what message, and the rank that holds the others up or the cycle they
wait in. This prints that report again, as it was printed then (``--json``: the raw
report).

    pipetrain doctor runs/llama-default-1f1b-pp3-...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipetrain.cli.errors import UsageError

__all__ = ["add_parser", "run"]

REPORT_FILE = "doctor.json"  # pipetrain.runtime.hang.REPORT_FILE, without importing torch


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="print the hang doctor's last report of a run",
        description="Print the hang doctor's last report of a run: who waited on whom, and why.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (runs/<name>)")
    p.add_argument("--json", action="store_true", help="print the raw report (JSON)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipetrain.diagnose.doctor import format_report

    folder = Path(args.run_dir)
    path = folder / REPORT_FILE if folder.is_dir() else folder
    if not folder.exists():
        raise UsageError(f"{args.run_dir!r} does not exist: give a run folder (runs/<name>)")
    if not path.is_file():
        sys.stdout.write(
            f"no hang doctor report in {folder}: none of its waits timed out and no rank got "
            f"SIGUSR1 (send it to the launcher, or to a rank, to get one of a live run)\n"
        )
        return 1
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} is not a hang doctor report: {exc}") from None
    if args.json:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        sys.stdout.write(format_report(report) + "\n")
    return 0
