"""The measured iterators the trial hook hands a command's loop (`loader_search.trial._inject`):
the training loader's, timed, cut at the budget and costed by stage, and every other loader's,
counted as evaluation progress.

A trial runs the command in one of three modes (``settings.json``'s ``mode``):

* ``train``: the trial itself. The window is the user's whole step plus the data wait
  (`StepMeter`); the iteration ends at this rank's share of ``train_samples``.
* ``ceiling``: the same script with its loader out of the way. The first
  ``CEILING_DISTINCT_BATCHES`` batches come from the loader as usual, then the iterator serves
  them again, from memory, without asking the loader: the window times the user's own step
  alone (their copy to the device included), the throughput no loader setting can beat, as a
  built-in trial's ceiling is (`loader_search.trial._ceiling`). It ends once the window holds
  ``CEILING_MIN_STEPS`` batches and ``CEILING_MIN_S`` seconds.
* ``probe``: a look at which loader trains and what it is (`loader_search.trial._probe`): no
  budget; the service stops the command once it has seen enough batches.

Stage costs (what the built-in trials measure, `loader_search.trial._stages`), over the
window, in the training process: with workers, the CPU time ``next()`` takes in this thread
(receiving a batch from the worker queue); without, that time is the producer's, split into
the collate (`loader_search.trial._hookworker.HookCollate` times it) and the fetch (the rest).
The workers' own costs are in their files.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from loader_search.trial import _hookworker
from loader_search.trial._hookstate import ProcessState, rank_share, world_size

CEILING_DISTINCT_BATCHES = 2  # cycled: their content does not change the compute
CEILING_MIN_STEPS = 5
CEILING_MIN_S = 0.5


class TrainRun:
    """The training loader's measurement across its iterators (epochs)."""

    def __init__(self, loader: Any, state: ProcessState, owner: Any = None) -> None:
        from loader_search.trial._measure import StepMeter
        from loader_search.trial._step import default_batch_size

        self.state = state
        self.owner = owner  # the loader's `_inject._LoaderInfo`, whose batches these are
        # No longer the training loader (`loader_search.trial._hookpick`): its iterators pass
        # its batches through, neither counted nor cut.
        self.retired = False
        settings = state.settings
        self.workers = int(getattr(loader, "num_workers", 0) or 0)
        # The batches the workers prefetched while the model was not asking come at once:
        # they are warm-up too.
        in_flight = (
            self.workers * int(getattr(loader, "prefetch_factor", 0) or 0) if self.workers else 0
        )
        self.mode = settings.mode
        warmup = settings.warmup_batches + in_flight
        if self.mode == "ceiling":
            warmup += CEILING_DISTINCT_BATCHES  # the batches read from the loader
        self.meter = StepMeter(max(1, warmup), self._sync)
        state.meter = self.meter
        total = settings.train_samples
        self.share = (
            None if total is None or self.mode != "train" else rank_share(total, world_size())
        )
        self.pending: int | None = None  # samples of the batch whose step is running
        self.pending_from = 0  # the iterator (`TrainIter.serial`) that delivered that batch
        self.iterators = 0  # the iterators made so far: each one's serial
        # When the batch that reached the budget was delivered: the budget is used then, its
        # step (the window's last) ends later (`close_at_budget`).
        self.reached_at: float | None = None
        state.close_at_budget = self.close_at_budget
        self.started = False
        self._size_failed = False
        self._batch_size = default_batch_size
        # Ceiling mode: the batches served again, how many were served, when the window began.
        self.cache: list[Any] | None = [] if self.mode == "ceiling" else None
        self.served = 0
        self._window_seen_at: float | None = None

    def _sync(self) -> None:
        if not self.state.sync_device:
            return
        cuda = sys.modules.get("torch.cuda")
        if cuda is not None and cuda.is_initialized():
            cuda.synchronize()

    def done(self) -> bool:
        if self.cache is not None:
            return self._ceiling_done()
        return self.share is not None and self.state.samples >= self.share

    def _ceiling_done(self) -> bool:
        meter = self.meter
        if not meter.in_window:
            return False
        now = time.perf_counter()
        if self._window_seen_at is None:
            self._window_seen_at = now
        steps = self.state.stages["window_batches"]
        return steps >= CEILING_MIN_STEPS and now - self._window_seen_at >= CEILING_MIN_S

    def next_batch(self, iterator: Iterator[Any]) -> Any:
        """The next batch: the loader's, or in ceiling mode one served again from memory."""
        cache = self.cache
        if cache is None:
            return next(iterator)
        if len(cache) < CEILING_DISTINCT_BATCHES:
            batch = next(iterator)
            cache.append(batch)
            return batch
        self.served += 1
        return cache[self.served % len(cache)]

    def new_iterator(self) -> None:
        meter = self.meter
        if not self.started:
            self.started = True
            meter.start()
            return
        self.close_step()
        self.state.idle_window = None
        if meter.in_window:
            # The time since the last epoch ended is the user's validation, not training:
            # left out of the window (a new iterator's worker start-up stays in, in its
            # first batch's wait).
            meter.step(0, exclude=float("inf"))

    def close_step(self) -> None:
        # Taken before the step is counted: a dropped iterator's `dropped`, run by the
        # garbage collector inside it, finds no step left to close twice.
        pending, self.pending = self.pending, None
        if pending is not None:
            self.meter.step(pending)

    def before_next(self) -> bool:
        """Close the previous batch's step; True where the budget stops the iteration."""
        self.close_step()
        if not self.done():
            return False
        state = self.state
        if not state.budget_reached:
            state.budget_reached = True
            state.budget_reached_at = self.reached_at or time.time()
            state.final_window = state.window()
            state.write()
        return True

    def close_at_budget(self) -> None:
        """The training loop is over (another loader's batch, a reported loss, the exit):
        where the batch that reached the budget still has its step open, as a script that
        stops itself there leaves it, the step ends now, and the window with it."""
        if self.pending is not None and self.reached_at is not None:
            self.before_next()

    def dropped(self, serial: int) -> None:
        """The iterator ``serial`` was dropped (a ``break`` out of its loop, garbage
        collection) with its last batch's step open: the step ends here, as at an epoch's
        end (at the budget, the window too). A step of a later iterator is not its own."""
        if self.pending is not None and self.pending_from == serial and not self.retired:
            self.epoch_end()

    def epoch_end(self) -> None:
        """The underlying iterator ended (an epoch): the last batch's step ends here."""
        if not self.before_next():
            self.state.idle_window = None
            self.state.idle_window = self.state.window()

    def delivered(self, batch: Any, next_cpu_s: float, serial: int) -> None:
        samples = self._size(batch)
        state = self.state
        state.samples += samples
        state.batches += 1
        self.pending_from = serial
        self.pending = samples
        if self.reached_at is None and self.share is not None and state.samples >= self.share:
            # Used up now: a script that stops itself at its budget never asks again.
            self.reached_at = time.time()
        if self.meter.in_window:
            self._costed(samples, next_cpu_s)
        state.maybe_write()

    def _costed(self, samples: int, next_cpu_s: float) -> None:
        stages = self.state.stages
        stages["window_batches"] += 1
        if self.cache is not None and self.served:
            return  # served from memory: no stage ran
        if self.workers:
            stages["main_cpu_s"] += next_cpu_s
            return
        collate = _hookworker.inline_collate_s[0]
        stages["collate_cpu_s"] += collate
        stages["fetch_cpu_s"] += max(0.0, next_cpu_s - collate)
        stages["samples"] += samples
        stages["batches"] += 1

    def _size(self, batch: Any) -> int:
        try:
            return self._batch_size(batch)
        except Exception as exc:
            if not self._size_failed:
                self._size_failed = True
                self.state.record_error("counting a batch's samples", exc)
            return 0


