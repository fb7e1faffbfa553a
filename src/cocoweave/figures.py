"""Figures drawn with matplotlib's object API (a `Figure` on an Agg canvas), never pyplot: the user's
backend and their open figures are left as they were (a notebook keeps its inline plots)."""

from __future__ import annotations

from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def figure(**kwargs: Any) -> Figure:
    """A new figure (`Figure(**kwargs)`) drawn by its own Agg canvas, outside pyplot's list of figures."""
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig
