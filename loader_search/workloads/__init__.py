"""Workloads: built-in ones by name, users' own as ``module:factory`` or ``file.py:factory``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from loader_search._workload_specs import (
    BUILTIN_WORKLOADS,
    PATH_OPTIONS,
    is_file,
    plugin_key,
    resolve_paths,
)
from loader_search.errors import UserError, shorten
from loader_search.workloads._base import Workload, sgd_momentum

__all__ = [
    "ALLOW_PLUGINS_ENV",
    "BUILTIN_WORKLOADS",
    "PATH_OPTIONS",
    "Workload",
    "check_allowed",
    "check_workload",
    "load_workload",
    "resolve_factory",
    "resolve_paths",
    "sgd_momentum",
]

WorkloadFactory = Callable[..., Workload]

_FORMS = (
    f"use one of {', '.join(BUILTIN_WORKLOADS)}, 'package.module:factory'"
    " or 'path/to/file.py:factory'"
)


ALLOW_PLUGINS_ENV = "LOADER_SEARCH_ALLOW_PLUGINS"


def check_allowed(spec: str, allowed: Iterable[str] = ()) -> None:
    """Refuse, before anything is imported, a workload that this machine's operator did not
    allow: a built-in, or a plug-in named in ``allowed`` (``worker --allow-plugin``) or in
    ``$LOADER_SEARCH_ALLOW_PLUGINS`` (comma-separated).

    A worker takes the workload spec from the study, and the study lives in a database that
    everyone on the team can write. Without this check, whoever can write a study's stored
    config chooses the code every joining worker runs (``{"name": "os:system", ...}``).
    """
    if spec in BUILTIN_WORKLOADS:
        return
    from_env = os.environ.get(ALLOW_PLUGINS_ENV, "").split(",")
    keys = {plugin_key(entry) for entry in [*allowed, *from_env] if entry.strip()}
    if plugin_key(spec) in keys:
        return
    shown = spec if len(spec) <= 200 else spec[:200] + "..."
    raise UserError(
        f"the study's workload {shown!r} is a plug-in this machine has not allowed: a worker"
        f" runs built-in workloads ({', '.join(BUILTIN_WORKLOADS)}) and only the plug-ins its"
        f" operator allows; if you trust this code, pass --allow-plugin {shown!r} (or add it"
        f" to {ALLOW_PLUGINS_ENV})"
    )


def resolve_factory(spec: str) -> WorkloadFactory:
    """The factory function a workload spec names; `UserError` if it cannot be found."""
    target = BUILTIN_WORKLOADS.get(spec, spec)
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise UserError(f"unknown workload {spec!r}: {_FORMS}")
    if is_file(module_part):
        module = _import_file(spec, Path(module_part))
    else:
        if module_part.startswith("."):
            raise UserError(
                f"workload {spec!r}: relative module names do not work here; give the full"
                " 'package.module:factory' or 'path/to/file.py:factory'"
            )
        try:
            with _importing(spec, module_part):
                module = importlib.import_module(module_part)
        except UserError as error:
            cause = error.__cause__
            missing = cause.name if isinstance(cause, ModuleNotFoundError) else None
            if missing is not None and module_part.startswith(missing):
                raise UserError(
                    f"workload {spec!r}: no module named {module_part!r} on the Python"
                    " path; install it or use 'path/to/file.py:factory'"
                ) from None
            raise
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise UserError(
            f"workload {spec!r}: {module_part} has no function {attr!r}; name a function that"
            " returns a loader_search.Workload"
        )
    return factory  # type: ignore[no-any-return]


def _import_file(spec: str, path: Path) -> Any:
    if not path.is_file():
        relative = (
            "" if path.is_absolute() else " (a relative path resolves against the current folder)"
        )
        raise UserError(
            f"workload {spec!r}: file {str(path.absolute())!r} does not exist{relative}"
        )
    name = f"loader_search_user_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"workload {spec!r}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    # The plug-in's folder goes on the path, as `python path/to/file.py` would put it, so that
    # it can import the modules beside it (`from mydata import parts`).
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    # Registered so pickling (e.g. DataLoader workers under spawn) can find the module's classes.
    sys.modules[name] = module
    try:
        with _importing(spec, str(path)):
            module_spec.loader.exec_module(module)
    except UserError:
        del sys.modules[name]
        raise
    return module


@contextlib.contextmanager
def _importing(spec: str, what: str) -> Iterator[None]:
    """Importing a plug-in runs the user's code: whatever it raises (a SyntaxError, a missing
    dependency, a RuntimeError, even ``sys.exit()``) becomes one line that names the plug-in,
    the error and how to see the whole traceback. Ctrl-C stays Ctrl-C."""
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise _failed(spec, f"importing {what}", exc) from exc


def _failed(spec: str, doing: str, exc: BaseException) -> UserError:
    """The one line for an exception the user's code raised while ``doing`` something."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, SystemExit):
        first = f"the plug-in called sys.exit({exc.code!r})"
    where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
    return UserError(
        f"workload {shorten(spec)!r}: {doing} failed: {type(exc).__name__}:"
        f" {shorten(first)}{where}; fix the plug-in (run with --debug, or try it in Python,"
        " to see the traceback)"
    )


def check_workload(spec: str, options: Mapping[str, Any] | None = None) -> WorkloadFactory:
    """Find the factory and check the option names, without building any data (cheap)."""
    factory = resolve_factory(spec)
    options = dict(options or {})
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        accepted = ", ".join(inspect.signature(factory).parameters) or "none"
        raise UserError(
            f"workload {spec!r} does not accept options {sorted(options)} ({exc});"
            f" accepted: {accepted}"
        ) from None
    return factory


def load_workload(spec: str, options: Mapping[str, Any] | None = None) -> Workload:
    """Build the workload ``spec`` names, passing ``options`` as keyword arguments.

    Whatever the factory raises is a `UserError` naming the workload: a wrong option value
    (the built-ins raise ValueError, TypeError or ImportError for those, and their messages
    name the option) as it is, anything else (a KeyError, a missing file, ``sys.exit()``) as
    a plug-in to fix. Ctrl-C stays Ctrl-C.
    """
    factory = check_workload(spec, options)
    options = dict(options or {})
    try:
        workload = factory(**options)
    except (ValueError, TypeError, ImportError) as exc:
        # A wrong option value (the factories validate them) or a missing optional package.
        raise UserError(f"workload {spec!r}: {type(exc).__name__}: {exc}") from exc
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise _failed(spec, "building it", exc) from exc
    if not isinstance(workload, Workload):
        raise UserError(
            f"workload {spec!r} returned {type(workload).__name__}, not a loader_search.Workload"
        )
    return workload
