"""How a trial can fail: the reasons, their hints, and the classifiers that name them.

Every way a trial can end without a result becomes a `TrialFailure` with one of the reason
constants below; `classify_exception` reads a raised exception, `classify_exit` the exit of a
child that sent nothing. A `TrialOutcome` carries either the result or the failure back to the
study, which stores the reason (the study layer's keys import the names from here).

This module imports neither Optuna, nor torch, nor psutil: reading a stored reason (``best``,
``report``) must stay light. Torch's own out-of-memory type is recognised only where torch is
already loaded, which it is wherever a trial could have raised it.
"""

from __future__ import annotations

import math
import signal
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, Literal

from loader_search.errors import TrainingDiverged

if TYPE_CHECKING:
    from loader_search.trial._result import TrialResult

# Failure reasons (`TrialFailure.reason`): a trial's own, then the ones the study layer adds
# (`loader_search.study._keys`: settings inferred not to fit without training them, queued
# settings refused, a result the database could not take in time).
FailureReason = Literal[
    "cuda_oom",
    "host_oom",
    "worker_killed",
    "timeout",
    "exception",
    "diverged",
    "crashed",
    "interrupted",
    "not_applied",
    "budget_not_honoured",
    "no_val_loss",
    "inferred_oom",
    "refused",
    "lost",
]
CUDA_OOM: Final = "cuda_oom"
HOST_OOM: Final = "host_oom"
WORKER_KILLED: Final = "worker_killed"
TIMEOUT: Final = "timeout"
EXCEPTION: Final = "exception"
DIVERGED: Final = "diverged"
CRASHED: Final = "crashed"
INTERRUPTED: Final = "interrupted"
# A command's own (loader_search.trial._command): its settings reached no loader it iterated;
# it trained on past its budget without ending or reporting; it reported no validation loss.
NOT_APPLIED: Final = "not_applied"
BUDGET_NOT_HONOURED: Final = "budget_not_honoured"
NO_VAL_LOSS: Final = "no_val_loss"

# Deterministic for a setting on given hardware: running it again would fail again, so the
# search should learn to avoid it (Optuna constraint) rather than merely skip it.
INFEASIBLE_REASONS = frozenset({CUDA_OOM, HOST_OOM, DIVERGED})

SHM_HINT = (
    "loader workers pass batches through /dev/shm, which is probably too small: raise it"
    " (docker run --shm-size=2g, compose shm_size: 2g) or lower num_workers x prefetch_factor"
    " x batch_size"
)
HINTS = {
    CUDA_OOM: "this batch does not fit in GPU memory here: smaller batch sizes fit",
    HOST_OOM: (
        "the trial ran out of host memory: fewer num_workers, a smaller prefetch_factor or"
        " batch_size fit; or raise [limits] memory_limit_gb / the container's memory"
    ),
    WORKER_KILLED: (
        "a DataLoader worker died: run the workload with num_workers=0 to see the error"
        " directly; a bus error means /dev/shm is too small (docker run --shm-size=2g)"
    ),
    TIMEOUT: (
        "the training made no progress: look for a deadlock or a blocking read in the"
        " dataset; raise [limits] trial_timeout_s if single steps really take this long"
    ),
    EXCEPTION: "the workload's code raised: fix it (the traceback is stored with the trial)",
    DIVERGED: "the loss became non-finite: lower training.lr or use lr_scaling = 'sqrt'",
    CRASHED: (
        "the training process crashed in native code (an extension, a driver): run the"
        " workload alone with num_workers=0 to reproduce"
    ),
    INTERRUPTED: "interrupted: run the study again to continue it",
    NOT_APPLIED: (
        "the trial's loader settings reached no DataLoader the command iterated: pass them as"
        " flags ({batch_size}, {num_workers}, ...) or pick the loader with [workload]"
        " train_loader = N"
    ),
    BUDGET_NOT_HONOURED: (
        "pass the budget to the script ({train_samples} or {max_steps}) or let it end its"
        " epoch loop (the training loader yields nothing once the budget is used)"
    ),
    NO_VAL_LOSS: (
        "print the validation loss as val_loss=N, call loader_search.report(val_loss=...) after"
        " the validation, or give a regular expression that finds it in the output ([workload]"
        " val_loss_pattern, or run --val-loss-pattern)"
    ),
}

