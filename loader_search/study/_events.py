"""What the study layer tells its callers while it works: the study it opened (`StudyInfo`)
and the progress of its trials (`Reporter`: the CLI draws it; the Python API prints it as
plain lines, `LineReporter`, unless asked to be quiet). The session a worker runs is
`loader_search.study.work._session_state.Session`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal, Protocol, TextIO

from loader_search.errors import printable
from loader_search.params import LoaderParams
from loader_search.study._efficiency import efficiency_text

# How a trial ended, as progress reports it ("infeasible": it completed, out of memory or
# diverged, and the sampler learns to avoid its region).
EventState = Literal["complete", "infeasible", "failed"]


@dataclass(frozen=True)
class TrialEvent:
    number: int
    params: LoaderParams | None
    state: EventState
    throughput: float | None
    val_loss: float | None
    failure: str | None  # "reason: message"
    hint: str | None
    duration_s: float
    finished: int
    budget: int
    pareto_size: int
    best_throughput: float | None
    best_val_loss: float | None
    confirmation: bool = False  # a trial of the paired confirmation rounds, after the budget
    confirm_round: int | None = None  # its round
    val_loss_from: tuple[int, ...] = ()  # stopped early: the val_loss is theirs
    loader_efficiency: float | None = None  # throughput / ceiling

    @property
    def complete(self) -> bool:
        return self.state == "complete"


class Reporter(Protocol):
    """Receives progress: the CLI draws it (a live bar), the Python API prints it
    (`LineReporter`), or nothing hears it (`NullReporter`, ``quiet=True``)."""

    def preparing(self, what: str) -> None:
        """A step before the trials start (or a wait between them)."""

    def study_started(self, info: StudyInfo) -> None:
        """The study is open; ``info`` says what will run."""

    def trial_started(self, number: int, params: LoaderParams) -> None:
        """A trial begins training."""

    def trial_finished(self, event: TrialEvent) -> None:
        """A trial's outcome was stored."""

    def warning(self, what: str) -> None:
        """Something went wrong that the work survives (a database outage, a retry)."""


class NullReporter:
    def preparing(self, what: str) -> None:
        pass

    def study_started(self, info: StudyInfo) -> None:
        pass

    def trial_started(self, number: int, params: LoaderParams) -> None:
        pass

    def trial_finished(self, event: TrialEvent) -> None:
        pass

    def warning(self, what: str) -> None:
        pass


class LineReporter:
    """Progress as plain lines, one per step and per trial, flushed at once: what the Python
    API prints by default, fit for a notebook cell, a script's log or a pipe (no terminal
    control codes). ``stream`` defaults to standard error, looked up at each line (a notebook
    replaces it per cell)."""

    PREFIX = "[loader-search]"

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._last_step: str | None = None

    def _line(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(f"{self.PREFIX} {printable(text)}\n")  # names from the database
        stream.flush()

    def preparing(self, what: str) -> None:
        if what != self._last_step:  # a wait repeats its step while it lasts: said once
            self._line(f"{what} ...")
        self._last_step = what

    def study_started(self, info: StudyInfo) -> None:
        self._last_step = None
        verb = "created" if info.created else "continuing"
        self._line(
            f"{verb} study {info.name!r} in {info.storage}: {info.finished}/{info.budget}"
            f" trials done; workload {info.workload}; hardware {info.device}"
            f" (class {info.hardware_class})"
        )
        for note in info.notes:
            self._line(f"note: {note}")
        if info.finished >= info.budget:
            self._line(
                f"trial budget already used; pass n_trials above {info.budget} to search more"
                " (unfinished confirmation rounds still run)"
            )

    def trial_started(self, number: int, params: LoaderParams) -> None:
        self._last_step = None
        self._line(f"trial #{number} started: {params.describe()}")

    def trial_finished(self, event: TrialEvent) -> None:
        settings = event.params.describe() if event.params else ""
        if event.confirmation:
            settings += " (confirmation"
            if event.confirm_round is not None:
                settings += f", round {event.confirm_round}"
            settings += ")"
        progress = f"[{event.finished}/{event.budget}]"
        if event.complete and event.throughput is not None and event.val_loss is not None:
            mark = "~" if event.val_loss_from else ""  # the val_loss of another trial
            efficiency = (
                f", efficiency {efficiency_text(event.loader_efficiency)}"
                if event.loader_efficiency
                else ""
            )
            self._line(
                f"trial #{event.number} {progress} {event.throughput:,.0f} samples/s, val_loss"
                f" {event.val_loss:.4f}{mark}{efficiency}, {event.duration_s:.1f} s: {settings}"
            )
        else:
            self._line(
                f"trial #{event.number} {progress} {event.state} ({event.duration_s:.1f} s):"
                f" {settings}: {event.failure or ''}"
            )
            if event.hint:
                self._line(f"  hint: {event.hint}")

    def warning(self, what: str) -> None:
        self._line(f"warning: {what}")


@dataclass(frozen=True)
class StudyInfo:
    name: str
    storage: str  # masked
    created: bool
    budget: int
    finished: int
    device: str
    hardware_class: str
    workload: str
    usable_cpus: int
    notes: tuple[str, ...]
