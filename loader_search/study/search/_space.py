"""The search space: which DataLoader settings a study tries, and the rules between them.

`SearchSpace` is what a study config declares (machine independent, stored with the study).
`SearchSpace.resolve` binds it to this machine (usable CPUs, CUDA or not) and gives a
`ResolvedSpace`, whose `suggest` asks an Optuna trial for one `LoaderParams`.

Rules enforced here, because PyTorch enforces them at construction or, worse, at iteration:
- ``prefetch_factor`` and ``persistent_workers`` are suggested only when ``num_workers > 0``;
- ``num_workers`` never exceeds the CPUs this process may use (affinity and cgroup quota);
- ``pin_memory`` is searched only on CUDA, where it matters;
- the main process's torch thread count is always set explicitly: either searched, or by the
  default rule "the CPUs the loader workers leave free" (`default_torch_threads`).
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from loader_search.params import BACKENDS, START_METHODS, Backend, LoaderParams, StartMethod

if TYPE_CHECKING:
    from optuna.trial import Trial


@dataclass(frozen=True)
class IntRange:
    """An inclusive integer range."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"empty range: min {self.low} > max {self.high}")

    def values(self) -> list[int]:
        return list(range(self.low, self.high + 1))


@dataclass(frozen=True)
class CpuRange:
    """A range of counts bounded by this machine's CPUs; ``high=None`` means all usable CPUs."""

    low: int = 0
    high: int | None = None

    def __post_init__(self) -> None:
        if self.low < 0:
            raise ValueError(f"min must be >= 0, got {self.low}")
        if self.high is not None and self.high < self.low:
            raise ValueError(f"empty range: min {self.low} > max {self.high}")

    def bind(self, usable_cpus: int, what: str, notes: list[str]) -> IntRange:
        """The concrete range on a machine with ``usable_cpus``; narrowing is noted."""
        high = usable_cpus if self.high is None else self.high
        if high > usable_cpus:
            notes.append(
                f"{what} max {high} is above the {usable_cpus} CPU(s) this process may use;"
                f" searching up to {usable_cpus}"
            )
            high = usable_cpus
        low = min(self.low, high)
        if low != self.low:
            notes.append(f"{what} min {self.low} lowered to {low} ({usable_cpus} usable CPUs)")
        return IntRange(low, high)

    def as_dict(self) -> dict[str, Any]:
        return {"min": self.low, "max": "auto" if self.high is None else self.high}


def power_of_two_steps(low: int, high: int) -> tuple[int, ...]:
    """``low, 2*low, 4*low, ...`` up to ``high``: batch sizes at power-of-two steps."""
    if low <= 0:
        raise ValueError(f"batch sizes must be positive, got {low}")
    values = []
    value = low
    while value <= high:
        values.append(value)
        value *= 2
    return tuple(values)


def default_torch_threads(num_workers: int, usable_cpus: int) -> int:
    """Threads for the training process when they are not searched: the CPUs left over.

    On a small CPU, loader workers and the model's intra-op threads compete for the same cores;
    giving the model only what the workers leave avoids oversubscription (measured on 2 cores:
    2 threads next to 2 busy workers roughly halves throughput).
    """
    return max(1, usable_cpus - num_workers)


