"""Running a ``pipetrain`` command that must refuse its input, in the CLI end-to-end tests."""

from __future__ import annotations

import pytest

from pipetrain.cli import main


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error of a refused ``pipetrain *argv`` run in this process (exit status
    2, nothing on stdout, no traceback)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == ""
    return lines[0]
