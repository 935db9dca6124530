"""Pipeline schedules as data. Imports no torch."""

from pipetrain.schedules.actions import Action, ActionParseError, Kind, parse_action
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule, ScheduleError

__all__ = [
    "Action",
    "ActionParseError",
    "Kind",
    "Placement",
    "Schedule",
    "ScheduleError",
    "parse_action",
]
