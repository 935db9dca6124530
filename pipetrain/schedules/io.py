"""Schedules to and from files: CSV (one row per rank) and JSON (everything explicit).

CSV is PyTorch pipelining's layout: row r holds rank r's actions in order, one text form
per cell (``0F0,0F1,0B0,...``). Spaces around cells and blank cells are ignored, so a
hand-edited file may align its columns. What CSV leaves out is inferred:

- the placement, from which rank runs each stage: ``linear`` (stage s on rank s),
  ``looped`` (stage s on rank s mod p, more stages than ranks), ``v`` (rank r holds r and
  2p-1-r), ``bidirectional`` (the V's map with ``ALLREDUCE`` actions: Chimera's two
  replicas), else ``custom``; a stage found on two ranks belongs to the one that runs most
  of its actions, and the validator reports the others;
- the micro-batch count, as the largest micro-batch number plus one;
- ``asynchronous``, when there is a ``STEP``;
- the name, from the file name.

JSON holds ``{"format": 1, "name", "pp", "microbatches", "placement": {"kind",
"stage_to_rank", "num_model_stages"}, "asynchronous", "actions": [["0F0", ...], ...]}``
(and optionally ``params``). Loading either always runs the validator; every malformed
input raises ``ScheduleError`` with one line that says what to fix, and a file over 64 MiB
is refused unread. CSV keeps no ``params``: an asynchronous schedule saved as CSV loses its
``window`` and ``steps`` (the simulator then reports one step of the whole stream); JSON
keeps them.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.file_text import LONGEST_CELL, parse_cell, read_text, shown, write_text
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule, ScheduleError
from pipetrain.schedules.validate import validate

__all__ = ["FORMAT", "dump_csv", "dump_json", "load_csv", "load_json"]

FORMAT = 1


# ----------------------------------------------------------------------------- CSV
def dump_csv(schedule: Schedule, path: str | Path) -> None:
    """Write one row per rank, one action text per cell."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in schedule.actions:
        writer.writerow([str(a) for a in row])
    write_text(path, out.getvalue())


def load_csv(
    path: str | Path,
    *,
    num_ranks: int | None = None,
    name: str | None = None,
    microbatches: int | None = None,
) -> Schedule:
    """Read and validate a CSV schedule (see the module doc for what is inferred).

    ``num_ranks`` (e.g. the ``--pp`` a user asked for) must match the number of rows and
    ``microbatches`` (``--microbatches``) the count the file numbers, 0..m-1.
    """
    rows = _read_rows(path)
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise ScheduleError(
            f"{path} has no actions: write one row of actions per rank, e.g. 0F0,0B0"
        )
    # A blank line between rows would be a rank that holds no stage: every later rank
    # shifts by one and the report counts an idle rank (pp one too many).
    empty = next((rank for rank, row in enumerate(rows) if not row), None)
    if empty is not None:
        raise ScheduleError(
            f"{path} row {empty + 1} (rank {empty}) has no actions but later rows do: remove "
            f"the blank row or give rank {empty} its actions"
        )
    if num_ranks is not None and len(rows) != num_ranks:
        raise ScheduleError(
            f"{path} has {len(rows)} rows but {num_ranks} ranks were asked for: give one row "
            "per rank or change --pp"
        )
    placement = _infer_placement(rows, path)
    mbs = [a.microbatch for row in rows for a in row if a.microbatch is not None]
    numbered = max(mbs, default=0) + 1
    if microbatches is not None and microbatches != numbered:
        # Said here: the validator would call it a micro-batch that never runs, or one out of
        # range, as if the file were wrong rather than the count asked for.
        raise ScheduleError(
            f"{path} numbers its micro-batches 0..{numbered - 1} ({numbered}), not the "
            f"{microbatches} asked for: use --microbatches {numbered}"
        )
    schedule = Schedule.build(
        name or Path(path).stem,
        placement,
        numbered,
        rows,
        asynchronous=any(a.kind is Kind.STEP for row in rows for a in row),
    )
    validate(schedule)
    return schedule