TRACEBACK_LINES = 15  # the tail of a traceback kept with a failure
MESSAGE_CHARS = 500


@dataclass(frozen=True)
class TrialFailure:
    """Why a trial did not produce a result.

    ``reason`` is one of `FailureReason`; ``message`` one line naming what
    happened; ``hint`` one actionable line; ``traceback`` the last lines of the Python
    traceback ("" when there is none, e.g. the process was killed); ``infeasible`` whether the
    setting cannot work on this hardware (see `INFEASIBLE_REASONS`).
    """

    reason: FailureReason
    message: str
    hint: str
    traceback: str = ""
    infeasible: bool = False


@dataclass(frozen=True)
class TrialOutcome:
    """What one isolated trial gave: exactly one of ``result`` and ``failure`` is set.

    Overhead of isolation, all measured by the parent's monotonic clock (shared with the child
    on Linux): ``startup_s`` from the fork until the child was ready to train; ``transfer_s``
    from the child sending its result (or failure) until the parent had it; ``teardown_s``
    from then until the child and its leftovers were reaped. ``wall_s`` is the whole call.
    ``isolated`` is False where the trial ran in-process (no fork on this platform).
    """

    result: TrialResult | None
    failure: TrialFailure | None
    wall_s: float
    startup_s: float
    transfer_s: float = 0.0
    teardown_s: float = 0.0
    isolated: bool = True
    exitcode: int | None = None

    @property
    def overhead_s(self) -> float:
        """Time isolation added to the trial."""
        return self.startup_s + self.transfer_s + self.teardown_s


def failure_for(
    reason: FailureReason, message: str, trace: str = "", hint: str | None = None
) -> TrialFailure:
    """A `TrialFailure` with the reason's standard hint and infeasibility."""
    return TrialFailure(
        reason=reason,
        message=_one_line(message),
        hint=hint if hint is not None else HINTS[reason],
        traceback=trace,
        infeasible=reason in INFEASIBLE_REASONS,
    )


def diverged_if_non_finite(outcome: TrialOutcome) -> TrialOutcome:
    """``outcome`` with a validation loss that is not finite turned into a ``diverged`` failure.

    A built-in workload raises `TrainingDiverged` itself; a command reports whatever its script
    computed (``loader_search.report(val_loss=nan)``, a printed ``inf``). Neither value can rank
    a setting: Optuna refuses nan, and inf would pass for a result and be recommended.
    """
    result = outcome.result
    if result is None or result.val_loss is None or math.isfinite(result.val_loss):
        return outcome
    failure = failure_for(DIVERGED, f"the validation loss reported is {result.val_loss}")
    return replace(outcome, result=None, failure=failure)


class RankFailed(Exception):
    """A rank of a multi-rank trial failed (`loader_search.trial._ranks`): ``failure`` is
    that rank's classified failure, and the trial's."""

    def __init__(self, rank: int, failure: TrialFailure) -> None:
        super().__init__(f"rank {rank}: {failure.message}")
        self.rank = rank
        self.failure = failure


# Text of errors whose type says nothing (RuntimeError), as PyTorch words them.
_CUDA_OOM_TEXT = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)
_HOST_OOM_TEXT = ("DefaultCPUAllocator: can't allocate memory",)
_SHM_TEXT = (
    "bus error",  # "is killed by signal: Bus error", "Unexpected bus error"
    "shared memory",
    "unable to write to file </torch_",
    "unable to open shared memory",
    "unable to mmap",
)


