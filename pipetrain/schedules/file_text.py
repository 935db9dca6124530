"""The text of a schedule file: reading and writing it, and one cell (or JSON item) as an
action, with the one-line errors for what users get wrong (a spreadsheet's ';' between
actions, lower-case kinds, PyTorch pipelining's own actions, a binary or huge file).

``pipetrain.schedules.io`` builds CSV and JSON schedules on top of these.
"""

from __future__ import annotations

import codecs
import re
from pathlib import Path
from typing import Any

from pipetrain.schedules.actions import Action, ActionParseError, parse_action
from pipetrain.schedules.schedule import ScheduleError

__all__ = ["LONGEST_CELL", "parse_cell", "read_text", "shown", "write_text"]


# Far more than any schedule the simulator or the runtime gets through in minutes (8 million
# actions of about 8 bytes): a bigger file is another kind of file, e.g. a data set passed
# by mistake, which is refused before it is read into memory.
_MOST_BYTES = 64 * 2**20


def read_text(path: str | Path) -> str:
    """The text of a schedule file, or a one-line ``ScheduleError`` saying what is wrong."""
    try:
        with open(path, "rb") as file:
            # One byte past the limit tells a file at it from a longer one (a pipe or a
            # device such as /dev/zero has no size to ask for first).
            data = file.read(_MOST_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ScheduleError(
            f"cannot read schedule file {str(path)!r}: {reason}: check the path"
        ) from exc
    if len(data) > _MOST_BYTES:
        raise ScheduleError(
            f"schedule file {str(path)!r} is over {_MOST_BYTES // 2**20} MiB, far more than a "
            "schedule takes: check the path (a CSV or JSON schedule, one row per rank)"
        )
    # utf-8-sig: spreadsheets (Excel's "CSV UTF-8") start the file with a byte-order mark,
    # which would otherwise glue itself to the first action ('\ufeff0F0').
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        # The decoder counts from after the mark; the user's editor counts from the start.
        offset = exc.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
        raise ScheduleError(
            f"schedule file {str(path)!r} is not UTF-8 text (byte {offset} cannot be "
            "decoded): give a CSV or JSON schedule saved as UTF-8"
        ) from exc


# Longer than any action text ("12ALLREDUCE", "3SEND_B4096"): not worth quoting whole in a
# one-line error (a binary file or a runaway quote can make a cell megabytes long).
LONGEST_CELL = 40


def parse_cell(text: str, where: str) -> Action:
    """The action in one CSV cell or JSON item, or a ScheduleError naming ``where``."""
    # Measured without the spaces that align a hand-edited file's columns.
    core = text.strip()
    if len(core) > LONGEST_CELL:
        raise ScheduleError(
            f"{where}: {core[:16]!r}... ({len(core)} characters) is not an action: write one "
            "action per cell, e.g. '3F12', '0I4', '1W4', '2B0'"
        )
    try:
        return parse_action(text)
    except (ActionParseError, ValueError) as exc:
        if _several_actions(core):
            raise ScheduleError(
                f"{where}: {core!r} holds several actions: separate them with commas, one "
                "action per cell (a spreadsheet may have saved ';' or tabs)"
            ) from exc
        torch_only = _torch_only(core)
        if torch_only:
            raise ScheduleError(f"{where}: {core!r} is {torch_only}") from exc
        if core != core.upper() and _is_action(core.upper()):
            raise ScheduleError(
                f"{where}: {core!r} is not an action: kinds are upper case, write {core.upper()!r}"
            ) from exc
        raise ScheduleError(f"{where}: {exc}") from exc


# Actions of PyTorch pipelining's CSV that have no counterpart here, and what to do instead.
_TORCH_ONLY = {
    "UNSHARD": "FSDP's gather of a stage, which pipetrain schedules leave out (train --shard "
    "handles it): remove it",
    "RESHARD": "FSDP's release of a stage, which pipetrain schedules leave out (train --shard "
    "handles it): remove it",
    "REDUCE_GRAD": "FSDP's gradient reduction, which pipetrain schedules leave out (train --dp "
    "and --shard handle it): remove it",
    "OVERLAP_F_B": "a forward and a backward overlapped in one action, which pipetrain "
    "does not run: write them as two cells, the F then the B",
}
_TORCH_ONLY_RE = re.compile(r"\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*|\(.*\)(OVERLAP_F_B)")


def _torch_only(text: str) -> str:
    """What to do with a PyTorch-only action such as '0UNSHARD', else ''."""
    match = _TORCH_ONLY_RE.fullmatch(text)
    if match is None:
        return ""
    kind = match.group(1) or match.group(2)
    return f"PyTorch pipelining's {kind}: {_TORCH_ONLY[kind]}"


def _is_action(text: str) -> bool:
    try:
        parse_action(text)
    except (ActionParseError, ValueError):
        return False
    return True


def _several_actions(text: str) -> bool:
    """True for a cell such as '0F0;0F1' or '0F0 0F1': actions joined by another separator."""
    parts = [part for part in re.split(r"[;\t| ]+", text) if part]
    return len(parts) > 1 and all(_is_action(part) for part in parts)


def write_text(path: str | Path, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ScheduleError(
            f"cannot write schedule file {str(path)!r}: {exc.strerror}: check the directory"
        ) from exc


def shown(value: Any) -> str:
    """A value for a one-line error: its start when long (a whole file's actions in one
    string would make the line megabytes)."""
    text = repr(value)
    return text if len(text) <= LONGEST_CELL else text[:LONGEST_CELL] + "..."
