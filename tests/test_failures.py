"""Failing trials inside real studies: each failure is recorded with its reason, the worker
carries on, out-of-memory regions become infeasible (and are not trained twice).

Every study here queues its trials in a known order: the faulty settings first, then
settings that train, so "the next trial runs and completes" is checked, not hoped for.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.trial import TrialState
from torch import nn

from loader_search.params import TrainingSettings, TrialLimits
from loader_search.study import (
    CpuRange,
    IntRange,
    SamplerConfig,
    SearchSpace,
    StudyConfig,
    init_study,
    run_study,
)
from loader_search.study._keys import INFERRED_FROM
from loader_search.workloads import Workload
from tests._datasets import TimedDataset, linear_model

CONFIG = StudyConfig(
    confirm_top=0,  # tests count trials; tests/test_reuse.py covers re-measurement
    name="faults",
    trials=3,
    device="cpu",
    # A batch that runs out of memory is infeasible here; with accumulation ("auto") it would
    # be trained as micro-batches that fit (tests/test_accumulation.py).
    training=TrainingSettings(
        train_samples=768, batch_size=16, eval_batch_size=64, gradient_accumulation="off"
    ),
    space=SearchSpace(
        batch_sizes=(16, 32, 64),
        num_workers=CpuRange(0, 1),
        prefetch_factor=IntRange(1, 2),
        persistent_workers=False,
        torch_threads=1,
    ),
    sampler=SamplerConfig("random"),
    limits=TrialLimits(trial_timeout_s=5.0, memory_limit_gb=0.75),
)
GOOD = {"batch_size": 16, "num_workers": 0}
FAULTY = {"batch_size": 32, "num_workers": 0}
IN_WORKER = {"batch_size": 16, "num_workers": 1, "prefetch_factor": 1}


class FaultAtBatch(nn.Module):
    """The linear model; while training, a batch of ``size`` samples triggers ``fault``.
    (Evaluation uses its own batch size, so only the settings under test fail.)"""

    def __init__(self, size: int, fault: Callable[[], None], log: Path | None) -> None:
        super().__init__()
        self.inner = linear_model()
        self.size = size
        self.fault = fault
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and len(x) >= self.size:
            if self.log is not None:
                with self.log.open("a") as f:
                    f.write(f"{len(x)}\n")
            self.fault()
        out: torch.Tensor = self.inner(x)
        return out


class SegfaultInWorkers(TimedDataset):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().__getitem__(index)


def _raise(exc: BaseException) -> Callable[[], None]:
    def fault() -> None:
        raise exc

    return fault


def _signal(number: int) -> Callable[[], None]:
    def fault() -> None:
        import faulthandler

        faulthandler.disable()
        os.kill(os.getpid(), number)

    return fault


_HOARD: list[torch.Tensor] = []


def _hog() -> None:
    _HOARD.append(torch.ones(64 * 2**20 // 4))  # 64 MiB, every page written
    time.sleep(0.3)  # the parent polls memory twice a second


def _hang() -> None:
    time.sleep(3600)


def _workload(
    fault: Callable[[], None] | None = None,
    *,
    size: int = 32,
    dataset: TimedDataset | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    log: Path | None = None,
) -> Workload:
    def make_model() -> nn.Module:
        return FaultAtBatch(size, fault, log) if fault is not None else linear_model()

    extra: dict[str, Any] = {"loss_fn": loss_fn} if loss_fn is not None else {}
    return Workload(
        name="faulty",
        train_dataset=dataset if dataset is not None else TimedDataset(256),
        val_dataset=TimedDataset(64),
        make_model=make_model,
        base_lr=0.05,
        **extra,
    )


def _nan_at_32(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(outputs, targets)
    training = torch.is_grad_enabled()  # evaluation runs under no_grad with its own batch size
    return loss * float("nan") if training and len(targets) >= 32 else loss


def _study_in_order(
    url: str, workload: Workload, queue: Sequence[dict[str, Any]], config: StudyConfig = CONFIG
) -> list[optuna.trial.FrozenTrial]:
    """Run ``queue``'s settings in that order (then the baseline) and return the trials."""
    init_study(config, workload=workload, storage=url)
    study = optuna.load_study(study_name=config.name, storage=url)
    for params in queue:
        study.enqueue_trial(params)
    run_study(config, workload=workload, storage=url, n_trials=len(queue) + 1)
    return optuna.load_study(study_name=config.name, storage=url).get_trials()


