"""The command line: commands (parse, call a service function, render) and console rendering.

Top layer: imports every layer below it; nothing imports it.
"""

from __future__ import annotations

from loader_search.cli._commands import app, main

__all__ = ["app", "main"]
