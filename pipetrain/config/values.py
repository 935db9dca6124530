"""The checks every section of ``pipetrain.config.schema`` applies to single values.

Each raises ``ConfigError`` with one line that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipetrain.config.errors import ConfigError

__all__ = ["at_least", "check_values", "one_of", "run_name_error"]


def check_values(section: str, table: Any) -> None:
    """NaN or infinity in any float field: a run that would diverge, hang or crash late.

    Also text that is not Unicode (bytes that are not UTF-8 in an argument reach Python
    as lone surrogates): the config saved for a launched run could not hold it. Run after
    a section's own checks, whose messages are more specific for the fields they cover.
    """
    for f in dataclasses.fields(table):
        value = getattr(table, f.name)
        key = f"{section}.{f.name}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} is {value}: give a finite number (default {f.default})")
        if isinstance(value, str) and not _is_unicode(value):
            raise ConfigError(f"{key} {value!r} is not valid UTF-8 text: fix its value")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{key} is {value}: it must be at least {low}")


def one_of(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} is {value!r}: use one of {', '.join(choices)}")


def run_name_error(name: str) -> str:
    """The message for a run name that is not a plain folder name."""
    return f"run.name {name!r} is not a plain folder name: use letters, digits, '.', '_' and '-'"
