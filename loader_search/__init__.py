"""loader-search: find the DataLoader settings that make real training fast without making the
model worse. See README.md; the Python API is `run_study` with a `Workload` and `StudyConfig`.

Names are imported lazily, so ``loader-search --help`` and error messages do not wait for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CpuRange": "loader_search.space",
    "IntRange": "loader_search.space",
    "SearchSpace": "loader_search.space",
    "LoaderParams": "loader_search.params",
    "dataloader_snippet": "loader_search.params",
    "SamplerConfig": "loader_search.config",
    "StudyConfig": "loader_search.config",
    "load_config": "loader_search.config",
    "StudySummary": "loader_search.recommend",
    "run_study": "loader_search.runner",
    "init_study": "loader_search.runner",
    "run_worker": "loader_search.runner",
    "TrainingSettings": "loader_search.params",
    "TrialResult": "loader_search.trial",
    "run_trial": "loader_search.trial",
    "Workload": "loader_search.workloads",
    "UserError": "loader_search.errors",
}

__all__ = [
    "CpuRange",
    "IntRange",
    "LoaderParams",
    "SamplerConfig",
    "SearchSpace",
    "StudyConfig",
    "StudySummary",
    "TrainingSettings",
    "TrialResult",
    "UserError",
    "Workload",
    "__version__",
    "dataloader_snippet",
    "init_study",
    "load_config",
    "run_study",
    "run_trial",
    "run_worker",
]

if TYPE_CHECKING:
    from loader_search.config import SamplerConfig, StudyConfig, load_config
    from loader_search.errors import UserError
    from loader_search.params import LoaderParams, dataloader_snippet
    from loader_search.recommend import StudySummary
    from loader_search.runner import init_study, run_study, run_worker
    from loader_search.space import CpuRange, IntRange, SearchSpace
    from loader_search.trial import TrialResult, run_trial
    from loader_search.workloads import Workload


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loader_search' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
