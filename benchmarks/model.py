"""The pipeline model against the ground truth: how far its predictions are off, after the
baseline alone and after the model's first trials, and what fitting it costs.

The predictions are judged against every configuration of the table (its median throughput);
the model sees only what a study would have measured by then, trial by trial as the service
takes them (the replay of `benchmarks.replay`, with the model-guided default).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.ground_truth import Entry, Space
from benchmarks.replay import Truth, Variant, _Replay, resolved
from loader_search.params import TrainingSettings
from loader_search.study import SamplerConfig
from loader_search.study.search import Guide

DEFAULT = Variant("model + tpe (default)", SamplerConfig())
FIT_REPEATS = 50


def _errors(guide: Guide, trials: Sequence[Any], entries: Sequence[Entry]) -> list[float] | None:
    model = guide.model(trials)
    if model is None:
        return None
    return [abs(model.predict(e.params).throughput / e.throughput - 1) for e in entries]


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def prediction_error(
    entries: Sequence[Entry],
    table: Space,
    training: TrainingSettings,
    *,
    seeds: int,
    after: Sequence[int] = (1, 5, 10),
) -> dict[str, Any]:
    """Per number of trials run (``after``; 1 is the baseline alone): the median over seeds
    of the median and 90th percentile of |predicted / true - 1| over every configuration."""
    truth = Truth.of(entries)
    guide = Guide(resolved(table, threads_searched=False), "cpu", max(table.threads))
    result: dict[str, Any] = {}
    for n in after:
        medians, p90s = [], []
        for seed in range(seeds):
            replay = _Replay(truth, table, DEFAULT, seed, training)
            replay.run(n)
            errors = _errors(guide, replay.study.get_trials(deepcopy=False)[:n], entries)
            if errors is not None:
                medians.append(statistics.median(errors))
                p90s.append(_p90(errors))
        result[str(n)] = {
            "median_error": statistics.median(medians) if medians else None,
            "p90_error": statistics.median(p90s) if p90s else None,
            "seeds": len(medians),
        }
    return result


def fit_cost(entries: Sequence[Entry], table: Space, training: TrainingSettings) -> float:
    """Seconds to fit the model on a 20-trial study and find every batch size's best (what a
    worker does per trial, under the study lock): the median of `FIT_REPEATS` timings."""
    truth = Truth.of(entries)
    replay = _Replay(truth, table, DEFAULT, 0, training)
    replay.run(20)
    trials = replay.study.get_trials(deepcopy=False)
    guide = replay.guide
    assert guide is not None
    timings = []
    for _ in range(FIT_REPEATS):
        start = time.perf_counter()
        model = guide.model(trials)
        assert model is not None
        for batch in guide.space.batch_sizes:
            model.best(batch, guide.space)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)
