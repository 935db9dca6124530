"""Step ranges in the config: ``"5-6"`` or ``"3"``, steps counted from 1 as the progress
counts them (``run.profile``)."""

from __future__ import annotations

import re

from pipetrain.config.errors import ConfigError

__all__ = ["parse_steps"]

_STEPS = re.compile(r"^(\d{1,9})(?:-(\d{1,9}))?$")


def parse_steps(key: str, text: str, last_step: int) -> range:
    """The steps ``text`` names (empty for ""); ConfigError naming ``key`` when it is not
    FIRST-LAST with 1 <= FIRST <= LAST <= ``last_step``."""
    if not text:
        return range(0)
    match = _STEPS.match(text)
    if match is None:
        raise ConfigError(
            f"{key} {text!r} is not a step or a range of steps: write e.g. 5-6 or 3 "
            f"(steps counted from 1)"
        )
    first = int(match.group(1))
    last = int(match.group(2) or first)
    if not 1 <= first <= last:
        raise ConfigError(f"{key} {text!r} names no step: give FIRST-LAST with 1 <= FIRST <= LAST")
    if last > last_step:
        raise ConfigError(
            f"{key} {text!r} goes past the run's last step ({last_step}): give steps within "
            f"1-{last_step}, or raise --steps"
        )
    return range(first, last + 1)
