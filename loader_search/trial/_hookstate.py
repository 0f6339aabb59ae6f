"""What the trial hook knows in one process of a command workload, and its state file.

A command workload's processes (the script, each torchrun rank) load
``loader_search.trial._hook/sitecustomize.py`` at start-up; `loader_search.trial._inject`
patches the DataLoader there and keeps its counts here. This module imports nothing heavy
(no torch, no psutil at import time): `loader_search.trial._report` reaches it from the user's
script, which may call `loader_search.reports` outside a trial too.

Each process writes ``<trial dir>/proc-<pid>.json`` (a temporary file, then ``os.replace``, so
the service never reads half a file): at most every ``progress_interval_s`` from inside the
user's loop, at once when the training budget is reached (the step of the batch that reached it
over), a validation loss is reported or the program ends in an uncaught exception, and at exit.
A process that built, iterated, reported and raised nothing (the torchrun launcher, a spawned
loader worker) writes no file. The file holds ``pid``, ``hooked`` (whether the hook loaded in
the process: a process started without it still writes a loss it reports), ``error`` (the
uncaught exception the program ended in: ``at``, ``type`` and the ``traceback``'s last lines; a
rank's own, which torchrun prints far above its banner), ``rank``, ``world_size``,
``local_rank`` (torch.distributed's once a group is up, else the environment's), ``loaders``
(each: ``index``, ``site``, ``shuffle``, ``train``, ``iterable``, ``applied``, ``not_applied``,
and the ``num_workers`` and ``batch_size`` the loader really uses), ``train_rule`` (what chose
the training loader: ``guess``, ``train_loader`` or ``optimizer_steps``, see
`loader_search.trial._hookpick`; null before one is chosen), ``samples`` and ``batches``
(of the training loader), ``ticks`` (batches of the others), ``budget_reached``,
``budget_reached_at``, ``window`` (`window_dict`, or null before the warm-up ends), ``stages``
(the training process's stage costs over the window, see `loader_search.trial._hookloop`),
``peak_rss_bytes``, ``cpu_s`` and ``val_losses``
(``[time, value]`` pairs). The measured iterators are in `loader_search.trial._hookloop`, the
loader workers' side in `loader_search.trial._hookworker`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from loader_search.trial._measure import StepMeter

ENV_DIR = "LOADER_SEARCH_TRIAL_DIR"
SETTINGS_FILE = "settings.json"

# What a run of the command is for (see loader_search.trial._hookloop).
MODES = ("train", "ceiling", "probe")
ERROR_LINES = 15  # what is kept of the traceback of the exception a program ends in
# The loader settings a trial may inject, in the order they are applied.
INJECTABLE = ("batch_size", "num_workers", "prefetch_factor", "pin_memory", "persistent_workers")


@dataclass(frozen=True)
class HookSettings:
    """``settings.json``, as the service wrote it for this trial."""

    batch_size: int | None
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    persistent_workers: bool
    inject: tuple[str, ...]
    train_samples: int | None
    warmup_batches: int
    train_loader: int | None
    progress_interval_s: float
    mode: str = "train"

    @classmethod
    def read(cls, folder: str) -> HookSettings:
        with open(os.path.join(folder, SETTINGS_FILE), encoding="utf-8") as file:
            raw = json.load(file)
        if not isinstance(raw, dict):
            raise ValueError(f"{SETTINGS_FILE} holds {type(raw).__name__}, not an object")
        prefetch = raw.get("prefetch_factor")
        batch = raw.get("batch_size")
        samples = raw.get("train_samples")
        train = raw.get("train_loader")
        return cls(
            batch_size=None if batch is None else int(batch),
            num_workers=int(raw.get("num_workers", 0)),
            prefetch_factor=None if prefetch is None else int(prefetch),
            pin_memory=bool(raw.get("pin_memory", False)),
            persistent_workers=bool(raw.get("persistent_workers", False)),
            inject=tuple(str(name) for name in raw.get("inject") or ()),
            train_samples=None if samples is None else int(samples),
            warmup_batches=int(raw.get("warmup_batches", 1)),
            train_loader=None if train is None else int(train),
            progress_interval_s=float(raw.get("progress_interval_s", 0.5)),
            mode=str(raw.get("mode", "train")) if raw.get("mode") in MODES else "train",
        )

    def value(self, name: str) -> Any:
        """The trial's value of the loader setting ``name``."""
        return getattr(self, name)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class ProcessState:
    """One process's loaders, counts and measured window (see the module docstring)."""

    def __init__(self, folder: str, settings: HookSettings) -> None:
        self.folder = folder
        self.settings = settings
        self.pid = os.getpid()
        self.loaders: list[dict[str, Any]] = []
        self.built = 0  # DataLoaders built in this process so far
        self.train_decided = False  # whether the training loader is known (or cannot be)
        # What chose it ("guess", "train_loader", "optimizer_steps"), the chosen loader's
        # `_inject._LoaderInfo`, the one whose batch came last, and whether an optimizer
        # step has followed a batch: the first step settles the choice (`_hookpick`).
        self.train_rule: str | None = None
        self.train_info: Any = None
        self.last_batch_from: Any = None
        self.steps_settled = False
        # The training loader's data set: a shuffling loader built later over it is the same
        # loader re-created (Lightning adds a DistributedSampler that way).
        self.train_dataset: Any = None
        self.samples = 0
        self.batches = 0
        self.ticks = 0
        # The training process's stage costs over the window (loader_search.trial._hookloop).
        self.stages: dict[str, float] = dict.fromkeys(
            ("fetch_cpu_s", "collate_cpu_s", "main_cpu_s", "samples", "batches"), 0.0
        )
        self.stages["window_batches"] = 0
        self.budget_reached = False
        self.budget_reached_at: float | None = None
        self.val_losses: list[list[float]] = []
        self.meter: StepMeter | None = None
        # Ends the open step of the training batch that reached the budget
        # (`loader_search.trial._hookloop.TrainRun.close_at_budget`), once something says the
        # training loop is over: a script that stops itself at its budget asks no more.
        self.close_at_budget: Callable[[], None] | None = None
        self.sync_device: bool = True  # whether a window snapshot synchronises the device
        self.final_window: dict[str, Any] | None = None  # the window closed at the budget
        # The window as an epoch of the training loader ended: between epochs (validation,
        # after the loop) the clock of a live snapshot would run on without samples.
        self.idle_window: dict[str, Any] | None = None
        self.touched = False  # a file is written only once there is something to say
        self.hooked = False  # the hook's install made this state (not a report without it)
        self.error: dict[str, Any] | None = None  # the uncaught exception the program ended in
        self._last_write = time.monotonic()
        self._errors: set[str] = set()

    # --- what the hook reports --------------------------------------------------------

    def touch(self) -> None:
        self.touched = True

    def restart_training(self) -> None:
        """Forget the training counts and window: they were another loader's, the wrong
        guess (`loader_search.trial._hookpick`)."""
        self.samples = self.batches = 0
        self.stages = dict.fromkeys(self.stages, 0.0)
        self.stages["window_batches"] = 0
        self.budget_reached = False
        self.budget_reached_at = None
        self.meter = None
        self.close_at_budget = None
        self.final_window = self.idle_window = None

    def budget_step_over(self) -> None:
        """Another loader's batch, a reported loss or the exit: the training loop is over
        (`close_at_budget`)."""
        if self.close_at_budget is not None:
            self.close_at_budget()

    def add_val_loss(self, value: float) -> None:
        try:
            self.budget_step_over()
        except Exception as exc:
            self.record_error("measuring the training loop", exc)
        self.val_losses.append([time.time(), value])
        self.touched = True
        self.write()

    def record_uncaught(self, exc: BaseException) -> None:
        """Keep the exception the program ends in (`watch_uncaught`), written at once."""
        import traceback

        lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        kind = type(exc)
        self.error = {
            "at": time.time(),
            "type": f"{kind.__module__}.{kind.__qualname__}",
            "traceback": "\n".join(lines.splitlines()[-ERROR_LINES:]),
        }
        self.touched = True
        self.write()

    def record_error(self, where: str, exc: BaseException) -> None:
        """Append a one-line account of ``exc`` to ``hook-error-<pid>.txt`` (once per place:
        a wrapper failing on every batch must not fill the disk)."""
        if where in self._errors:
            return
        self._errors.add(where)
        write_error(self.folder, f"{where}: {one_line(exc)}")

    # --- the state file ---------------------------------------------------------------

    def window(self) -> dict[str, Any] | None:
        if self.final_window is not None:
            return self.final_window
        if self.idle_window is not None:
            return self.idle_window
        meter = self.meter
        if meter is None or not meter.in_window or meter.measured_samples == 0:
            return None
        return window_dict(meter)

    def as_json(self) -> dict[str, Any]:
        from loader_search.trial._measure import high_water_mark_bytes

        rank, world, local = _ranks()
        times = os.times()
        return {
            "pid": self.pid,
            "hooked": self.hooked,
            "error": self.error,
            "rank": rank,
            "world_size": world,
            "local_rank": local,
            "loaders": self.loaders,
            "train_rule": self.train_rule,
            "samples": self.samples,
            "batches": self.batches,
            "ticks": self.ticks,
            "budget_reached": self.budget_reached,
            "budget_reached_at": self.budget_reached_at,
            "window": self.window(),
            "stages": self.stages,
            "peak_rss_bytes": high_water_mark_bytes() or 0,
            "cpu_s": times.user + times.system + times.children_user + times.children_system,
            "val_losses": self.val_losses,
        }

    def write(self) -> None:
        """Write the state file now (atomically); never raises."""
        if os.getpid() != self.pid:
            return  # a forked copy of this state: the file is its parent's
        self._last_write = time.monotonic()
        path = os.path.join(self.folder, f"proc-{self.pid}.json")
        temporary = os.path.join(self.folder, f".proc-{self.pid}.json.tmp")
        try:
            text = json.dumps(self.as_json(), default=_jsonable, allow_nan=True)
            with open(temporary, "w", encoding="utf-8") as file:
                file.write(text)
            os.replace(temporary, path)
        except Exception as exc:
            self.record_error("writing the state file", exc)

    def maybe_write(self) -> None:
        """Write the state file if ``progress_interval_s`` passed since the last write: cheap
        enough to call on every batch. Snapshots here do not synchronise the device (a stall
        every interval inside the user's loop); the final ones do."""
        if time.monotonic() - self._last_write < self.settings.progress_interval_s:
            return
        self.sync_device = False
        try:
            self.write()
        finally:
            self.sync_device = True

    def at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        try:
            self.budget_step_over()  # writes the window it closes
        except Exception as exc:
            self.record_error("measuring the training loop", exc)
        if self.touched:
            self.write()


