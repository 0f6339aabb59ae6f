"""Timing and memory measurement for one training run.

Throughput is measured over a window that starts after a warm-up, so it reflects steady-state
training rather than worker start-up or the burst of batches the workers prefetched while the
model was not yet asking for them. The window's edges are device-synchronised: CUDA kernels run
asynchronously, and an unsynchronised clock would time the queueing of work, not the work.
"""

from __future__ import annotations

import os
import threading
import time

try:
    import resource
except ImportError:  # not on Windows: no page-fault count there
    resource = None  # type: ignore[assignment]
from collections.abc import Callable
from dataclasses import dataclass

import psutil

# A warm-up "until stable" (with torch.compile) ends once the last STABLE_STEPS step times
# lie within STABLE_RATIO of their median: a compilation is hundreds of steps long.
STABLE_STEPS = 3
STABLE_RATIO = 3.0


@dataclass(frozen=True)
class WindowStats:
    """What `StepMeter` measured."""

    measured_samples: int
    measured_time_s: float
    data_wait_s: float
    warmup_batches: int
    time_to_first_batch_s: float
    # The slowest step of the window over its median step (a spike: a recompilation, a
    # stall), and the steps left out of it (`StepMeter.step`'s ``exclude``) with their time.
    slowest_step_over_median: float | None = None
    excluded_steps: int = 0
    excluded_s: float = 0.0
    # Minor page faults of this process (all its threads; not its loader workers) over the
    # window: memory the allocator handed back to the system and took again, or pages shared
    # copy-on-write with a parent. A diagnostic: at 1-2 us each, 100,000 are a noticeable
    # share of a second's window (None where the platform does not count them).
    minor_faults: int | None = None

    @property
    def throughput(self) -> float:
        """Samples per second over the measured window."""
        return self.measured_samples / self.measured_time_s

    @property
    def data_wait_fraction(self) -> float:
        """Share of the window spent blocked on the loader: a diagnostic, not a score."""
        return self.data_wait_s / self.measured_time_s


