"""loader-search: find the DataLoader settings that make real training fast without making the
model worse. See README.md; the Python API is `run_study` with a `Workload` and `StudyConfig`.

Names are imported lazily, so ``loader-search --help`` and error messages do not wait for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loader_search._faces import lazy
from loader_search._version import __version__

_EXPORTS = {
    "CpuRange": "loader_search.study",
    "IntRange": "loader_search.study",
    "SearchSpace": "loader_search.study",
    "LoaderParams": "loader_search.params",
    "dataloader_snippet": "loader_search._snippets",
    "SamplerConfig": "loader_search.study",
    "StudyConfig": "loader_search.study",
    "load_config": "loader_search.study",
    "StudySummary": "loader_search.study",
    "run_study": "loader_search.study",
    "LineReporter": "loader_search.study",
    "NullReporter": "loader_search.study",
    "Reporter": "loader_search.study",
    "StudyInfo": "loader_search.study",
    "TrialEvent": "loader_search.study",
    "init_study": "loader_search.study",
    "run_worker": "loader_search.study",
    "TrainingSettings": "loader_search.params",
    "TrialResult": "loader_search.trial",
    "run_trial": "loader_search.trial",
    "Workload": "loader_search.workloads",
    "UserError": "loader_search.errors",
}

__all__ = [
    "CpuRange",
    "IntRange",
    "LineReporter",
    "LoaderParams",
    "NullReporter",
    "Reporter",
    "SamplerConfig",
    "SearchSpace",
    "StudyConfig",
    "StudyInfo",
    "StudySummary",
    "TrainingSettings",
    "TrialEvent",
    "TrialResult",
    "UserError",
    "Workload",
    "__version__",
    "dataloader_snippet",
    "init_study",
    "load_config",
    "report",
    "run_study",
    "run_trial",
    "run_worker",
]

if TYPE_CHECKING:
    from loader_search._snippets import dataloader_snippet
    from loader_search.errors import UserError
    from loader_search.params import LoaderParams
    from loader_search.study import (
        CpuRange,
        IntRange,
        LineReporter,
        NullReporter,
        Reporter,
        SamplerConfig,
        SearchSpace,
        StudyConfig,
        StudyInfo,
        StudySummary,
        TrialEvent,
        init_study,
        load_config,
        run_study,
        run_worker,
    )
    from loader_search.trial import TrialResult, run_trial
    from loader_search.workloads import Workload


def report(val_loss: float) -> None:
    """Tell the trial running this training script its validation loss (call it after the
    validation that follows the training budget). Outside a trial it does nothing; it never
    raises into the script. See docs/scripts.md."""
    from loader_search.trial import report_val_loss

    report_val_loss(val_loss)


__getattr__ = lazy(__name__, _EXPORTS)
