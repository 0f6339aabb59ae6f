"""A model of the input pipeline: what any loader setting would reach, what limits it, and the
best a batch size can do on this machine.

Operational analysis, as Plumber (MLSys 2022) applies it to input pipelines: every stage has a
*demand* per sample (CPU seconds measured in the trials, see `loader_search.trial._stages`), and
a stage with ``m`` servers cannot pass more than ``m / demand`` samples per second. A setting's
throughput is at most the smallest of these bounds:

* **device**: the training step, at the ceiling measured for its batch size and threads (the
  model fed pre-decoded batches on the device);
* **loader workers**: ``num_workers / (fetch + collate)``, each worker a server;
* **main process**: receiving a batch from the workers and copying it to the device, in series
  with the step when the step runs on the CPU;
* **CPUs**: all of it shares the usable CPUs, ``cpus / (every CPU demand per sample)``; on the CPU
  the step itself demands ``torch_threads / ceiling``. Without an accelerator the step is no
  separate device: where the training step bounds a CPU-only pipeline, the bottleneck is named
  ``cpus`` (the CPUs, shared by training and loading), not ``device``.

With no workers the training process does everything in turn: ``1 / (sum of demands)``.

The raw bounds are scaled by a calibration factor, the median of measured / predicted over the
trials that measured their stage costs, one for settings without workers and one for settings
with them (queues and imperfect overlap cost something the bounds ignore). The model is a pure
function of stored trials: every worker of a team, fitting from the same trials, gets the same
model, and its prediction errors are stored per trial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import median
from typing import Any, Literal

from loader_search.params import LoaderParams
from loader_search.study.search._space import IntRange, ResolvedSpace, default_torch_threads

Bottleneck = Literal["device", "loader_workers", "main_process", "cpus"]
# "cpus": on a machine without an accelerator, where "device" would be named: the training
# step runs on the very CPUs the loading needs, so it is no separate device that bounds the
# pipeline but the CPUs, shared by both (more cores, a cheaper step or cheaper loading lift it).
BOTTLENECKS: tuple[Bottleneck, ...] = ("device", "loader_workers", "main_process", "cpus")
# Who says a batch size's limit: the model, or a measured setting that beat the model's limit.
LimitSource = Literal["model", "measurement"]
LIMIT_SOURCES: tuple[LimitSource, ...] = ("model", "measurement")
# The layout of the stored snapshot (`PipelineSnapshot.as_dict`, its "format"). Snapshots
# stored before it was written have none and the same layout: format 1. A reader meets a
# newer one when a newer loader-search shares the database: it shows no pipeline view rather
# than a misread one.
SNAPSHOT_FORMAT = 1
# A ceiling taken from another thread count scales by (threads ratio) ** this: intra-op
# parallelism of a small model is far from linear.
THREAD_SCALING = 0.6
CALIBRATION_RANGE = (0.5, 1.2)  # a calibration outside it says the model is wrong, not noisy
# Until a trial with workers (or without) has run, its costs are guessed from the other kind:
# collating into shared memory cost ~5x collating in place, and receiving a batch from a worker
# ~4x copying one, measured on 2 cores with the quickstart workload.
SHM_COLLATE = 5.0
QUEUE_RECEIVE = 4.0


@dataclass(frozen=True)
class Observation:
    """What one completed trial measured, as the model reads it (per-batch costs as stored)."""

    params: LoaderParams
    throughput: float
    ceiling: float | None = None  # samples/s of the model fed pre-decoded batches
    producer_cpu_s_per_sample: float | None = None
    collate_cpu_s_per_batch: float | None = None
    main_cpu_s_per_batch: float | None = None

    @property
    def has_costs(self) -> bool:
        return None not in (
            self.producer_cpu_s_per_sample,
            self.collate_cpu_s_per_batch,
            self.main_cpu_s_per_batch,
        )


@dataclass(frozen=True)
class Prediction:
    """The model's throughput for one setting and the stage that bounds it."""

    params: LoaderParams
    throughput: float
    bottleneck: Bottleneck
    bounds: dict[str, float]  # samples/s each stage allows (before calibration)
    extrapolated: bool  # its ceiling was not measured for this batch size and thread count

    def as_dict(self) -> dict[str, Any]:
        return {
            "params": self.params.as_dict(),
            "samples_per_s": self.throughput,
            "bottleneck": self.bottleneck,
            "bounds": dict(self.bounds),
            "extrapolated": self.extrapolated,
        }