class _Wrapped:
    """An iterator of the user's loader, wrapped: what is not the wrapper's own (its length,
    a worker-backed iterator's attributes) is the wrapped one's."""

    _it: Iterator[Any]

    def __iter__(self) -> _Wrapped:
        return self

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "_it":  # not set yet (a copy being made): no endless lookup
            raise AttributeError(name)
        return getattr(self._it, name)


class TrainIter(_Wrapped):
    """The training loader's iterator, measured and cut at the budget."""

    def __init__(self, iterator: Iterator[Any], run: TrainRun) -> None:
        self._it = iterator
        self._run = run
        run.iterators += 1
        self.serial = run.iterators

    def __del__(self) -> None:
        # A loop the script left with a ``break`` drops its iterator here (one in a cycle, at
        # the next collection). Not a forked loader worker's copy, nor once the interpreter
        # is going down: its exit (`ProcessState.at_exit`) wrote the last state, and what
        # this module uses may be gone.
        with contextlib.suppress(Exception):
            run = self.__dict__.get("_run")
            if run is None or sys.is_finalizing() or os.getpid() != run.state.pid:
                return
            _call(lambda: run.dropped(self.serial), run.state)

    def __next__(self) -> Any:
        run = self._run
        if run.retired:
            return _ticked(next(self._it), run.state, run.owner)
        try:
            stop = run.before_next()
        except Exception as exc:
            run.state.record_error("measuring the training loop", exc)
            stop = False
        if stop:
            # Dropped, a worker-backed iterator shuts its workers down (persistent ones stay
            # with their loader, as they would).
            self._it = iter(())
            raise StopIteration
        _call(run.meter.wait_begin, run.state)
        _hookworker.inline_collate_s[0] = 0.0
        cpu = time.thread_time()
        try:
            batch = run.next_batch(self._it)
        except StopIteration:
            _call(run.meter.wait_end, run.state)
            _call(run.epoch_end, run.state)
            raise
        cpu = time.thread_time() - cpu
        _call(run.meter.wait_end, run.state)
        try:
            run.delivered(batch, cpu, self.serial)
            run.state.last_batch_from = run.owner
        except Exception as exc:
            run.state.record_error("counting the training batches", exc)
        return batch


