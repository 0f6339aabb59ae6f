"""The command line: commands (parse, call a service function, render) and console rendering.

Top layer: imports every layer below it; nothing imports it. This module itself stays light:
the console script imports it first, and `main` takes over Ctrl-C and SIGTERM before the
commands' imports (typer, rich, and through them much more) begin.
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loader_search.cli._commands import app

__all__ = ["app", "main"]


def main() -> int:
    """Console-script entry point.

    Ctrl-C and SIGTERM are handled from the first line on (`loader_search.interrupts`):
    Ctrl-C exits 130 and SIGTERM 143, each with one line and no traceback, whenever they
    come, even while the imports run (without this, Ctrl-C then printed a traceback of the
    import, and SIGTERM ended the process by the signal before any handler was in place).
    Before this line (the interpreter's start-up, the console script's first imports, some
    tens of milliseconds) Python's defaults apply: Ctrl-C prints its traceback, SIGTERM
    ends the process silently; nothing has been stored then.
    """
    try:
        # Inside the `try`: a Ctrl-C while the handler's own module is imported is Python's
        # KeyboardInterrupt, told as one line below like any other.
        from loader_search import interrupts

        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, interrupts.on_signal)
        from loader_search.cli._commands import app

        app(prog_name="loader-search")  # standalone: it always ends in SystemExit
    except SystemExit as exc:
        # Typer makes a KeyboardInterrupt while it reads the command line exit 130 without
        # a word; a command's own handling (`reports_errors`) has told the signal already.
        if exc.code == 130 and interrupts.pending_signal() is not None:
            return _interrupted()
        raise
    except KeyboardInterrupt:  # during the imports, or past a command's own handling
        return _interrupted()
    return 0


def _interrupted() -> int:
    from loader_search import interrupts

    name = interrupts.pending_signal() or "SIGINT"
    sys.stderr.write(f"Interrupted ({name}); run the same command again to continue.\n")
    return interrupts.exit_code()


def __getattr__(name: str) -> Any:
    # `app` is imported on first use, not with this module (see the module's docstring).
    if name == "app":
        from loader_search.cli._commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
