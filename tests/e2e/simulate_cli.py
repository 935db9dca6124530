"""Running ``pipetrain simulate`` in this process, in the CLI end-to-end tests."""

from __future__ import annotations

import pytest

from pipetrain.cli import main


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``pipetrain simulate *argv``: its exit status, stdout and stderr."""
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line error of a refused ``simulate *argv`` (exit status 2, nothing on stdout)."""
    code, out, err = cli(capsys, *argv)
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err
