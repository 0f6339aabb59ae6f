"""The Optuna adapter: one Optuna trial = suggest settings, run a real training, record it."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable

import optuna
import torch

from loader_search.errors import TrainingDiverged
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.recommend import BASELINE_ATTR, PARAMS_ATTR
from loader_search.space import ResolvedSpace
from loader_search.trial import run_trial
from loader_search.workloads import Workload

FAILURE_REASON = "failure_reason"
FAILURE_MESSAGE = "failure_message"
FAILURE_TRACEBACK = "failure_traceback"
INTERRUPTED = "interrupted"  # a failure_reason: the user pressed Ctrl-C


class TrialFailed(Exception):
    """A trial's training failed; the reason is stored on the trial and the study goes on."""


class Objective:
    """Callable for ``study.optimize``: returns ``(throughput, val_loss)``.

    Every measurement is stored as a trial user attribute whose key names its unit, and the
    effective settings (including the derived thread count) under ``loader_params``.
    """

    def __init__(
        self,
        workload: Workload,
        space: ResolvedSpace,
        settings: TrainingSettings,
        device: torch.device,
        on_start: Callable[[int, LoaderParams], None] = lambda number, params: None,
    ) -> None:
        self.workload = workload
        self.space = space
        self.settings = settings
        self.device = device
        self.on_start = on_start

    def __call__(self, trial: optuna.Trial) -> tuple[float, float]:
        with warnings.catch_warnings():
            if trial.user_attrs.get(BASELINE_ATTR):
                # The baseline (num_workers=0) may sit outside a searched range on purpose.
                warnings.filterwarnings("ignore", "Fixed parameter", UserWarning)
            params = self.space.suggest(trial)
        trial.set_user_attr(PARAMS_ATTR, params.as_dict())
        self.on_start(trial.number, params)
        try:
            result = run_trial(self.workload, params, self.settings, self.device)
        except KeyboardInterrupt:
            trial.set_user_attr(FAILURE_REASON, INTERRUPTED)
            raise
        except TrainingDiverged as exc:
            _record_failure(trial, "diverged", exc)
            raise TrialFailed(str(exc)) from exc
        except Exception as exc:
            _record_failure(trial, "exception", exc)
            raise TrialFailed(f"{type(exc).__name__}: {exc}") from exc
        for key, value in result.user_attrs().items():
            trial.set_user_attr(key, value)
        return result.throughput_samples_per_s, result.val_loss


def _record_failure(trial: optuna.Trial, reason: str, exc: BaseException) -> None:
    trial.set_user_attr(FAILURE_REASON, reason)
    trial.set_user_attr(FAILURE_MESSAGE, f"{type(exc).__name__}: {exc}"[:2000])
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    trial.set_user_attr(FAILURE_TRACEBACK, "".join(lines)[-4000:])
