"""One reading in a fresh Python process, for every benchmark that needs one.

``in_fresh_process(function, *args, **kwargs)`` runs a module-level function of the
benchmarks in a new interpreter (``python -m benchmarks._fresh MODULE:NAME CALL``) and returns
what it returned. A reading taken in the benchmark's own process, or in a child forked from
it, shares that process's state (imported modules, allocator arenas, torch's thread pool, the
pages a fork copies on write); a user's training script starts from nothing, and so does a
reading here. Arguments and the result cross the process boundary as JSON, so both must be
plain data (numbers, strings, lists, dicts).

This module imports nothing from `loader_search`: the plain loops it runs
(`benchmarks.reference`, the DDP loop of `benchmarks.ranks`) are worth something only as
long as they share no code with the trial runner they check.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# One reading; a hung loader fails the benchmark instead of stalling it.
TIMEOUT_S = 600.0


def in_fresh_process(
    function: Callable[..., Any],
    /,
    *args: Any,
    timeout_s: float = TIMEOUT_S,
    what: str | None = None,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` called in a new Python process; its JSON result.

    Raises `RuntimeError` (naming ``what``, or the function, and the end of its stderr) when
    the process fails, and `subprocess.TimeoutExpired` after ``timeout_s``."""
    command = [
        sys.executable,
        "-m",
        "benchmarks._fresh",
        _target(function),
        json.dumps({"args": args, "kwargs": kwargs}),
    ]
    # The repository root on the path: the child imports `benchmarks` from any working folder.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    if done.returncode != 0:
        name = what or command[3]
        raise RuntimeError(f"{name} failed in a fresh process: {done.stderr.strip()[-2000:]}")
    # The last line: whatever the function or the libraries it loads print comes before it.
    return json.loads(done.stdout.strip().splitlines()[-1])


def _target(function: Callable[..., Any]) -> str:
    """``module:name`` of ``function``, as the child imports it. A function of a module run
    as ``python -m benchmarks.X`` belongs to ``__main__``: its import name is the spec's."""
    module = function.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError(f"{function.__qualname__} has no importable module")
        module = spec.name
    if "." in function.__qualname__:
        raise ValueError(f"{function.__qualname__}: only a module-level function can be called")
    return f"{module}:{function.__qualname__}"


def main(argv: list[str]) -> None:
    """The child's side: import ``MODULE:NAME``, call it with the JSON call, print its JSON
    result as the last line."""
    target, call = argv
    module, _, name = target.partition(":")
    function = getattr(importlib.import_module(module), name)
    arguments = json.loads(call)
    print(json.dumps(function(*arguments["args"], **arguments["kwargs"])))


if __name__ == "__main__":
    main(sys.argv[1:])
