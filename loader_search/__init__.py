"""loader-search: find the DataLoader settings that make real training fast without making the
model worse. See README.md; the Python API is `run_study` with a `Workload` and `StudyConfig`."""

from __future__ import annotations

__version__ = "0.1.0"

from loader_search.config import SamplerConfig, StudyConfig, load_config  # noqa: E402
from loader_search.loader import LoaderParams, dataloader_snippet  # noqa: E402
from loader_search.recommend import StudySummary  # noqa: E402
from loader_search.runner import run_study  # noqa: E402
from loader_search.space import CpuRange, IntRange, SearchSpace  # noqa: E402
from loader_search.trial import TrainingSettings, TrialResult, run_trial  # noqa: E402
from loader_search.workloads import Workload  # noqa: E402

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
    "Workload",
    "__version__",
    "dataloader_snippet",
    "load_config",
    "run_study",
    "run_trial",
]