CASES = {
    # name: (workload, settings that fail, reason, infeasible)
    "user code raises": (lambda: _workload(_raise(ValueError("bad batch"))), FAULTY, "exception"),
    "cuda out of memory": (
        lambda: _workload(_raise(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried"))),
        FAULTY,
        "cuda_oom",
    ),
    "host allocation fails": (
        lambda: _workload(lambda: torch.empty(2**60, dtype=torch.uint8) and None),
        FAULTY,
        "host_oom",
    ),
    "memory limit": (lambda: _workload(_hog), FAULTY, "host_oom"),
    "killed by the kernel": (lambda: _workload(_signal(signal.SIGKILL)), FAULTY, "host_oom"),
    "segfault": (lambda: _workload(_signal(signal.SIGSEGV)), FAULTY, "crashed"),
    "diverges": (lambda: _workload(loss_fn=_nan_at_32), FAULTY, "diverged"),
    "hangs": (lambda: _workload(_hang), FAULTY, "timeout"),
    "loader worker segfaults": (
        lambda: _workload(dataset=SegfaultInWorkers(256)),
        IN_WORKER,
        "worker_killed",
    ),
}
INFEASIBLE = {"cuda_oom", "host_oom", "diverged"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failure_is_recorded_and_the_next_trial_completes(case: str, sqlite_url: str) -> None:
    make, settings, reason = CASES[case]
    trials = _study_in_order(sqlite_url, make(), [settings, GOOD])
    faulty, good, baseline = trials
    assert faulty.user_attrs["failure_reason"] == reason
    assert faulty.user_attrs["failure_message"]
    assert faulty.user_attrs["failure_hint"]
    if reason in INFEASIBLE:
        assert faulty.state == TrialState.COMPLETE
        assert faulty.constraints == {"feasible": 1.0}
    else:
        assert faulty.state == TrialState.FAIL
    assert good.state == TrialState.COMPLETE and good.constraints == {"feasible": 0.0}
    assert baseline.state == TrialState.COMPLETE and baseline.user_attrs["baseline"]
    study = optuna.load_study(study_name="faults", storage=sqlite_url)
    assert faulty.number not in {t.number for t in study.best_trials}


def test_user_code_failures_keep_the_traceback_tail(sqlite_url: str) -> None:
    (faulty, _, _) = _study_in_order(
        sqlite_url, _workload(_raise(ValueError("bad batch"))), [FAULTY, GOOD]
    )
    assert faulty.user_attrs["failure_message"].startswith("ValueError: bad batch")
    assert "in forward" in faulty.user_attrs["failure_traceback"]


def test_a_known_out_of_memory_region_is_not_trained_again(
    sqlite_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "trained.log"  # the model writes a line whenever it meets the fault
    workload = _workload(_raise(torch.cuda.OutOfMemoryError("CUDA out of memory")), log=log)
    first = {"batch_size": 32, "num_workers": 1, "prefetch_factor": 2}
    bigger = {"batch_size": 64, "num_workers": 1, "prefetch_factor": 2}
    fewer_in_flight = {"batch_size": 64, "num_workers": 0}  # 0 batches in flight, not 2
    trials = _study_in_order(sqlite_url, workload, [first, bigger, fewer_in_flight, GOOD])
    oom, inferred, trained, good, _ = trials
    assert oom.user_attrs["failure_reason"] == "cuda_oom"
    assert inferred.user_attrs["failure_reason"] == "inferred_oom"
    assert inferred.user_attrs[INFERRED_FROM] == oom.number
    assert f"#{oom.number}" in inferred.user_attrs["failure_message"]
    assert inferred.state == TrialState.COMPLETE and inferred.constraints == {"feasible": 1.0}
    assert inferred.user_attrs["trial_wall_time_s"] == 0.0
    # Batch 64 with no workers needs less memory in flight: it was trained (and ran out of
    # memory for real); the inferred one never reached the model.
    assert trained.user_attrs["failure_reason"] == "cuda_oom"
    assert log.read_text().split() == ["32", "64"]
    assert good.state == TrialState.COMPLETE


def test_infeasible_batch_sizes_are_kept_off_the_front(sqlite_url: str) -> None:
    """A whole study over a space whose large batches run out of memory."""
    workload = _workload(_raise(torch.cuda.OutOfMemoryError("CUDA out of memory")))
    config = dataclasses.replace(CONFIG, trials=8, sampler=SamplerConfig("random"))
    summary = run_study(config, workload=workload, storage=sqlite_url)
    study = optuna.load_study(study_name="faults", storage=sqlite_url)
    infeasible = [t for t in study.trials if t.constraints.get("feasible", 0) > 0]
    assert infeasible, "the random sampler should have tried batch 32 or 64 in 8 trials"
    for trial in infeasible:
        assert trial.params["batch_size"] >= 32
        assert trial.user_attrs["failure_reason"] in ("cuda_oom", "inferred_oom")
    assert summary.n_infeasible == len(infeasible)
    assert summary.pareto and all(p.params.batch_size == 16 for p in summary.pareto)
    assert {p.number for p in summary.pareto} == {t.number for t in study.best_trials}
