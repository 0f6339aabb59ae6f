"""A package's face, lazily: the names it offers, each imported from its module on first use.

A face lets callers import from the package (``from loader_search.trial import TrialJob``)
without importing, at ``import loader_search.trial``, every module behind it: reading a stored
study (``best``, ``report``) must not import torch, and ``--help`` must answer at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of ``package``'s face: ``exports`` maps each name it
    offers to the module that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
