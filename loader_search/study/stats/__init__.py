"""The statistics: paired speedups with their intervals, the confirmation rounds that measure
the candidates against the baseline, and the recommendation drawn from a study's trials.
Pure functions of the trials given, so every worker of a team agrees.

Callers outside this folder import from ``loader_search.study.stats``. Names load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loader_search._faces import lazy

_EXPORTS = {
    # a paired speedup
    "PairedSpeedup": "loader_search.study.stats._paired",
    "paired_speedup": "loader_search.study.stats._paired",
    "chance_of_gain": "loader_search.study.stats._paired",
    "FASTER": "loader_search.study.stats._paired",
    "NO_RELIABLE_GAIN": "loader_search.study.stats._paired",
    "Verdict": "loader_search.study.stats._paired",
    # the confirmation rounds
    "ConfirmSettings": "loader_search.study.stats._confirm",
    "Rounds": "loader_search.study.stats._confirm",
    "Remeasure": "loader_search.study.stats._confirm",
    "next_remeasure": "loader_search.study.stats._confirm",
    "rounds_of": "loader_search.study.stats._confirm",
    "rounds_owner": "loader_search.study.stats._confirm",
    "paired_speedups": "loader_search.study.stats._confirm",
    "settled": "loader_search.study.stats._confirm",
    # the gradient noise scale and goodput
    "NoiseScale": "loader_search.study.stats._goodput",
    "pooled_noise_scale": "loader_search.study.stats._goodput",
    "pool_noise": "loader_search.study.stats._goodput",
    "critical_batch_text": "loader_search.study.stats._goodput",
    "goodput_scale": "loader_search.study.stats._confirm",
    # the recommendation
    "StudySummary": "loader_search.study.stats._recommend",
    "Recommendation": "loader_search.study.stats._recommend",
    "PipelineView": "loader_search.study.stats._recommend",
    "recommend": "loader_search.study.stats._recommend",
    "summarize": "loader_search.study.stats._recommend",
    "summaries": "loader_search.study.stats._recommend",
    "summarize_trials": "loader_search.study.stats._recommend",
    "hardware_classes": "loader_search.study.stats._recommend",
    "hypervolume_2d": "loader_search.study.stats._hypervolume",
    "NOT_CONFIRMED": "loader_search.study.stats._recommend",
    "VERDICTS": "loader_search.study.stats._recommend",
}

__all__ = [
    "FASTER",
    "NOT_CONFIRMED",
    "NO_RELIABLE_GAIN",
    "VERDICTS",
    "ConfirmSettings",
    "NoiseScale",
    "PairedSpeedup",
    "PipelineView",
    "Recommendation",
    "Remeasure",
    "Rounds",
    "StudySummary",
    "Verdict",
    "chance_of_gain",
    "critical_batch_text",
    "goodput_scale",
    "hardware_classes",
    "hypervolume_2d",
    "next_remeasure",
    "paired_speedup",
    "paired_speedups",
    "pool_noise",
    "pooled_noise_scale",
    "recommend",
    "rounds_of",
    "rounds_owner",
    "settled",
    "summaries",
    "summarize",
    "summarize_trials",
]

if TYPE_CHECKING:
    from loader_search.study.stats._confirm import (
        ConfirmSettings,
        Remeasure,
        Rounds,
        goodput_scale,
        next_remeasure,
        paired_speedups,
        rounds_of,
        rounds_owner,
        settled,
    )
    from loader_search.study.stats._goodput import (
        NoiseScale,
        critical_batch_text,
        pool_noise,
        pooled_noise_scale,
    )
    from loader_search.study.stats._hypervolume import hypervolume_2d
    from loader_search.study.stats._paired import (
        FASTER,
        NO_RELIABLE_GAIN,
        PairedSpeedup,
        Verdict,
        chance_of_gain,
        paired_speedup,
    )
    from loader_search.study.stats._recommend import (
        NOT_CONFIRMED,
        VERDICTS,
        PipelineView,
        Recommendation,
        StudySummary,
        hardware_classes,
        recommend,
        summaries,
        summarize,
        summarize_trials,
    )


__getattr__ = lazy(__name__, _EXPORTS)
