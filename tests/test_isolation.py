"""Trials in child processes: every way a trial can end is classified, and nothing is left.

The failures are real (signals, allocations, hangs) and so are the child processes; see
`tests._faults`. Each run must leave this process without children: a leaked loader worker
or trial process fails the test that leaked it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from loader_search.errors import TrainingDiverged
from loader_search.params import LoaderParams, TrainingSettings, TrialLimits
from loader_search.trial import TrialJob, WorkloadRecipe, run_trial
from loader_search.trial._failures import (
    CRASHED,
    CUDA_OOM,
    DIVERGED,
    EXCEPTION,
    HOST_OOM,
    INFEASIBLE_REASONS,
    INTERRUPTED,
    TIMEOUT,
    WORKER_KILLED,
    TrialOutcome,
    classify_exception,
    classify_exit,
)
from loader_search.trial._fresh import FreshHost
from loader_search.trial._processes import FreshProcess, dead_worker_failure, exited
from loader_search.trial._supervisor import (
    NO_LIMITS,
    _run_in_process,
    _Supervisor,
    can_isolate,
    run_isolated,
)
from loader_search.workloads import Workload
from tests import _faults
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not can_isolate(), reason="trials are isolated on Linux only")

SETTINGS = TrainingSettings(train_samples=256, batch_size=16, eval_batch_size=64)
NO_WORKERS = LoaderParams(16, torch_threads=1)
ONE_WORKER = LoaderParams(16, num_workers=1, prefetch_factor=2, torch_threads=1)
TWO_WORKERS = LoaderParams(16, num_workers=2, prefetch_factor=2, torch_threads=1)


def _descendants(before: Sequence[psutil.Process] = ()) -> list[psutil.Process]:
    """Live (not zombie) descendants of this test process, but for those in ``before``: what
    was running before the trial under test is not its leftover (one full run met a loader
    worker, of an earlier test, that lived on for a few seconds and failed the 8 checks after
    it; its origin was not found)."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc not in before:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _isolated(
    workload: Workload,
    params: LoaderParams,
    *,
    limits: TrialLimits = NO_LIMITS,
    cpus: Sequence[int] | None = None,
) -> TrialOutcome:
    return _isolated_job(TrialJob(workload, params, SETTINGS, "cpu", cpus=cpus), limits=limits)


def _isolated_job(
    job: TrialJob, *, limits: TrialLimits = NO_LIMITS, host: FreshHost | None = None
) -> TrialOutcome:
    before = _descendants()
    outcome = run_isolated(job, limits=limits, host=host)
    if host is not None and outcome.exitcode is None:  # kept: only its process remains
        assert host.process is not None
        assert [p.pid for p in _descendants(before)] == [host.process.pid]
    else:
        assert _descendants(before) == [], "the trial left processes running"
    assert outcome.isolated
    assert (outcome.result is None) != (outcome.failure is None)
    return outcome


def test_isolation_changes_nothing_that_is_learned(tiny_workload: Workload) -> None:
    settings = TrainingSettings(train_samples=512, batch_size=16, eval_batch_size=64)
    before = _descendants()
    in_process = run_trial(tiny_workload, ONE_WORKER, settings)
    outcome = run_isolated(TrialJob(tiny_workload, ONE_WORKER, settings))
    assert outcome.failure is None and outcome.result is not None
    assert outcome.result.val_loss == in_process.val_loss
    assert outcome.result.final_train_loss == in_process.final_train_loss
    assert outcome.result.measured_samples == in_process.measured_samples
    assert outcome.exitcode == 0
    assert 0 < outcome.startup_s < outcome.wall_s
    assert outcome.overhead_s < outcome.wall_s
    assert _descendants(before) == []