class StepMeter:
    """Counts samples and loader waits of a training loop, excluding the first batches.

    Usage, once per batch::

        meter.start()                 # when the loader iterator is created
        meter.wait_begin()            # around next(iterator)
        batch = next(iterator)
        meter.wait_end()
        ...train step...
        meter.step(len(batch))        # after the step was issued
        ...
        stats = meter.finish()

    The warm-up is ``warmup_batches`` batches; with ``until_stable`` it goes on until the
    last `STABLE_STEPS` step times are within `STABLE_RATIO` of their median too (a compiled
    model's first steps compile), at most until ``max_warmup`` batches.
    """

    def __init__(
        self,
        warmup_batches: int,
        sync: Callable[[], None] = lambda: None,
        *,
        until_stable: bool = False,
        max_warmup: int | None = None,
    ) -> None:
        if warmup_batches < 1:
            raise ValueError("at least one warm-up batch is needed to exclude worker start-up")
        self._warmup = warmup_batches
        self._sync = sync
        self._until_stable = until_stable
        self._max_warmup = max(warmup_batches, max_warmup or warmup_batches)
        self._steps = 0
        self._created_at: float | None = None
        self._first_batch_at: float | None = None
        self._window_start: float | None = None
        self._samples = 0
        self._wait = 0.0
        self._wait_started: float | None = None
        self._last_step_at: float | None = None
        self._times: list[float] = []  # step times: the warm-up's last few, then the window's
        self._excluded = 0
        self._excluded_s = 0.0
        self._faults_at_start: int | None = None

    def start(self) -> None:
        self._created_at = time.perf_counter()
        self._last_step_at = self._created_at

    def wait_begin(self) -> None:
        self._wait_started = time.perf_counter()

    def wait_end(self) -> None:
        assert self._wait_started is not None, "wait_end without wait_begin"
        now = time.perf_counter()
        if self._first_batch_at is None:
            self._first_batch_at = now
        if self._window_start is not None:
            self._wait += now - self._wait_started
        self._wait_started = None

    def step(self, samples: int, exclude: float | None = None) -> None:
        """Record a finished step; the window opens once the warm-up is done. ``exclude``:
        this step's own time (seconds), to leave it and its samples out of the window (a
        recompilation in it; see `loader_search.trial._step`)."""
        now = time.perf_counter()
        elapsed = now - (self._last_step_at if self._last_step_at is not None else now)
        self._last_step_at = now
        self._steps += 1
        if self._window_start is not None:
            if exclude is not None:
                self._excluded += 1
                self._excluded_s += min(exclude, elapsed)
                return
            self._samples += samples
            self._times.append(elapsed)
            return
        self._times = [*self._times[-(STABLE_STEPS - 1) :], elapsed]
        if self._steps >= self._warmup and (
            not self._until_stable or self._stable() or self._steps >= self._max_warmup
        ):
            self._sync()  # the warm-up's queued device work must not leak into the window
            self._window_start = time.perf_counter()
            self._faults_at_start = minor_faults()
            self._last_step_at = self._window_start
            self._warmup = self._steps
            self._times = []

    def _stable(self) -> bool:
        if len(self._times) < STABLE_STEPS:
            return False
        middle = sorted(self._times)[len(self._times) // 2]
        return max(self._times) <= STABLE_RATIO * middle

    @property
    def in_window(self) -> bool:
        return self._window_start is not None

    @property
    def measured_samples(self) -> int:
        """Samples counted in the window so far."""
        return self._samples

    def snapshot(self) -> WindowStats:
        """The window so far, the meter running on (device-synchronised, as `finish`)."""
        return self.finish()

    def finish(self) -> WindowStats:
        self._sync()
        end = time.perf_counter()
        if self._window_start is None or self._samples == 0:
            raise ValueError(
                f"only {self._steps} batch(es) ran, all of them warm-up ({self._warmup});"
                " raise the training budget"
            )
        assert self._created_at is not None and self._first_batch_at is not None
        faults, start = minor_faults(), self._faults_at_start
        spike = None
        if self._times:
            ordered = sorted(self._times)
            middle = ordered[len(ordered) // 2]
            spike = ordered[-1] / middle if middle > 0 else None
        return WindowStats(
            measured_samples=self._samples,
            measured_time_s=end - self._window_start - self._excluded_s,
            data_wait_s=self._wait,
            warmup_batches=self._warmup,
            time_to_first_batch_s=self._first_batch_at - self._created_at,
            slowest_step_over_median=spike,
            excluded_steps=self._excluded,
            excluded_s=self._excluded_s,
            minor_faults=faults - start if faults is not None and start is not None else None,
        )


def minor_faults() -> int | None:
    """This process's minor page faults so far, all its threads (None: not counted here)."""
    if resource is None:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class PeakRSS:
    """The peak resident memory of this process plus all its children (loader workers).

    This process's own peak is the kernel's high-water mark (``VmHWM``, reset when the block
    starts where the kernel allows it): exact, and free. Loader worker processes
    (``children``) are sampled by a background thread every ``interval_s``; the peak is then
    the largest sum seen (at least this process's own peak). Pages a forked worker shares with
    its parent count once per process, as the kernel's RSS does, so this is an upper bound on
    physical memory use.

    Without children no thread runs: nothing wakes beside a training step that loads its own
    samples (what the thread cost such a trial, measured on a 2-core CPU: nothing
    measurable, 0.997x with a 95% interval of +-4.5%; benchmarks/RESULTS.md). The
    thread's sample must be cheap: on Linux it reads the process tree from
    ``/proc/PID/task/TID/children`` and each process's ``statm`` (~90 us for a trial and its
    workers here). ``psutil``'s ``children()`` scans every process of the
    machine instead (~3.5 ms here); it remains the fallback where ``/proc`` lacks the children
    files.
    """

    def __init__(self, interval_s: float = 0.05, *, children: bool = True) -> None:
        self._interval = interval_s
        self._children = children
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._pid = os.getpid()
        self._process = psutil.Process()

    def __enter__(self) -> PeakRSS:
        reset_high_water_mark()
        self._sample()
        if self._children:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._children:
            self._stop.set()
            self._thread.join()
        self._sample()
        self._peak = max(self._peak, high_water_mark_bytes() or 0)

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        total = tree_rss_bytes(self._pid)
        if total is None:
            total = self._psutil_rss()
        if total is not None:
            self._peak = max(self._peak, total)

    def _psutil_rss(self) -> int | None:
        try:
            total = self._process.memory_info().rss
            for child in self._process.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:  # a worker that exited between listing and reading
                    continue
        except psutil.Error:
            return None
        return int(total)


def reset_high_water_mark() -> bool:
    """Reset this process's peak resident memory (``VmHWM``) to its current one (Linux 4.0+:
    ``/proc/self/clear_refs``). False where it cannot: the mark then counts from the process's
    start (for a forked trial, its resident memory at the fork)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


def high_water_mark_bytes() -> int | None:
    """This process's peak resident memory (the kernel's ``VmHWM``), None where unknown."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def tree_rss_bytes(pid: int) -> int | None:
    """Resident bytes of ``pid`` and its descendants from ``/proc``, or None where ``/proc``
    cannot tell (not Linux, or a kernel without ``CONFIG_PROC_CHILDREN``)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    pending = [pid]
    seen: set[int] = set()
    first = True
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/statm", "rb") as statm:
                total += int(statm.read().split()[1]) * _PAGE_BYTES
            if not first:
                tasks = os.listdir(f"/proc/{current}/task")
            for tid in tasks:
                with open(f"/proc/{current}/task/{tid}/children", "rb") as children:
                    pending.extend(int(child) for child in children.read().split())
        except FileNotFoundError:
            if first:
                return None  # no children files: this kernel cannot list them
            continue  # a worker that exited between listing and reading
        except (OSError, ValueError):
            if first:
                return None
            continue
        first = False
    return total
