"""Sanity checks that keep impossible numbers out (issue 13): a ceiling read while the machine
was busy, or beaten by a trial, is read again; an efficiency above 100% is flagged.

The busy machine is real: processes that spin on every CPU while a real trial reads its
ceiling. The reuse rule itself is checked on hand-made trials whose numbers are known.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import FrozenTrial, TrialState

from loader_search._system import machine_busy_cpu_s
from loader_search.params import LoaderParams, RunPlan, TrainingSettings
from loader_search.study import (
    CEILING_ATTR,
    HARDWARE_CLASS_ATTR,
    PARAMS_ATTR,
    VAL_LOSS_ATTR,
    CpuRange,
    SamplerConfig,
    SearchSpace,
    StudyConfig,
    TrialPoint,
    run_study,
    tolerance_limit,
)
from loader_search.study._keys import CEILING_LOAD_ATTR, OTHER_LOAD_ATTR, UNTRAINED_LOSS_ATTR
from loader_search.study._points import baseline_doubt
from loader_search.study.stats._confirm import DISTURBED_LOAD
from loader_search.study.work import plan_trial
from loader_search.study.work._plan import BEATEN_BY, BUSY_LIMIT, MAX_CEILING_READINGS
from loader_search.trial import run_trial
from loader_search.workloads import Workload

TRAINING = TrainingSettings(train_samples=256, batch_size=16, eval_batch_size=64)
PARAMS = LoaderParams(16, 1, 2, False, True, 1)
PLUGINS = Path(__file__).parent / "plugins"


# Starts a spinner per CPU and exits, so that the spinners are no descendants of the test
# process (a trial counts its own process tree as its own load, not another's).
_SPAWN_SPINNERS = """
import subprocess, sys
for _ in range(int(sys.argv[1])):
    spinner = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # not the pipe the test reads: it would never close
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    print(spinner.pid)
"""


@pytest.fixture
def busy_machine() -> Iterator[list[int]]:
    """Every CPU of the machine kept busy by other processes for the test's duration: two
    spinners per CPU, so that they keep well above a quarter of the machine even while the
    trial's own threads compete for it (one per CPU once read 0.23 beside a trial's 1.5
    cores)."""
    spawned = subprocess.run(
        [sys.executable, "-c", _SPAWN_SPINNERS, str(2 * (os.cpu_count() or 1))],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    spinners = [int(pid) for pid in spawned.stdout.split()]
    try:
        yield spinners
    finally:
        for pid in spinners:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# Run one at a time (the slow suite): it reads how busy its CPU was, and beside another test
# of the parallel suite a trial pinned with its spinners read 0.09-0.44 instead of 0.80.
@pytest.mark.slow
@pytest.mark.skipif(machine_busy_cpu_s() is None, reason="no /proc/stat on this system")
def test_a_ceiling_and_a_trial_read_on_a_busy_machine_say_so(
    tiny_workload: Workload, busy_machine: list[int]
) -> None:
    result = run_trial(
        tiny_workload, PARAMS, TRAINING, plan=RunPlan(short_samples=128, measure_ceiling=True)
    )
    assert result.ceiling_samples_per_s is not None
    assert result.ceiling_other_load is not None and result.ceiling_other_load > BUSY_LIMIT
    attrs = result.user_attrs()
    assert attrs[CEILING_LOAD_ATTR] == result.ceiling_other_load
    # A trial's own window too (a confirmation reading like it is measured again): over a
    # second or so, as /proc/stat counts in ticks of 10 ms. The trial and the spinners are
    # pinned to one CPU: on all of them, the scheduler once gave the trial 1.55 of 2 cores
    # and the spinners the rest (read 0.16 and 0.23 in full-suite runs), and with the trial
    # alone pinned it moved the spinners off its CPU (read 0.21 with the suite in parallel).
    everywhere = os.sched_getaffinity(0)
    for pid in (0, *busy_machine):
        os.sched_setaffinity(pid, {min(everywhere)})
    try:
        longer = run_trial(
            tiny_workload,
            PARAMS,
            dataclasses.replace(TRAINING, train_samples=4096),
            plan=RunPlan(short_samples=2048),
        )
    finally:
        for pid in (0, *busy_machine):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(pid, everywhere)
    assert longer.cpus_available == 1
    assert longer.other_load is not None and longer.other_load > DISTURBED_LOAD
    assert longer.user_attrs()[OTHER_LOAD_ATTR] == longer.other_load
    # A study holding that trial reads the ceiling again on the next trial of the pair.
    trial = _trial(
        result.throughput_samples_per_s,
        result.ceiling_samples_per_s,
        result.ceiling_other_load,
    )
    reuse = plan_trial([trial], PARAMS, TRAINING, "cpu", 256)
    assert reuse.plan.measure_ceiling and reuse.ceiling is None


def _trial(
    throughput: float, ceiling: float | None, load: float | None = 0.0, number: int = 0
) -> FrozenTrial:
    attrs: dict[str, object] = {
        PARAMS_ATTR: PARAMS.as_dict(),
        HARDWARE_CLASS_ATTR: "cpu",
        VAL_LOSS_ATTR: 1.0,
    }
    if ceiling is not None:
        attrs[CEILING_ATTR] = ceiling
        if load is not None:
            attrs[CEILING_LOAD_ATTR] = load
    trial = optuna.trial.create_trial(
        state=TrialState.COMPLETE,
        params={"num_workers": 1},
        distributions={"num_workers": IntDistribution(0, 3)},
        values=[throughput, 1.0],
        user_attrs=attrs,
    )
    trial.number = number
    return trial


def test_a_ceiling_reading_is_reused_while_nothing_contradicts_it() -> None:
    reuse = plan_trial([_trial(900.0, 1000.0)], PARAMS, TRAINING, "cpu", 256)
    assert not reuse.plan.measure_ceiling and reuse.ceiling == 1000.0
    # Older studies stored no load: their readings are reused as before.
    reuse = plan_trial([_trial(900.0, 1000.0, load=None)], PARAMS, TRAINING, "cpu", 256)
    assert reuse.ceiling == 1000.0


def test_a_ceiling_read_under_load_or_beaten_by_a_trial_is_read_again() -> None:
    busy = _trial(900.0, 1000.0, load=BUSY_LIMIT + 0.1)
    assert plan_trial([busy], PARAMS, TRAINING, "cpu", 256).plan.measure_ceiling
    # A trial faster than the reading by more than BEATEN_BY: the reading was low.
    beaten = [_trial(900.0, 1000.0), _trial(1000.0 * (1 + BEATEN_BY) + 1, None, number=1)]
    reuse = plan_trial(beaten, PARAMS, TRAINING, "cpu", 256)
    assert reuse.plan.measure_ceiling and reuse.ceiling is None
    # Within the margin it stands (noise can put a trial a hair above its ceiling).
    close = [_trial(900.0, 1000.0), _trial(1000.0 * (1 + BEATEN_BY) - 1, None, number=1)]
    assert plan_trial(close, PARAMS, TRAINING, "cpu", 256).ceiling == 1000.0
    # A new, trusted reading is what later trials use.
    again = [*beaten, _trial(950.0, 1200.0, number=2)]
    assert plan_trial(again, PARAMS, TRAINING, "cpu", 256).ceiling == 1200.0


def test_after_enough_distrusted_readings_the_highest_stands() -> None:
    trials = [_trial(1500.0, 1000.0 + 10 * n, number=n) for n in range(MAX_CEILING_READINGS)]
    reuse = plan_trial(trials, PARAMS, TRAINING, "cpu", 256)
    assert not reuse.plan.measure_ceiling
    assert reuse.ceiling == 1000.0 + 10 * (MAX_CEILING_READINGS - 1)


# --- a baseline whose val_loss is not credible -------------------------------------------


def test_a_baseline_that_blew_up_is_flagged_and_not_the_reference(sqlite_url: str) -> None:
    spec = importlib.util.spec_from_file_location("diverging", PLUGINS / "diverging.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = StudyConfig(
        name="diverging",
        trials=4,
        device="cpu",
        confirm_top=0,
        training=TrainingSettings(train_samples=768, batch_size=16, eval_batch_size=64),
        space=SearchSpace(
            batch_sizes=(16, 32, 64),
            num_workers=CpuRange(0, 0),
            torch_threads=1,
        ),
        sampler=SamplerConfig(name="grid"),
    )
    summary = run_study(config, workload=module.build(), storage=sqlite_url)
    base = summary.baseline
    assert base is not None and base.params.batch_size == 16 and base.val_loss > 1e6
    # Flagged, with the reason; the rule compares against the best val_loss instead, and so
    # recommends a batch size that learned.
    assert summary.baseline_doubt is not None
    assert "worse than the untrained model's loss" in summary.baseline_doubt
    rec = summary.recommended
    assert rec is not None and rec.point.params.batch_size != 16 and rec.point.val_loss < 1.0
    assert "not the baseline's, because" in rec.rule
    assert summary.as_dict()["baseline_doubt"] == summary.baseline_doubt
    # The untrained loss every trial recorded is what a 2-class model scores at start.
    study = optuna.load_study(study_name="diverging", storage=sqlite_url)
    untrained = [t.user_attrs[UNTRAINED_LOSS_ATTR] for t in study.trials]
    assert all(0.3 < v < 1.5 for v in untrained)


def test_a_sane_baseline_is_the_reference() -> None:
    good = TrialPoint(0, LoaderParams(16), 100.0, 0.9, is_baseline=True)
    other = TrialPoint(1, LoaderParams(32), 150.0, 0.7, is_baseline=False)
    assert baseline_doubt([good, other], good, untrained_loss=0.69 * 1.4) is None
    worse = TrialPoint(0, LoaderParams(16), 100.0, 8.0, is_baseline=True)
    reason = baseline_doubt([worse, other], worse, untrained_loss=None)
    assert reason is not None and "over 10x the best of another batch size (0.7)" in reason
    assert tolerance_limit((other,), worse, 0.05, reason)[1] == 0.7
    assert tolerance_limit((other,), good, 0.05, None)[1] == 0.9