def test_threads_used_before_the_fork_do_not_hang_the_child(tiny_workload: Workload) -> None:
    # GNU OpenMP deadlocks a forked child whose parent ran a multi-threaded op, unless the
    # parent's OpenMP threads are released before the fork.
    params = LoaderParams(16, torch_threads=2)
    run_trial(tiny_workload, params, SETTINGS)  # this process now has OpenMP threads
    with open("/proc/self/maps") as maps:
        if "libgomp" not in maps.read():
            pytest.skip("this torch build does not use GNU OpenMP: nothing to show here")
    outcome = _isolated(tiny_workload, params, limits=TrialLimits(trial_timeout_s=20))
    assert outcome.failure is None


@dataclass(frozen=True)
class Case:
    factory: Callable[[], Workload]
    params: LoaderParams
    reason: str
    message: str  # a part of the message
    hint: str = ""  # a part of the hint
    timeout_s: float = 60.0
    trace: str = ""  # a part of the traceback


CASES = {
    "worker segfault": Case(
        _faults.worker_segfault, ONE_WORKER, WORKER_KILLED, "DataLoader worker", "num_workers=0"
    ),
    "worker bus error": Case(
        _faults.worker_sigbus, ONE_WORKER, WORKER_KILLED, "DataLoader worker", "--shm-size=2g"
    ),
    "worker killed by the OOM killer": Case(
        _faults.worker_sigkill, ONE_WORKER, HOST_OOM, "Killed", "fewer num_workers"
    ),
    "hang in a worker": Case(
        _faults.hang, ONE_WORKER, TIMEOUT, "no training progress for 3 s", timeout_s=3
    ),
    "hang in the main process": Case(
        lambda: _faults.hang(in_worker_only=False), NO_WORKERS, TIMEOUT, "3 s", timeout_s=3
    ),
    "user error": Case(
        _faults.user_error,
        NO_WORKERS,
        EXCEPTION,
        "ValueError: sample",
        "traceback",
        trace="in _bad_sample",
    ),
    "user error in a worker": Case(
        _faults.user_error,
        ONE_WORKER,
        EXCEPTION,
        "is corrupt (in DataLoader worker process 0)",
        trace="ValueError: sample",
    ),
    "CUDA out of memory": Case(
        _faults.cuda_oom, NO_WORKERS, CUDA_OOM, "Tried to allocate 2.00 GiB", "smaller batch"
    ),
    "CPU allocator failure": Case(
        _faults.cpu_alloc_failure, NO_WORKERS, HOST_OOM, "DefaultCPUAllocator", "memory"
    ),
    "NaN loss": Case(_faults.nan_loss, NO_WORKERS, DIVERGED, "training loss became nan", "lr"),
    "segfault in training": Case(_faults.main_segfault, NO_WORKERS, CRASHED, "SIGSEGV"),
    "killed by the OOM killer": Case(
        _faults.main_sigkill, NO_WORKERS, HOST_OOM, "SIGKILL, not by loader-search"
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_failures_are_classified(name: str) -> None:
    case = CASES[name]
    started = time.perf_counter()
    outcome = _isolated(
        case.factory(), case.params, limits=TrialLimits(trial_timeout_s=case.timeout_s)
    )
    failure = outcome.failure
    assert failure is not None
    assert failure.reason == case.reason, failure
    assert failure.infeasible == (case.reason in INFEASIBLE_REASONS)
    assert case.message in failure.message
    assert "\n" not in failure.message and "\n" not in failure.hint
    assert case.hint in failure.hint
    assert case.trace in failure.traceback
    if case.reason == TIMEOUT:
        assert case.timeout_s <= time.perf_counter() - started < case.timeout_s + 5


def test_memory_limit_kills_the_trial() -> None:
    # The limit sits well above what the child inherits from this process, whatever its size.
    limit = psutil.Process().memory_info().rss + 512 * 2**20
    outcome = _isolated(
        _faults.memory_hog(), NO_WORKERS, limits=TrialLimits(memory_limit_gb=limit / 2**30)
    )
    failure = outcome.failure
    assert failure is not None and failure.reason == HOST_OOM and failure.infeasible
    assert "above the limit" in failure.message
    assert outcome.exitcode == -signal.SIGKILL


def test_a_timeout_kills_the_loader_workers_too() -> None:
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            seen.update(p.pid for p in psutil.Process().children(recursive=True))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outcome = _isolated(_faults.hang(), TWO_WORKERS, limits=TrialLimits(trial_timeout_s=3))
    finally:
        done.set()
        watcher.join()
    assert outcome.failure is not None and outcome.failure.reason == TIMEOUT
    assert len(seen) >= 3, "expected the trial process and its two loader workers"
    assert all(_gone(pid) for pid in seen)


def test_the_parent_carries_on_after_failures(tiny_workload: Workload) -> None:
    for factory in (_faults.main_segfault, _faults.cuda_oom, _faults.worker_sigbus):
        assert _isolated(factory(), ONE_WORKER).failure is not None
    outcome = _isolated(tiny_workload, ONE_WORKER)
    assert outcome.result is not None and math.isfinite(outcome.result.val_loss)


BUILDS_PLUGIN = """
import dataclasses
import itertools
import os
from pathlib import Path

from tests._faults import good

_models = itertools.count(1)  # the models this process made


def recorded(folder):
    Path(folder, f"built-{os.getpid()}").touch()  # which process built the workload
    workload = good()

    def make_model():
        Path(folder, f"model-{os.getpid()}-{next(_models)}").touch()  # which trial, and its
        return workload.make_model()  # count in that process

    return dataclasses.replace(workload, make_model=make_model)
"""


def _recorded(folder: Path) -> WorkloadRecipe:
    """A recipe of `tests._faults.good` that leaves a file named by the building process."""
    plugin = folder / "builds.py"
    plugin.write_text(BUILDS_PLUGIN)
    return WorkloadRecipe(f"{plugin}:recorded", {"folder": str(folder)})


def _builders(folder: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("built-")) for path in folder.glob("built-*"))


def test_fresh_trials_fork_from_one_kept_process_that_built_the_workload(tmp_path: Path) -> None:
    workload = _faults.good()
    expected = {p: run_trial(workload, p, SETTINGS) for p in (NO_WORKERS, ONE_WORKER)}
    recipe = _recorded(tmp_path)
    before = _descendants()
    with FreshHost() as host:
        for params in (NO_WORKERS, ONE_WORKER, NO_WORKERS, ONE_WORKER):
            job = TrialJob(workload, params, SETTINGS, "cpu", fresh=recipe)
            outcome = run_isolated(job, host=host)
            assert outcome.failure is None and outcome.result is not None, outcome.failure
            # The same learning as in this process: only where it trains changed.
            assert outcome.result.val_loss == expected[params].val_loss
            assert outcome.exitcode is None  # kept for the next trial
        assert host.started == 1
        assert host.process is not None
        kept = host.process.pid
    builders = _builders(tmp_path)
    assert builders == [kept], "one process, not this one, built the workload once"
    # Each trial trained in a child of that process, from its state: none saw another's.
    models = [path.name.split("-")[1:] for path in tmp_path.glob("model-*")]
    assert len({pid for pid, _ in models}) == 4
    assert kept not in {int(pid) for pid, _ in models}
    assert {count for _, count in models} == {"1"}
    assert _gone(kept)
    assert _descendants(before) == []


def test_a_prepared_fresh_process_builds_before_its_first_trial(tmp_path: Path) -> None:
    recipe = _recorded(tmp_path)
    before = _descendants()
    with FreshHost() as host:
        host.prepare(recipe, "cpu")
        assert host.settle() is None
        assert host.process is not None
        kept = host.process.pid
        # Built, by that process, before any trial asked for it; no model made yet.
        assert _builders(tmp_path) == [kept]
        assert not list(tmp_path.glob("model-*"))
        for params in (NO_WORKERS, ONE_WORKER):
            job = TrialJob(_faults.good(), params, SETTINGS, "cpu", fresh=recipe)
            outcome = run_isolated(job, host=host)
            assert outcome.failure is None, outcome.failure
            assert outcome.exitcode is None  # kept
        assert host.started == 1 and host.process.pid == kept
        assert host.settle() is None  # nothing building: nothing to wait for
    assert _builders(tmp_path) == [kept], "built once, ahead of the trials"
    assert len(list(tmp_path.glob("model-*"))) == 2
    assert _gone(kept)
    assert _descendants(before) == []


def test_a_prepared_build_that_fails_is_said_and_the_next_trial_starts_anew() -> None:
    with FreshHost() as host:
        host.prepare(WorkloadRecipe("tests._faults:no_such_factory"), "cpu")
        assert host.process is not None
        failed = host.process
        why = host.settle()
        assert why is not None and "no_such_factory" in why, why
        assert host.process is None and exited(failed)
        job = TrialJob(
            _faults.good(), NO_WORKERS, SETTINGS, "cpu", fresh=WorkloadRecipe("tests._faults:good")
        )
        assert run_isolated(job, host=host).failure is None
        assert host.started == 2


def test_a_prepared_process_for_another_recipe_is_not_used(tmp_path: Path) -> None:
    with FreshHost() as host:
        host.prepare(WorkloadRecipe("tests._faults:good"), "cpu")
        job = TrialJob(_faults.good(), NO_WORKERS, SETTINGS, "cpu", fresh=_recorded(tmp_path))
        assert run_isolated(job, host=host).failure is None
        assert host.started == 2  # the trial's own recipe was built, by a process of its own
        assert host.process is not None and _builders(tmp_path) == [host.process.pid]


def test_a_fresh_trial_without_a_host_ends_its_process(tmp_path: Path) -> None:
    job = TrialJob(_faults.good(), ONE_WORKER, SETTINGS, "cpu", fresh=_recorded(tmp_path))
    outcome = _isolated_job(job)
    assert outcome.failure is None
    assert outcome.exitcode == 0 and 0 < outcome.startup_s < outcome.wall_s
    assert len(_builders(tmp_path)) == 1 and os.getpid() not in _builders(tmp_path)


# A fresh process's failures are classified as a forked child's, and end the process.
FRESH_CASES = {
    "user error": ("tests._faults:user_error", {}),
    "hang in the main process": ("tests._faults:hang", {"in_worker_only": False}),
    "worker segfault": ("tests._faults:worker_segfault", {}),
    "segfault in training": ("tests._faults:main_segfault", {}),
    "killed by the OOM killer": ("tests._faults:main_sigkill", {}),
}


@pytest.mark.parametrize("name", list(FRESH_CASES))
def test_failures_in_a_fresh_process_are_classified_and_end_it(name: str) -> None:
    case = CASES[name]
    spec, options = FRESH_CASES[name]
    limits = TrialLimits(trial_timeout_s=case.timeout_s + 10)  # its imports come first
    with FreshHost() as host:
        failing = TrialJob(
            _faults.good(), case.params, SETTINGS, "cpu", fresh=WorkloadRecipe(spec, options)
        )
        outcome = _isolated_job(failing, limits=limits, host=host)
        failure = outcome.failure
        assert failure is not None and failure.reason == case.reason, failure
        assert case.message.replace("3 s", "13 s") in failure.message
        assert case.trace in failure.traceback
        assert host.process is None, "a failed trial's process is not kept"
        good = TrialJob(
            _faults.good(), NO_WORKERS, SETTINGS, "cpu", fresh=WorkloadRecipe("tests._faults:good")
        )
        assert _isolated_job(good, host=host).failure is None
        assert host.started == 2


def test_the_trial_runs_on_the_given_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))[-1:]
    # The probe raises in the loader worker unless it inherited the trial's pinning.
    outcome = _isolated(_faults.affinity_probe(cpus), ONE_WORKER, cpus=cpus)
    assert outcome.failure is None, outcome.failure


