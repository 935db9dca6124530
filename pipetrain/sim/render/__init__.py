"""Pictures of timelines: a text grid, Chrome trace JSON and matplotlib Gantt charts.

All three take any ``Timeline`` (simulated or measured): ``text`` draws the grid, ``trace``
writes the trace with its communication tracks, ``gantt`` the charts. matplotlib is
imported only inside ``plot`` and ``plot_compare``, so the terminal and trace outputs work
without it.
"""

from pipetrain.sim.render.base import RenderError
from pipetrain.sim.render.gantt import KIND_COLOURS, plot, plot_compare
from pipetrain.sim.render.text import text_grid
from pipetrain.sim.render.trace import Transfer, chrome_trace, transfers, write_chrome_trace

__all__ = [
    "KIND_COLOURS",
    "RenderError",
    "Transfer",
    "chrome_trace",
    "plot",
    "plot_compare",
    "text_grid",
    "transfers",
    "write_chrome_trace",
]