def classify_exception(exc: BaseException) -> TrialFailure:
    """The failure an exception raised by a trial stands for.

    ``torch.OutOfMemoryError`` or CUDA's out-of-memory texts → ``cuda_oom``; ``MemoryError``
    or the CPU allocator's text → ``host_oom``; a DataLoader worker killed by SIGKILL (what the
    kernel's OOM killer sends) → ``host_oom``; by another signal, or shared-memory errors →
    ``worker_killed``; `TrainingDiverged` → ``diverged``; ``KeyboardInterrupt`` →
    ``interrupted``; anything else → ``exception``. The exception's cause and context chain is
    searched too (user code may wrap an out-of-memory error).
    """
    if isinstance(exc, RankFailed):  # classified where it happened, in its rank
        failure = exc.failure
        return replace(failure, message=_one_line(f"rank {exc.rank}: {failure.message}"))
    trace = _traceback_tail(exc)
    chain = list(_chain(exc))
    # "DataLoader worker (pid(s) N) exited unexpectedly" hides the signal in its cause.
    signalled = [e for e in chain if "killed by signal" in str(e)]
    message = _summary(signalled[0] if signalled else exc)
    texts = " | ".join(str(e) for e in chain)
    lowered = texts.lower()
    if isinstance(exc, KeyboardInterrupt):
        return failure_for(INTERRUPTED, "interrupted by the user (Ctrl-C)", trace)
    if any(_is_device_oom(e) for e in chain) or any(t in texts for t in _CUDA_OOM_TEXT):
        return failure_for(CUDA_OOM, message, trace)
    if any(isinstance(e, MemoryError) for e in chain) or any(t in texts for t in _HOST_OOM_TEXT):
        return failure_for(HOST_OOM, message, trace)
    if "is killed by signal: Killed" in texts:
        return failure_for(
            HOST_OOM,
            f"{message} (SIGKILL: most likely the kernel's out-of-memory killer)",
            trace,
        )
    if any(t in lowered for t in _SHM_TEXT):
        return failure_for(WORKER_KILLED, message, trace, hint=SHM_HINT)
    if "DataLoader worker" in texts and (
        "killed by signal" in texts or "exited unexpectedly" in texts
    ):
        return failure_for(WORKER_KILLED, message, trace)
    if any(isinstance(e, TrainingDiverged) for e in chain):
        return failure_for(DIVERGED, message, trace)
    return failure_for(EXCEPTION, message, trace)


def classify_exit(exitcode: int | None) -> TrialFailure:
    """The failure of a child that ended without sending anything, and that the parent did not
    kill. A SIGKILL is then the kernel's out-of-memory killer (nothing else sends SIGKILL to a
    trial); another signal is a crash in native code; an exit code means the code called
    ``os._exit``.
    """
    if exitcode is not None and exitcode < 0:
        number = -exitcode
        name = _signal_name(number)
        if number == signal.SIGKILL:
            return failure_for(
                HOST_OOM,
                "the training process was killed by SIGKILL, not by loader-search: most"
                " likely the kernel's out-of-memory killer",
            )
        if number == signal.SIGINT:
            return failure_for(INTERRUPTED, "the training process was interrupted (SIGINT)")
        return failure_for(CRASHED, f"the training process died of signal {number} ({name})")
    return failure_for(
        CRASHED, f"the training process exited with code {exitcode} without a result"
    )


def _chain(exc: BaseException) -> Sequence[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not e for e in seen) and len(seen) < 10:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _is_device_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    # torch.OutOfMemoryError since torch 2.5; torch.cuda's name (an alias today) before.
    types = (
        getattr(torch, "OutOfMemoryError", None),
        getattr(torch.cuda, "OutOfMemoryError", None),
    )
    return any(t is not None and isinstance(exc, t) for t in types)


def _summary(exc: BaseException) -> str:
    """``Type: first line``; for an error re-raised from a DataLoader worker ("Caught X in
    DataLoader worker process N. Original Traceback ...") the original last line instead."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
        where = lines[0].split(" in ", 1)[1].rstrip(".")
        return f"{lines[-1]} (in {where})"
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _traceback_tail(exc: BaseException) -> str:
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    return "\n".join(lines[-TRACEBACK_LINES:])


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"
