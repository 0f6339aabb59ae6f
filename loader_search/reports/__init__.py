"""Reports of a finished (or running) study: collect it into plain data, then render it (HTML
with plotly, or JSON), and the optuna-dashboard front end. Reads studies; runs no trial.

What the layer offers is named here; callers outside it import from ``loader_search.reports``.
Names load lazily: plotly and optuna-dashboard load only when a report is drawn or served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loader_search._faces import lazy

_EXPORTS = {
    # a study as plain data
    "collect": "loader_search.reports._collect",
    "ReportData": "loader_search.reports._data",
    # drawn
    "render": "loader_search.reports._html",
    # served
    "serve": "loader_search.reports._dashboard",
}

__all__ = [
    "ReportData",
    "collect",
    "render",
    "serve",
]

if TYPE_CHECKING:
    from loader_search.reports._collect import collect
    from loader_search.reports._dashboard import serve
    from loader_search.reports._data import ReportData
    from loader_search.reports._html import render


__getattr__ = lazy(__name__, _EXPORTS)
