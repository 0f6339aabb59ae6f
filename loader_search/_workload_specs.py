"""Workload specs, without importing torch: which names are built in, which name a plug-in
file, and how a config file's relative paths resolve (`loader_search.study.config._config` reads
configs before anything heavy is imported)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BUILTIN_WORKLOADS: dict[str, str] = {
    "synthetic-images": "loader_search.workloads.synthetic_images:synthetic_images",
    "digits": "loader_search.workloads.digits:digits",
    "image-folder": "loader_search.workloads.image_folder:image_folder",
    "synthetic-text": "loader_search.workloads.synthetic_text:synthetic_text",
}

# Options of built-in workloads that name a file or folder: in a config file, a relative one
# resolves against the file's folder, as a relative plug-in path does (`resolve_paths`).
PATH_OPTIONS: dict[str, tuple[str, ...]] = {"image-folder": ("root",)}


def is_file(module_part: str) -> bool:
    """Whether a spec's part before ``:factory`` names a file (else a module)."""
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


def plugin_key(spec: str) -> str:
    """``spec`` in the form two names of one plug-in share: a file plug-in by its real path
    (``./my.py:f`` and ``/abs/my.py:f`` are one), a module plug-in as written."""
    module_part, sep, attr = spec.strip().rpartition(":")
    if sep and is_file(module_part):
        return f"{os.path.realpath(module_part)}:{attr}"
    return spec.strip()


def resolve_paths(spec: str, options: Mapping[str, Any], base: Path) -> tuple[str, dict[str, Any]]:
    """``spec`` and ``options`` with their relative paths made absolute against ``base``: a
    file plug-in's path, and the path options of a built-in (`PATH_OPTIONS`)."""
    options = dict(options)
    for key in PATH_OPTIONS.get(spec, ()):
        value = options.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            options[key] = os.path.normpath(base / value)
    module_part, sep, attr = spec.rpartition(":")
    relative = not Path(module_part).expanduser().is_absolute()
    if spec not in BUILTIN_WORKLOADS and sep and is_file(module_part) and relative:
        spec = f"{os.path.normpath(base / module_part)}:{attr}"
    return spec, options