def _read_rows(path: str | Path) -> list[list[Action]]:
    """The actions of each CSV row; blank cells skipped, trailing blank rows kept."""
    reader = csv.reader(io.StringIO(read_text(path)))
    rows: list[list[Action]] = []
    try:
        for cells in reader:
            line_no = reader.line_num
            rows.append(
                [
                    parse_cell(cell, f"{path} row {line_no}, column {col}")
                    for col, cell in enumerate(cells, start=1)
                    if cell.strip()
                ]
            )
    except csv.Error as exc:
        # A cell over the csv module's limit (128 KiB), e.g. a quote that is never closed.
        raise ScheduleError(
            f"{path} row {reader.line_num}: not a CSV of actions ({exc}): write one row of "
            "actions per rank, e.g. 0F0,0B0"
        ) from exc
    return rows


def _infer_placement(rows: list[list[Action]], path: str | Path) -> Placement:
    p = len(rows)
    # Each stage belongs to the rank that runs most of its actions (the lowest on a tie).
    counts: dict[int, Counter[int]] = defaultdict(Counter)
    for rank, row in enumerate(rows):
        for action in row:
            counts[action.stage][rank] += 1
    owner = {s: min(c, key=lambda r: (-c[r], r)) for s, c in counts.items()}
    # Stages 0..n-1 without gaps, else the first gap lies below n (never build range(max)).
    gap = next((s for s in range(len(owner)) if s not in owner), None)
    if gap is not None:
        raise ScheduleError(
            f"{path}: stage {gap} never appears, but stage {max(owner)} does: number the "
            "stages 0, 1, 2, ... without gaps"
        )
    stage_to_rank = tuple(owner[s] for s in range(len(owner)))
    n = len(stage_to_rank)
    has_allreduce = any(a.kind is Kind.ALLREDUCE for row in rows for a in row)
    candidates = [Placement.linear(p)]
    if n % p == 0 and n > p:
        candidates.append(Placement.looped(p, n // p))
    if n == 2 * p:
        candidates.append(Placement.bidirectional(p) if has_allreduce else Placement.v_shape(p))
    for candidate in candidates:
        if candidate.stage_to_rank == stage_to_rank:
            return candidate
    return Placement.custom(stage_to_rank, num_ranks=p)


# ----------------------------------------------------------------------------- JSON
def dump_json(schedule: Schedule, path: str | Path) -> None:
    """Write the schedule with its placement and parameters spelled out."""
    placement = schedule.placement
    document = {
        "format": FORMAT,
        "name": schedule.name,
        "pp": schedule.num_ranks,
        "microbatches": schedule.microbatches,
        "placement": {
            "kind": placement.kind,
            "stage_to_rank": list(placement.stage_to_rank),
            "num_model_stages": placement.num_model_stages,
        },
        "asynchronous": schedule.asynchronous,
        "params": dict(schedule.params),
        "actions": [[str(a) for a in row] for row in schedule.actions],
    }
    write_text(path, json.dumps(document, indent=1) + "\n")


def _field(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise ScheduleError(f"{where}: missing field {key!r}: add it (see pipetrain.schedules.io)")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ScheduleError(f"{where}: field {key!r} must be {names}, got {shown(value)}")
    return value


def load_json(path: str | Path, *, num_ranks: int | None = None) -> Schedule:
    """Read and validate a JSON schedule."""
    text = read_text(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from exc
    except ValueError as exc:
        # Python refuses to convert an integer of more than 4300 digits (its message would
        # advise sys.set_int_max_str_digits, not what a schedule file needs).
        raise ScheduleError(
            f"{path} holds a number of thousands of digits: write counts such as 'pp' and "
            "'microbatches' as small whole numbers"
        ) from exc
    except RecursionError as exc:
        raise ScheduleError(
            f"{path} is nested too deeply to be a schedule: write a JSON object with "
            "'format', 'pp', 'actions', ..."
        ) from exc
    where = str(path)
    if not isinstance(doc, dict):
        raise ScheduleError(f"{where}: expected a JSON object with 'format', 'pp', 'actions', ...")
    version = _field(doc, "format", int, where)
    if version != FORMAT:
        raise ScheduleError(
            f"{where}: format {version} is not supported: this version reads format {FORMAT}"
        )
    _refuse_unknown(doc, _FIELDS, where)
    pp = _field(doc, "pp", int, where)
    if pp < 1:
        raise ScheduleError(f"{where}: field 'pp' must be 1 or more, got {pp}")
    if num_ranks is not None and pp != num_ranks:
        raise ScheduleError(
            f"{where} is for pp={pp} but {num_ranks} ranks were asked for: change --pp"
        )
    placement = _load_placement(_field(doc, "placement", dict, where), pp, where)
    rows = _field(doc, "actions", list, where)
    if len(rows) != pp:
        raise ScheduleError(
            f"{where}: 'actions' has {len(rows)} rows for pp={pp}: give one row per rank"
        )
    actions = []
    for r, row in enumerate(rows):
        if not isinstance(row, list):
            raise ScheduleError(f"{where}: actions row {r} must be a list of action texts")
        actions.append(
            [_item(text, f"{where}: actions row {r}, item {i}") for i, text in enumerate(row)]
        )
    microbatches = _field(doc, "microbatches", int, where)
    schedule = Schedule.build(
        _field(doc, "name", str, where),
        placement,
        microbatches,
        actions,
        asynchronous=_field(doc, "asynchronous", bool, where),
        params=_load_params(doc.get("params", {}), placement, microbatches, where),
    )
    validate(schedule)
    return schedule


# What the generators record in ``Schedule.params`` (all counts, 1 or more): ``v`` stages
# per rank and ``group`` (interleaved), ``window`` and ``steps`` (PipeDream's stream).
# The simulator divides by ``steps`` and the runtime by ``window``: a 0 there would crash
# them, and a misspelt name would silently fall back to a default.
_PARAMS = ("group", "steps", "v", "window")


def _load_params(
    params: Any, placement: Placement, microbatches: int, where: str
) -> dict[str, int]:
    if not isinstance(params, dict):
        raise ScheduleError(f"{where}: 'params' must map names to integers, got {shown(params)}")
    for name, value in params.items():
        if name not in _PARAMS:
            raise ScheduleError(
                f"{where}: unknown param {shown(name)}: use {', '.join(_PARAMS)} or leave it out"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(
                f"{where}: param {name!r} must be a whole number >= 1, got {shown(value)}"
            )
    v = params.get("v")
    if v is not None and v != placement.stages_per_rank:
        raise ScheduleError(
            f"{where}: param 'v' is {v} but the placement puts {placement.stages_per_rank} "
            "stage(s) on each rank: make them agree"
        )
    window, steps = params.get("window"), params.get("steps")
    if window is not None and steps is not None and window * steps != microbatches:
        raise ScheduleError(
            f"{where}: params window={window} x steps={steps} must equal 'microbatches' "
            f"({microbatches}), the micro-batches streamed: fix one of them"
        )
    return dict(params)


def _load_placement(doc: dict[str, Any], pp: int, where: str) -> Placement:
    at = f"{where}: placement"
    _refuse_unknown(doc, _PLACEMENT_FIELDS, at)
    kind = _field(doc, "kind", str, at)
    stage_to_rank = _field(doc, "stage_to_rank", list, at)
    if not stage_to_rank or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in stage_to_rank
    ):
        raise ScheduleError(f"{at}: 'stage_to_rank' must list one rank number per stage")
    stages = _field(doc, "num_model_stages", int, at)
    if stages < 1:
        raise ScheduleError(f"{at}: field 'num_model_stages' must be 1 or more, got {stages}")
    try:
        return Placement(kind, pp, tuple(stage_to_rank), stages)
    except ValueError as exc:
        raise ScheduleError(
            f"{at}: {exc}: fix 'stage_to_rank' (ranks 0..{pp - 1}) or 'num_model_stages'"
        ) from exc


# Every field a format-1 file may hold: a misspelt optional one ("param") would otherwise
# be ignored without a word.
_FIELDS = ("format", "name", "pp", "microbatches", "placement", "asynchronous", "params", "actions")
_PLACEMENT_FIELDS = ("kind", "stage_to_rank", "num_model_stages")


def _refuse_unknown(doc: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ScheduleError(
            f"{where}: unknown field {shown(unknown[0])}: use {', '.join(known)} or leave it out"
        )


def _item(item: Any, where: str) -> Action:
    """One JSON action: a string such as "0F0" (a number or null never names an action)."""
    if not isinstance(item, str):
        raise ScheduleError(
            f"{where}: {json.dumps(item)[:LONGEST_CELL]} is not an action text: write each "
            'action as a string, e.g. "0F0"'
        )
    return parse_cell(item, where)