@dataclass(frozen=True)
class SearchSpace:
    """The declared space. ``None`` means "decide for this machine" (see `resolve`)."""

    batch_sizes: tuple[int, ...] = power_of_two_steps(32, 256)
    num_workers: CpuRange = CpuRange(0, None)
    prefetch_factor: IntRange = IntRange(1, 8)
    persistent_workers: bool | None = None  # None: searched (only with workers)
    pin_memory: bool | None = None  # None: searched on CUDA, off on CPU
    torch_threads: int | CpuRange | None = None  # None: default rule; int: fixed; range: searched
    # With workers only. in_order None: searched. start_method (): the platform's default;
    # several: searched, like backend's several.
    in_order: bool | None = True
    start_method: tuple[StartMethod, ...] = ()
    backend: tuple[Backend, ...] = ("process",)

    def __post_init__(self) -> None:
        if not self.batch_sizes:
            raise ValueError("no batch sizes to search")
        if not self.backend or any(b not in BACKENDS for b in self.backend):
            raise ValueError(f"backend must be some of {', '.join(BACKENDS)}, got {self.backend}")
        if any(m not in START_METHODS for m in self.start_method):
            raise ValueError(
                f"start_method must be some of {', '.join(START_METHODS)}, got {self.start_method}"
            )
        if any(b <= 0 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")
        if self.prefetch_factor.low < 1:
            raise ValueError("prefetch_factor must be >= 1 (0 fails when the loader iterates)")

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form, stored on the study so a continued study can be checked."""
        threads: Any = self.torch_threads
        if isinstance(threads, CpuRange):
            threads = threads.as_dict()
        return {
            "batch_sizes": list(self.batch_sizes),
            "num_workers": self.num_workers.as_dict(),
            "prefetch_factor": {"min": self.prefetch_factor.low, "max": self.prefetch_factor.high},
            "persistent_workers": self.persistent_workers,
            "pin_memory": self.pin_memory,
            "torch_threads": threads,
            # Only when not the default: studies from before keep their fingerprint.
            **({} if self.in_order is True else {"in_order": self.in_order}),
            **({"start_method": list(self.start_method)} if self.start_method else {}),
            **({} if self.backend == ("process",) else {"backend": list(self.backend)}),
        }

    def resolve(self, usable_cpus: int, cuda: bool) -> ResolvedSpace:
        """Bind the space to this machine; `ResolvedSpace.notes` says what was narrowed."""
        notes: list[str] = []
        num_workers = self.num_workers.bind(usable_cpus, "num_workers", notes)

        pin_memory = self.pin_memory
        if not cuda and pin_memory:
            notes.append("pin_memory only helps copies to CUDA; it stays off on CPU")
        if not cuda:
            pin_memory = False

        threads: int | IntRange | None
        if isinstance(self.torch_threads, CpuRange):
            threads = self.torch_threads.bind(usable_cpus, "torch_threads", notes)
            if threads.low < 1:
                threads = IntRange(1, max(1, threads.high))
        else:
            threads = self.torch_threads

        in_order = self.in_order
        if in_order is not True and not _has_in_order():
            notes.append(
                f"in_order = {'search' if in_order is None else 'false'} needs torch >= 2.6"
                f" (this is {torch_version()}): batches are delivered in order"
            )
            in_order = True
        available = multiprocessing.get_all_start_methods()
        methods = tuple(m for m in self.start_method if m in available)
        if len(methods) < len(self.start_method):
            missing = ", ".join(m for m in self.start_method if m not in available)
            notes.append(f"start method {missing} is not available here: left out")
        backends = self.backend
        if "thread" in backends and not _has_torchdata():
            notes.append(
                "backend 'thread' needs torchdata (pip install 'loader-search[threads]'):"
                " worker processes only"
            )
            backends = ("process",)
        return ResolvedSpace(
            batch_sizes=tuple(self.batch_sizes),
            num_workers=num_workers,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers,
            pin_memory=pin_memory,
            torch_threads=threads,
            usable_cpus=usable_cpus,
            in_order=in_order,
            start_method=methods,
            backend=backends,
            notes=tuple(notes),
        )


@dataclass(frozen=True)
class ResolvedSpace:
    """The space on this machine. `suggest` is the only place trial parameters are drawn."""

    batch_sizes: tuple[int, ...]
    num_workers: IntRange
    prefetch_factor: IntRange
    persistent_workers: bool | None
    pin_memory: bool | None
    torch_threads: int | IntRange | None
    usable_cpus: int
    in_order: bool | None = True
    start_method: tuple[StartMethod, ...] = ()
    backend: tuple[Backend, ...] = ("process",)
    notes: tuple[str, ...] = field(default=(), compare=False)

    def size(self) -> int:
        """How many distinct settings `suggest` can return (the grid sampler's total)."""
        with_workers = self.num_workers.high - max(self.num_workers.low, 1) + 1
        per_worker_count = 0
        for backend in self.backend:
            count = len(self.prefetch_factor.values())
            if self.in_order is None:
                count *= 2
            if backend == "process":
                if self.persistent_workers is None:
                    count *= 2
                count *= max(1, len(self.start_method))
            per_worker_count += count
        loaders = (1 if self.num_workers.low == 0 else 0) + max(0, with_workers) * per_worker_count
        if self.pin_memory is None:
            loaders *= 2
        if isinstance(self.torch_threads, IntRange):
            loaders *= len(self.torch_threads.values())
        return len(self.batch_sizes) * loaders

    def suggest(self, trial: Trial) -> LoaderParams:
        """Ask the trial for one configuration, suggesting conditional parameters only when
        they apply (so samplers never learn from values that had no effect)."""
        batch_size = trial.suggest_categorical("batch_size", list(self.batch_sizes))
        num_workers = trial.suggest_int("num_workers", self.num_workers.low, self.num_workers.high)
        prefetch_factor: int | None = None
        persistent = False
        in_order = True
        start_method: StartMethod | None = None
        backend: Backend = self.backend[0]
        if num_workers > 0:
            if len(self.backend) > 1:
                backend = cast(Backend, trial.suggest_categorical("backend", list(self.backend)))
            prefetch_factor = trial.suggest_int(
                "prefetch_factor", self.prefetch_factor.low, self.prefetch_factor.high
            )
            if backend == "process":
                if self.persistent_workers is None:
                    persistent = trial.suggest_categorical("persistent_workers", [False, True])
                else:
                    persistent = self.persistent_workers
                if len(self.start_method) > 1:
                    start_method = cast(
                        StartMethod,
                        trial.suggest_categorical("start_method", list(self.start_method)),
                    )
                elif self.start_method:
                    start_method = self.start_method[0]
            if self.in_order is None:
                in_order = trial.suggest_categorical("in_order", [True, False])
            else:
                in_order = self.in_order
        else:
            backend = "process"
        if self.pin_memory is None:
            pin_memory = trial.suggest_categorical("pin_memory", [False, True])
        else:
            pin_memory = self.pin_memory
        return LoaderParams(
            batch_size=int(batch_size),
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=bool(pin_memory),
            persistent_workers=bool(persistent),
            torch_threads=self._threads(trial, num_workers),
            in_order=bool(in_order),
            start_method=start_method,
            backend=backend,
        )

    def problem(self, params: LoaderParams, *, baseline: bool = False) -> str | None:
        """What puts ``params``, drawn by `suggest` for a queued trial, outside this space,
        or None. Optuna runs a queued value of an integer parameter whatever its range says
        (it only warns); a queued choice that is none of a categorical's options already
        fails in `suggest` (ValueError), and fixed settings are never taken from the queue.
        ``baseline``: the plain loader, no workers, which may lie outside a num_workers
        range that starts above 0."""

        def outside(name: str, value: object, allowed: IntRange) -> str:
            return f"{name}={value} is outside the study's space ({allowed.low} to {allowed.high})"

        workers = self.num_workers
        if not workers.low <= params.num_workers <= workers.high and not (
            baseline and params.num_workers == 0
        ):
            return outside("num_workers", params.num_workers, workers)
        prefetch = self.prefetch_factor
        if (
            params.num_workers > 0
            and not prefetch.low <= (params.prefetch_factor or 0) <= prefetch.high
        ):
            return outside("prefetch_factor", params.prefetch_factor, prefetch)
        threads = self.torch_threads
        if (
            isinstance(threads, IntRange)
            and not threads.low <= params.torch_threads <= threads.high
        ):
            return outside("torch_threads", params.torch_threads, threads)
        return None

    def _threads(self, trial: Trial, num_workers: int) -> int:
        if self.torch_threads is None:
            return default_torch_threads(num_workers, self.usable_cpus)
        if isinstance(self.torch_threads, int):
            return self.torch_threads
        return trial.suggest_int("torch_threads", self.torch_threads.low, self.torch_threads.high)

    def trial_params(self, params: LoaderParams) -> dict[str, Any]:
        """The Optuna parameters that make `suggest` return ``params`` (for
        ``enqueue_trial``): only those this space suggests, as `suggest` names them."""
        values: dict[str, Any] = {
            "batch_size": params.batch_size,
            "num_workers": params.num_workers,
        }
        if params.num_workers > 0:
            if len(self.backend) > 1:
                values["backend"] = params.backend
            values["prefetch_factor"] = params.prefetch_factor
            if params.backend == "process":
                if self.persistent_workers is None:
                    values["persistent_workers"] = params.persistent_workers
                if len(self.start_method) > 1:
                    values["start_method"] = params.start_method
            if self.in_order is None:
                values["in_order"] = params.in_order
        if self.pin_memory is None:
            values["pin_memory"] = params.pin_memory
        if isinstance(self.torch_threads, IntRange):
            values["torch_threads"] = params.torch_threads
        return values

    def baseline(self, batch_size: int) -> dict[str, Any]:
        """Trial parameters of the loader most users start from: their batch size, no workers,
        no pinning, and torch's default of one thread per usable CPU."""
        params: dict[str, Any] = {"batch_size": batch_size, "num_workers": 0}
        if self.pin_memory is None:
            params["pin_memory"] = False
        if isinstance(self.torch_threads, IntRange):
            params["torch_threads"] = min(
                max(self.usable_cpus, self.torch_threads.low), self.torch_threads.high
            )
        return params


def _has_in_order() -> bool:
    """Whether this torch's DataLoader takes ``in_order`` (torch >= 2.6)."""
    from torch.utils.data import DataLoader

    return "in_order" in inspect.signature(DataLoader.__init__).parameters


def _has_torchdata() -> bool:
    return importlib.util.find_spec("torchdata") is not None


def torch_version() -> str:
    import torch

    return str(torch.__version__)