def window_dict(meter: StepMeter) -> dict[str, Any]:
    stats = meter.snapshot()
    return {
        "measured_samples": stats.measured_samples,
        "measured_time_s": stats.measured_time_s,
        "data_wait_s": stats.data_wait_s,
        "warmup_batches": stats.warmup_batches,
        "time_to_first_batch_s": stats.time_to_first_batch_s,
        "throughput": stats.throughput if stats.measured_time_s > 0 else None,
    }


def _ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank): torch.distributed's once the script started its
    process group (``mp.spawn`` sets no environment), else torchrun's environment."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # a group being torn down: the environment still says who we are
        pass
    return rank, world, _env_int("LOCAL_RANK", 0)


def world_size() -> int:
    return max(1, _ranks()[1])


def rank_share(train_samples: int, world: int) -> int:
    """One rank's share of the whole run's training samples."""
    return math.ceil(train_samples / max(1, world))


def _jsonable(value: object) -> object:
    # Settings applied may hold a value json cannot write (a torch.device string is fine, a
    # sampler is not): its text is enough to say what was used.
    return repr(value)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def write_error(folder: str, line: str) -> None:
    """Append ``line`` to ``<folder>/hook-error-<pid>.txt``; never raises."""
    try:
        with open(os.path.join(folder, f"hook-error-{os.getpid()}.txt"), "a") as file:
            file.write(line.replace("\n", " ") + "\n")
    except OSError:
        pass  # nowhere to say it: the user's program goes on regardless


