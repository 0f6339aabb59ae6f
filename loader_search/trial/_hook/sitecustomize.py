"""Start-up hook of a command workload's processes (this folder leads their PYTHONPATH).

Python imports the first ``sitecustomize`` on its path at start-up, in every interpreter of
the command (the script, torchrun's ranks, spawned loader workers). This one first runs the
``sitecustomize`` the user's environment already had, so putting it first hides nothing, then
installs `loader_search.trial._inject` inside a trial. Nothing here may raise into the user's
program: a failure is written to ``<trial dir>/hook-error-<pid>.txt`` (what the hook could not
import, to ``import-error-<pid>.json``) and the script runs on, unmeasured. It must stay
importable by any Python the command uses, with or without loader_search.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys


def _chain_user_sitecustomize() -> None:
    # Our folder leaves the path and our module sys.modules for the time of one import, so
    # `import sitecustomize` finds the next one; ours is put back after.
    here = os.path.dirname(os.path.realpath(__file__))
    path = list(sys.path)
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in path if os.path.realpath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":
            _say_like_site(exc)
    except Exception as exc:
        _say_like_site(exc)
    finally:
        sys.path[:] = path
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _say_like_site(exc: BaseException) -> None:
    # What site.py itself says of a failing sitecustomize.
    if sys.flags.verbose:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    else:
        sys.stderr.write(
            f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
            f"{type(exc).__name__}: {exc}\n"
        )


# What the hook imports beyond the standard library, some of it only when it first writes its
# state (a loader's first batch, the process's exit): missing, the hook would fail there, after
# the script's own error, and hide it.
_HOOK_NEEDS = ("psutil",)


def _install() -> None:
    folder = os.environ.get("LOADER_SEARCH_TRIAL_DIR")
    if not folder:
        return
    try:
        missing = [name for name in _HOOK_NEEDS if importlib.util.find_spec(name) is None]
        if not missing:
            from loader_search.trial import _inject
    except ImportError as exc:
        missing = [exc.name or "loader_search"]
    except Exception as exc:
        _say(folder, f"the trial hook failed to install: {type(exc).__name__}: {exc}")
        return
    if missing:
        # Said as data: the parent names this Python and the fix in one line
        # (loader_search.trial._command_read); torch too, as the script's own error may never
        # be read (the first look stops at this file).
        torch = ["torch"] if importlib.util.find_spec("torch") is None else []
        record = {"python": sys.executable, "missing": torch + missing}
        _say(folder, json.dumps(record), name=f"import-error-{os.getpid()}.json")
        return
    try:
        _inject.install()
    except Exception as exc:
        _say(folder, f"the trial hook failed to install: {type(exc).__name__}: {exc}")


def _say(folder: str, line: str, name: str = "") -> None:
    try:
        path = os.path.join(folder, name or f"hook-error-{os.getpid()}.txt")
        with open(path, "a") as file:
            file.write(" ".join(line.split()) + "\n")
    except OSError:
        pass  # nowhere to say it: the program runs on regardless


_chain_user_sitecustomize()
_install()