class TickIter(_Wrapped):
    """Another loader's iterator: its batches count as evaluation progress.

    ``switch`` (called before each batch) returns the training iterator that replaces this
    one once the optimizer steps made its loader the training loader
    (`loader_search.trial._hookpick`), else None. The rest of this epoch is then the new
    iterator's: measured at the trial's settings from the next batch, not an epoch later.
    """

    def __init__(
        self,
        iterator: Iterator[Any],
        state: ProcessState,
        owner: Any = None,
        switch: Callable[[], Iterator[Any] | None] | None = None,
    ) -> None:
        self._it = iterator
        self._state = state
        self._owner = owner
        self._switch = switch
        self._training = False

    def __next__(self) -> Any:
        if self._training:
            return next(self._it)
        state = self._state
        if self._switch is not None:
            try:
                replacement = self._switch()
            except Exception as exc:
                state.record_error("switching to the training loader", exc)
                replacement = None
            if replacement is not None:
                self._it, self._training = replacement, True
                return next(replacement)
        _call(state.budget_step_over, state)
        return _ticked(next(self._it), state, self._owner)


def _ticked(batch: Any, state: ProcessState, owner: Any) -> Any:
    try:
        state.ticks += 1
        state.last_batch_from = owner
        state.touch()
        state.maybe_write()
    except Exception as exc:
        state.record_error("counting evaluation batches", exc)
    return batch


def _call(action: Any, state: ProcessState) -> None:
    try:
        action()
    except Exception as exc:
        state.record_error("measuring the training loop", exc)