@dataclass(frozen=True)
class Lift:
    """What would lift a batch size's limit, as the model predicts it
    (`loader_search.study.search._guide.lifts`): the lever, in words, the limit it would give, and
    its gain over the limit now."""

    lever: str  # more_cpus, cache_decoded, cheaper_transforms, gpu_decode or batch_size
    what: str
    predicted_limit_samples_per_s: float
    gain: float

    def as_dict(self) -> dict[str, Any]:
        """Stored in the study's pipeline snapshot (`PIPELINE_ATTR`), and shown by ``best
        --json``."""
        return {
            "lever": self.lever,
            "what": self.what,
            "predicted_limit_samples_per_s": self.predicted_limit_samples_per_s,
            "gain": self.gain,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Lift:
        """The lift `as_dict` stored (`ValueError` when it is not one: other hands write the
        database)."""
        try:
            return cls(
                lever=str(data["lever"]),
                what=str(data["what"]),
                predicted_limit_samples_per_s=float(data["predicted_limit_samples_per_s"]),
                gain=float(data["gain"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a stored lift: {exc}") from None


@dataclass(frozen=True)
class BatchLimit:
    """One batch size's entry of the pipeline snapshot: its limit (the samples/s of its best
    setting), whether the model or a measurement that beat it says so, the bottleneck of the
    model's best setting and whether its ceiling was extrapolated, the setting that reaches
    the limit, and what would lift it (largest first)."""

    limit_samples_per_s: float
    limit_from: LimitSource
    bottleneck: Bottleneck
    extrapolated: bool
    limit_params: LoaderParams
    lifts: tuple[Lift, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "limit_samples_per_s": self.limit_samples_per_s,
            "limit_from": self.limit_from,
            "bottleneck": self.bottleneck,
            "extrapolated": self.extrapolated,
            "limit_params": self.limit_params.as_dict(),
            "lifts": [lift.as_dict() for lift in self.lifts],
        }

    @classmethod
    def from_dict(cls, data: Any) -> BatchLimit:
        """The entry `as_dict` stored (`ValueError` when it is not one)."""
        try:
            bottleneck = data["bottleneck"]
            if bottleneck not in BOTTLENECKS:
                raise ValueError(f"not a stored batch limit: bottleneck {bottleneck!r}")
            source = data.get("limit_from", "model")
            if source not in LIMIT_SOURCES:
                raise ValueError(f"not a stored batch limit: limit_from {source!r}")
            return cls(
                limit_samples_per_s=float(data["limit_samples_per_s"]),
                limit_from=source,
                bottleneck=bottleneck,
                extrapolated=bool(data["extrapolated"]),
                limit_params=LoaderParams.from_dict(data["limit_params"]),
                lifts=tuple(Lift.from_dict(lift) for lift in data.get("lifts", ())),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a stored batch limit: {exc}") from None


@dataclass(frozen=True)
class PipelineSnapshot:
    """The pipeline model of one hardware class and each batch size's limit, stored with the
    study under its class (`PIPELINE_ATTR`) for `best`, the report and people. Readers take
    the model (`PipelineModel.from_dict`) and the entry of the batch size they need
    (`BatchLimit.from_dict`), so one damaged entry hides no other."""

    model: PipelineModel
    batch_sizes: dict[int, BatchLimit]

    @staticmethod
    def read(data: Any, batch_size: int) -> tuple[PipelineModel, BatchLimit]:
        """The model and the entry of ``batch_size`` from a snapshot `as_dict` stored, the
        other entries left unread (`ValueError` when either is not readable, or the snapshot
        is of another format than `SNAPSHOT_FORMAT`)."""
        try:
            model, entry = data["model"], data["batch_sizes"][str(batch_size)]
            layout = data.get("format", 1)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a stored pipeline snapshot: {exc}") from None
        if layout != SNAPSHOT_FORMAT:
            raise ValueError(
                f"a pipeline snapshot of format {layout!r}; this version reads {SNAPSHOT_FORMAT}"
            )
        return PipelineModel.from_dict(model), BatchLimit.from_dict(entry)

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": SNAPSHOT_FORMAT,
            "model": self.model.as_dict(),
            "batch_sizes": {str(b): limit.as_dict() for b, limit in self.batch_sizes.items()},
        }


@dataclass(frozen=True)
class PipelineModel:
    """Per-sample CPU demands of each stage, the measured ceilings, and the machine."""

    device: Literal["cpu", "cuda"]
    cpus: int
    fetch_s: float  # CPU seconds to fetch (read, decode, augment) one sample
    collate_worker_s: float  # per sample, collating in a worker (into shared memory)
    collate_inline_s: float  # per sample, collating in the training process
    main_worker_s: float  # per sample, the training process receiving from workers + copying
    main_inline_s: float  # per sample, copying when the training process made the batch
    ceilings: tuple[tuple[int, int, float], ...]  # (batch size, threads, samples/s)
    # measured / predicted, for settings without workers (one thread does everything in
    # turn: the sum of demands is close) and with them (overlap is never perfect).
    calibration_inline: float = 1.0
    calibration_workers: float = 1.0
    observations: int = 0
    # Ranks per trial ([training] ranks): the stages, the ceilings and ``cpus`` are one
    # rank's (its share of the node's CPUs); predictions are the node's, ``ranks`` times one
    # rank's (the ranks are alike; the all-reduce is in the calibration).
    ranks: int = 1

    # -- predictions -------------------------------------------------------------------

    def ceiling(self, batch_size: int, threads: int) -> tuple[float, bool]:
        """The consumer's samples/s at ``batch_size`` and ``threads``, and whether it was
        extrapolated (from the nearest measured batch size, then thread count)."""
        exact = [c for b, t, c in self.ceilings if b == batch_size and t == threads]
        if exact:
            return median(exact), False
        same_batch = [(t, c) for b, t, c in self.ceilings if b == batch_size]
        pool = same_batch or [(t, c) for _, t, c in self._nearest_batch(batch_size)]
        if not pool:
            raise ValueError("the model has no ceiling reading yet")
        t_near, c_near = min(pool, key=lambda tc: (abs(tc[0] - threads), -tc[1]))
        if self.device == "cuda" or t_near == threads:
            return c_near, True
        return c_near * (threads / t_near) ** THREAD_SCALING, True

    def _nearest_batch(self, batch_size: int) -> list[tuple[int, int, float]]:
        if not self.ceilings:
            return []
        distance = min(abs(math.log(b / batch_size)) for b, _, _ in self.ceilings)
        return [
            (b, t, c) for b, t, c in self.ceilings if abs(math.log(b / batch_size)) == distance
        ]

    def predict(self, params: LoaderParams) -> Prediction:
        """Throughput of ``params`` on this machine (calibrated) and its bottleneck."""
        threads = params.torch_threads
        if (
            self.device == "cpu"
            and params.num_workers
            and params.num_workers + threads > self.cpus
        ):
            # Intra-op threads that share cores with busy workers wait for each other at
            # every barrier: the step runs no faster than on one thread (while all of them
            # still spin; measured on 2 cores: 2 threads beside a worker halve throughput).
            threads = 1
        ceiling, extrapolated = self.ceiling(params.batch_size, threads)
        step_s = 1.0 / ceiling
        bounds: dict[str, float]
        if params.num_workers == 0:
            demands: dict[Bottleneck, float] = {
                "loader_workers": self.fetch_s + self.collate_inline_s,
                "device": step_s,
                "main_process": self.main_inline_s,
            }
            bounds = {stage: 1.0 / max(demand, 1e-12) for stage, demand in demands.items()}
            raw = 1.0 / sum(demands.values())
            bottleneck = _largest(demands)
        else:
            produce_s = self.fetch_s + self.collate_worker_s
            if self.device == "cpu":
                # The step runs on the training process's thread(s), after each receive.
                main_path = 1.0 / (self.main_worker_s + step_s)
                main_stage: Bottleneck = (
                    "device" if step_s >= self.main_worker_s else "main_process"
                )
                step_cpu_s = params.torch_threads * step_s
                bounds = {
                    "loader_workers": params.num_workers / produce_s,
                    main_stage: main_path,
                }
            else:
                bounds = {
                    "loader_workers": params.num_workers / produce_s,
                    "device": ceiling,
                    "main_process": 1.0 / self.main_worker_s,
                }
                step_cpu_s = 0.0  # the launches are part of the main process's measured cost
            demand = produce_s + self.main_worker_s + step_cpu_s
            cpu_bound = self.cpus / demand
            stage = min(bounds, key=lambda s: bounds[s])
            raw = min(bounds[stage], cpu_bound)
            bottleneck = next(b for b in BOTTLENECKS if b == stage)
            if cpu_bound < bounds[stage]:
                # All of it shares the CPUs: name the stage that demands the most of them.
                bottleneck = _largest(
                    {
                        "loader_workers": produce_s,
                        "main_process": self.main_worker_s,
                        "device": step_cpu_s,
                    }
                )
            bounds["cpus"] = cpu_bound
        if self.device == "cpu" and bottleneck == "device":
            bottleneck = "cpus"  # the step shares the CPUs with loading (see BOTTLENECKS)
        calibration = self.calibration_workers if params.num_workers else self.calibration_inline
        node = {stage: bound * self.ranks for stage, bound in bounds.items()}
        return Prediction(params, raw * calibration * self.ranks, bottleneck, node, extrapolated)

    def candidates(self, batch_size: int, space: ResolvedSpace) -> list[LoaderParams]:
        """The settings of ``batch_size`` the model tells apart: each worker count with its
        threads (the space's rule, or each searched count). Prefetch only smooths bursts in
        this steady-state model: the default of 2, within the space."""
        settings = []
        for workers in space.num_workers.values():
            for threads in _threads(space, workers):
                prefetch = None
                persistent = False
                if workers > 0:
                    prefetch = min(max(2, space.prefetch_factor.low), space.prefetch_factor.high)
                    # Workers that live across epochs never pay their start-up again.
                    persistent = space.persistent_workers is not False
                pin = (
                    bool(space.pin_memory)
                    if space.pin_memory is not None
                    else self.device == "cuda"
                )
                settings.append(
                    LoaderParams(batch_size, workers, prefetch, pin, persistent, threads)
                )
        return settings

    def best(self, batch_size: int, space: ResolvedSpace) -> Prediction:
        """The predicted fastest setting of ``batch_size``: its throughput is the pipeline
        limit of that batch size. Among near-ties (within 2%), the fewest workers."""
        predictions = [self.predict(p) for p in self.candidates(batch_size, space)]
        top = max(p.throughput for p in predictions)
        close = [p for p in predictions if p.throughput >= 0.98 * top]
        return min(close, key=lambda p: (p.params.num_workers, -p.throughput))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineModel:
        """The model `as_dict` stored (`ValueError` when it is not one)."""
        try:
            device = data["device"]
            if device not in ("cpu", "cuda"):
                raise ValueError(f"device {device!r}")
            return cls(
                device=device,
                cpus=int(data["cpus"]),
                fetch_s=float(data["fetch_cpu_s_per_sample"]),
                collate_worker_s=float(data["collate_cpu_s_per_sample"]["worker"]),
                collate_inline_s=float(data["collate_cpu_s_per_sample"]["inline"]),
                main_worker_s=float(data["main_cpu_s_per_sample"]["workers"]),
                main_inline_s=float(data["main_cpu_s_per_sample"]["inline"]),
                ceilings=tuple((int(b), int(t), float(c)) for b, t, c in data["ceilings"]),
                calibration_inline=float(data["calibration"]["inline"]),
                calibration_workers=float(data["calibration"]["workers"]),
                observations=int(data["observations"]),
                ranks=int(data.get("ranks", 1)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a stored pipeline model: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        """Stored with the study (`PIPELINE_ATTR`), for people and other tools."""
        return {
            "device": self.device,
            "cpus": self.cpus,
            "fetch_cpu_s_per_sample": self.fetch_s,
            "collate_cpu_s_per_sample": {
                "worker": self.collate_worker_s,
                "inline": self.collate_inline_s,
            },
            "main_cpu_s_per_sample": {"workers": self.main_worker_s, "inline": self.main_inline_s},
            "ceilings": [list(c) for c in self.ceilings],
            "calibration": {
                "inline": self.calibration_inline,
                "workers": self.calibration_workers,
            },
            "observations": self.observations,
            "ranks": self.ranks,
        }


def _or_scaled(value: float | None, other: float | None, factor: float) -> float:
    """``value`` when measured, else ``other`` scaled by ``factor`` (0 when neither is)."""
    return value if value is not None else (other or 0.0) * factor


def _largest(demands: dict[Bottleneck, float]) -> Bottleneck:
    return max(BOTTLENECKS, key=lambda stage: demands.get(stage, 0.0))


def _threads(space: ResolvedSpace, workers: int) -> list[int]:
    if space.torch_threads is None:
        return [default_torch_threads(workers, space.usable_cpus)]
    if isinstance(space.torch_threads, int):
        return [space.torch_threads]
    assert isinstance(space.torch_threads, IntRange)
    return space.torch_threads.values()


def fit(
    observations: Sequence[Observation],
    device: Literal["cpu", "cuda"],
    cpus: int,
    ranks: int = 1,
) -> PipelineModel | None:
    """The model of what ``observations`` measured, or None before there is enough (a trial
    with its stage costs and a ceiling reading). With ``ranks``, ``cpus`` is one rank's share
    and the observations' throughputs and ceilings are the node's (see `PipelineModel`)."""
    measured = [o for o in observations if o.has_costs]
    ceilings = tuple(
        (o.params.batch_size, o.params.torch_threads, o.ceiling / ranks)
        for o in observations
        if o.ceiling is not None and o.ceiling > 0
    )
    if not measured or not ceilings:
        return None
    inline = [o for o in measured if o.params.num_workers == 0]
    workers = [o for o in measured if o.params.num_workers > 0]

    def per_sample(rows: list[Observation], field: str) -> float | None:
        values = [getattr(o, field) / o.params.batch_size for o in rows]
        return median(values) if values else None

    fetch = median(float(o.producer_cpu_s_per_sample or 0.0) for o in measured)
    collate_inline = per_sample(inline, "collate_cpu_s_per_batch")
    collate_worker = per_sample(workers, "collate_cpu_s_per_batch")
    main_inline = per_sample(inline, "main_cpu_s_per_batch")
    main_worker = per_sample(workers, "main_cpu_s_per_batch")
    model = PipelineModel(
        device=device,
        cpus=cpus,
        fetch_s=fetch,
        collate_worker_s=_or_scaled(collate_worker, collate_inline, SHM_COLLATE),
        collate_inline_s=_or_scaled(collate_inline, collate_worker, 1 / SHM_COLLATE),
        main_worker_s=_or_scaled(main_worker, main_inline, QUEUE_RECEIVE),
        main_inline_s=_or_scaled(main_inline, main_worker, 1 / QUEUE_RECEIVE),
        ceilings=ceilings,
        observations=len(measured),
        ranks=ranks,
    )
    inline_ratios: list[float] = []
    worker_ratios: list[float] = []
    for o in measured:
        try:
            predicted = model.predict(o.params).throughput
        except ValueError:
            continue
        if predicted > 0:
            (worker_ratios if o.params.num_workers else inline_ratios).append(
                o.throughput / predicted
            )
    low, high = CALIBRATION_RANGE

    def calibrated(ratios: list[float], fallback: list[float]) -> float:
        chosen = ratios or fallback
        return min(max(median(chosen), low), high) if chosen else 1.0

    return replace(
        model,
        calibration_inline=calibrated(inline_ratios, worker_ratios),
        calibration_workers=calibrated(worker_ratios, inline_ratios),
    )