def test_pinning_is_checked_before_forking() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        run_isolated(TrialJob(_faults.good(), NO_WORKERS, SETTINGS, "cpu", gpu=0))
    with pytest.raises(ValueError, match="subset of the CPUs this process may use"):
        run_isolated(TrialJob(_faults.good(), NO_WORKERS, SETTINGS, "cpu", cpus=[4096]))


INTERRUPT_SCRIPT = """
import sys
import psutil
from loader_search.params import LoaderParams, TrainingSettings, TrialLimits
from loader_search.trial._job import TrialJob
from loader_search.trial._supervisor import run_isolated
from loader_search.trial._job import WorkloadRecipe
from tests._faults import hang

settings = TrainingSettings(train_samples=256, batch_size=16)
params = LoaderParams(16, num_workers=2, prefetch_factor=2, torch_threads=1)
fresh = WorkloadRecipe("tests._faults:hang") if sys.argv[1] == "fresh" else None
print("ready", flush=True)
try:
    job = TrialJob(hang(), params, settings, fresh=fresh)
    run_isolated(job, limits=TrialLimits(trial_timeout_s=120))
except KeyboardInterrupt:
    print("interrupted; left running:", len(psutil.Process().children(recursive=True)))
    sys.exit(0)
print("returned instead of raising")
"""