def watch_uncaught(state: ProcessState) -> None:
    """Record the exception the program ends in (`ProcessState.record_uncaught`) before
    Python's own report of it, which still follows unchanged; a program that sets its own
    ``sys.excepthook`` replaces this one."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if os.getpid() == state.pid:  # not in a process forked from this one
            with contextlib.suppress(Exception):  # the hook never raises into the program
                state.record_uncaught(exc)
        previous(kind, exc, tb)

    sys.excepthook = excepthook


_STATE: ProcessState | None = None


def install_state() -> ProcessState:
    """This process's state, read from the trial folder's settings (once per process)."""
    global _STATE
    if _STATE is not None and _STATE.pid == os.getpid():
        return _STATE
    folder = os.environ[ENV_DIR]
    _STATE = ProcessState(folder, HookSettings.read(folder))
    atexit.register(_STATE.at_exit)
    return _STATE


def current(create: bool = False) -> ProcessState | None:
    """The state of this process inside a trial, else None.

    A process forked from one with a state (a loader worker) gets None: its parent measures.
    ``create``: build the state where the hook did not run in this process's line (a script
    started without the hook's path) so that a reported loss is still written.
    """
    if _STATE is not None:
        return _STATE if _STATE.pid == os.getpid() else None
    if create and os.environ.get(ENV_DIR):
        return install_state()
    return None