@pytest.mark.parametrize("process", ["fork", "fresh"])
def test_ctrl_c_kills_the_trial_and_is_raised(process: str) -> None:
    script = subprocess.Popen(
        [sys.executable, "-c", INTERRUPT_SCRIPT, process],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert script.stdout is not None
        assert script.stdout.readline().strip() == "ready"
        parent = psutil.Process(script.pid)
        deadline = time.monotonic() + 90  # a fresh process imports torch first
        tree: list[psutil.Process] = []
        while len(tree) < 3 and time.monotonic() < deadline:  # the trial and its 2 workers
            time.sleep(0.2)
            tree = parent.children(recursive=True)
        assert len(tree) >= 3
        time.sleep(0.5)  # the workers are now blocked in the dataset
        script.send_signal(signal.SIGINT)
        out, err = script.communicate(timeout=60)
    finally:
        script.kill()
    assert "interrupted; left running: 0" in out, err
    assert script.returncode == 0
    assert all(_gone(p.pid) for p in tree)


def test_without_fork_the_trial_runs_in_process_with_the_same_classification() -> None:
    outcome = _run_in_process(TrialJob(_faults.cuda_oom(), NO_WORKERS, SETTINGS, "cpu"))
    assert not outcome.isolated
    assert outcome.failure is not None and outcome.failure.reason == CUDA_OOM
    good = _run_in_process(TrialJob(_faults.good(), NO_WORKERS, SETTINGS, "cpu"))
    assert good.result is not None and good.failure is None


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as caught:
        return caught


def test_classification_of_exceptions() -> None:
    wrapped = _raised(RuntimeError("loading failed"), MemoryError())
    assert classify_exception(wrapped).reason == HOST_OOM
    text_only = _raised(RuntimeError("CUDA error: out of memory"))
    assert classify_exception(text_only).reason == CUDA_OOM
    diverged = classify_exception(_raised(TrainingDiverged("validation loss is nan")))
    assert (diverged.reason, diverged.infeasible) == (DIVERGED, True)
    shm = classify_exception(
        _raised(RuntimeError("unable to write to file </torch_123_456>: No space left (28)"))
    )
    assert shm.reason == WORKER_KILLED and "--shm-size" in shm.hint
    interrupted = classify_exception(_raised(KeyboardInterrupt()))
    assert interrupted.reason == INTERRUPTED and not interrupted.infeasible
    plain = classify_exception(_raised(KeyError("image_path")))
    assert (plain.reason, plain.message) == (EXCEPTION, "KeyError: 'image_path'")
    assert "test_isolation.py" in plain.traceback
    assert len(plain.traceback.splitlines()) <= 15
    long = classify_exception(_raised(ValueError("x" * 5000 + "\nsecond line")))
    assert len(long.message) <= 500 and "\n" not in long.message


def test_classification_of_exits() -> None:
    assert classify_exit(-signal.SIGKILL).reason == HOST_OOM
    crashed = classify_exit(-signal.SIGABRT)
    assert crashed.reason == CRASHED and "SIGABRT" in crashed.message
    assert classify_exit(3).reason == CRASHED


def test_reading_failure_reasons_imports_neither_torch_nor_psutil_nor_optuna() -> None:
    """The study's keys import the reason names, and `best` and `report` must stay light."""
    code = (
        "import sys, loader_search.trial._failures\n"
        "print([m for m in ('torch', 'psutil', 'optuna') if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        TrialLimits(trial_timeout_s=0)
    with pytest.raises(ValueError, match="memory_limit_gb"):
        TrialLimits(memory_limit_gb=0)


def test_the_parent_imports_once_what_every_trial_would_import() -> None:
    """torch's first optimizer imports torch._dynamo (about a second): the parent does it
    before the first fork, so that no trial pays it again. In a fresh interpreter, as this
    test process has imported it long ago."""
    code = (
        "import sys\n"
        "from loader_search.trial._job import TrialJob\n"
        "from loader_search.trial._supervisor import run_isolated\n"
        "from loader_search.params import LoaderParams, TrainingSettings\n"
        "from tests._faults import good\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "outcome = run_isolated(TrialJob(good(), LoaderParams(batch_size=16, torch_threads=1),"
        " TrainingSettings(train_samples=256)))\n"
        "assert outcome.failure is None, outcome.failure\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


CRASHES_BESIDE_WORKERS = {
    # Before: recorded `timeout` after the 8 s trial timeout (the blocked worker kept the
    # pipes that tell the child's end open), and `crashed` after 5.1 s with an idle worker.
    "a worker blocked in the dataset": _faults.main_segfault_beside_hung_worker,
    "an idle worker": _faults.main_segfault,
}


@pytest.mark.parametrize("process", ["fork", "fresh"])
@pytest.mark.parametrize("name", list(CRASHES_BESIDE_WORKERS))
def test_a_crash_of_the_training_process_is_seen_at_once_beside_its_workers(
    name: str, process: str
) -> None:
    factory = CRASHES_BESIDE_WORKERS[name]
    # A fresh process's trial is its child: the process ends as the child did, at once.
    fresh = WorkloadRecipe(f"tests._faults:{factory.__name__}") if process == "fresh" else None
    job = TrialJob(factory(), ONE_WORKER, SETTINGS, "cpu", fresh=fresh)
    outcome = _isolated_job(job, limits=TrialLimits(trial_timeout_s=8 + 10 * (fresh is not None)))
    failure = outcome.failure
    assert failure is not None and failure.reason == CRASHED, failure
    assert "SIGSEGV" in failure.message
    assert outcome.exitcode == -signal.SIGSEGV
    seen = outcome.wall_s - outcome.startup_s  # after the fresh process's imports and build
    assert seen < 4, f"the crash was seen {seen:.1f} s after the trial started"


def test_a_process_that_closes_its_pipe_and_then_crashes_is_classified_by_its_crash() -> None:
    # A fresh process closes its pipe just before it ends as its trial's child did. The watch
    # used to kill it on the pipe's end, and a segfault was once recorded as host_oom under
    # load (a SIGKILL not sent by loader-search). Here it takes half a second to end.
    ours, theirs = multiprocessing.Pipe(duplex=False)
    code = (
        "import os, resource, signal, sys, time\n"
        "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
        "os.close(int(sys.argv[1]))\n"
        "time.sleep(0.5)\n"
        "os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    popen = subprocess.Popen(
        [sys.executable, "-c", code, str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        start_new_session=True,
    )
    theirs.close()
    process = FreshProcess(popen)
    try:
        watch = _Supervisor(TrialLimits(trial_timeout_s=30))
        outcome = watch._watch(process, ours, time.perf_counter())
    finally:
        ours.close()
        process.close()
    assert outcome.failure is not None and outcome.failure.reason == CRASHED, outcome.failure
    assert "SIGSEGV" in outcome.failure.message and outcome.exitcode == -signal.SIGSEGV


def test_a_dead_loader_worker_is_found_under_a_fresh_processs_trial() -> None:
    # A fresh process's tree: it, its trial's child, and that child's loader worker, killed
    # by SIGSEGV and not yet reaped. One level down only, the worker was not found.
    code = (
        "import os, signal, sys, time\n"
        "if os.fork() == 0:\n"  # the trial's child
        "    if os.fork() == 0:\n"  # its loader worker
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "sys.stdin.read()\n"
    )
    top = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert top.stdout is not None and top.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while (failure := dead_worker_failure(top.pid)) is None:
            assert time.monotonic() < deadline, "the dead worker was not found"
            time.sleep(0.05)
        assert failure.reason == WORKER_KILLED, failure
        assert "is killed by signal: Segmentation fault" in failure.message
    finally:
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process(top.pid).children(recursive=True):
                proc.kill()
        top.kill()
        top.wait(10)


def test_a_dead_loader_worker_is_recorded_though_its_report_was_lost() -> None:
    # The training process swallows torch's RuntimeError for the dead worker, then waits 5 s
    # for torch's next check: the 3 s trial timeout comes first. Before: `timeout`.
    outcome = _isolated(
        _faults.worker_segfault_report_lost(), ONE_WORKER, limits=TrialLimits(trial_timeout_s=3)
    )
    failure = outcome.failure
    assert failure is not None and failure.reason == WORKER_KILLED, failure
    assert "is killed by signal: Segmentation fault" in failure.message
    assert "num_workers=0" in failure.hint


def test_a_loader_worker_segfault_is_worker_killed_every_time_under_a_short_timeout() -> None:
    # Torch's report can land in code that swallows it (its own profiler import did): before,
    # 2 of 8 such trials with a 1 s timeout were recorded `timeout`.
    params = LoaderParams(
        16, num_workers=4, prefetch_factor=1, persistent_workers=True, torch_threads=1
    )
    reasons = [
        _isolated(_faults.worker_segfault(), params, limits=TrialLimits(trial_timeout_s=3))
        for _ in range(6)
    ]
    assert [o.failure.reason for o in reasons if o.failure] == [WORKER_KILLED] * 6


HUNG_RUN_CONFIG = """
[study]
name = "hung"
trials = 3
[sampler]
name = "random"
[workload]
name = "{workload}"
[training]
device = "cpu"
train_samples = 256
batch_size = 16
[space]
batch_size = [16]
num_workers = 1
prefetch_factor = 2
persistent_workers = false
"""


def _host_lock_free(folder: Path) -> bool:
    fd = os.open(folder / "host.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases it
    return True


def test_a_killed_run_leaves_no_loader_worker_holding_the_host_lock(
    tmp_path: Path, sqlite_url: str
) -> None:
    """``kill -9`` of a ``run`` whose trial's loader worker hangs in the dataset. Before, the
    worker lived on under init with a copy of the host lock, and every later trial on the
    machine waited for it."""
    locks = tmp_path / "locks"
    config = tmp_path / "hung.toml"
    # Trial #0 (the baseline, no workers) trains; trial #1's worker hangs at its first sample.
    config.write_text(HUNG_RUN_CONFIG.format(workload=f"{ROOT / 'tests' / '_faults.py'}:hang"))
    env = {k: v for k, v in os.environ.items() if k != "LOADER_SEARCH_STORAGE"}
    env["LOADER_SEARCH_LOCK_DIR"] = str(locks)
    run = subprocess.Popen(
        [sys.executable, "-m", "loader_search", "run", str(config), "--storage", sqlite_url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not any(p.ppid() != run.pid for p in tree):  # a loader worker of a trial
            if run.poll() is not None:
                pytest.fail(f"the run ended early: {run.communicate()[1]}")
            if time.monotonic() > deadline:
                pytest.fail("no trial started a loader worker within 120 s")
            time.sleep(0.2)
            with contextlib.suppress(psutil.Error):
                tree = psutil.Process(run.pid).children(recursive=True)
        time.sleep(1.0)  # the worker is blocked in the dataset now
        assert not _host_lock_free(locks)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=60)
        deadline = time.monotonic() + 30
        while not (_host_lock_free(locks) and all(_gone(p.pid) for p in tree)):
            if time.monotonic() > deadline:
                alive = [p.pid for p in tree if not _gone(p.pid)]
                pytest.fail(
                    f"30 s after the kill: host lock free {_host_lock_free(locks)},"
                    f" processes of the run alive {alive}"
                )
            time.sleep(0.2)
    finally:
        run.kill()
        for proc in tree:  # what the run left, before the fix
            with contextlib.suppress(psutil.Error):
                proc.kill()
        run.communicate()


# A `run` killed with kill -9 while a loader worker is between its fork and its init: the
# trial dies with `run`, and the worker, re-parented to a child subreaper (a container's
# init, systemd --user, this harness), asks to die with a parent that is no longer the
# trial, and saw its dead trial (a zombie) as alive: it outlived everything.
_ORPHAN_RUN = """
import dataclasses, os, sys, time
if sys.argv[1] == "hook-last":
    import loader_search.trial._loader  # its at-fork record runs before the plug-in's sleep
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.trial import TrialJob, run_isolated
from tests._datasets import linear_model, timed_workload

trial = []

def slow_in_workers():
    if trial and os.getppid() == trial[0]:  # a loader worker of the trial: late to its init
        time.sleep(1.5)

os.register_at_fork(after_in_child=slow_in_workers)

def model():
    trial.append(os.getpid())  # in the trial's process, before its loader forks workers
    return linear_model()

workload = dataclasses.replace(timed_workload(n=4096, delay_s=0.002), make_model=model)
run_isolated(TrialJob(workload, LoaderParams(64, 1, 2, torch_threads=1), TrainingSettings()))
"""

_SUBREAPER = """
import ctypes, json, os, signal, subprocess, sys, time
import psutil

ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans below come to this process
run = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
worker = None
deadline = time.monotonic() + 120
while worker is None and time.monotonic() < deadline and run.poll() is None:
    try:
        for trial in psutil.Process(run.pid).children():
            worker = next(iter(trial.children()), None)
    except psutil.Error:
        pass
    time.sleep(0.01)
os.kill(run.pid, signal.SIGKILL)  # kill -9 of run, its worker not yet in its init
run.wait()
time.sleep(5)  # the worker's 1.5 s, then its init, then torch's worker loop
alive = []
for proc in psutil.Process().children(recursive=True):
    try:
        if proc.status() != psutil.STATUS_ZOMBIE:
            alive.append(proc.pid)
            proc.kill()
    except psutil.Error:
        pass
while True:  # reap all (the trial, a zombie, was left so until now on purpose)
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
print(json.dumps({"worker": worker is not None, "alive": alive}))
"""


@pytest.mark.parametrize("order", ["hook-first", "hook-last"])
def test_a_loader_worker_not_yet_armed_when_run_is_killed_does_not_outlive_it(
    order: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SUBREAPER, _ORPHAN_RUN, order],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["worker"], "the trial's loader worker was never seen"
    assert report["alive"] == [], "processes outlived the killed run"
