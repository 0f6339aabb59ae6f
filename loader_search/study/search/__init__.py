"""The search model: the search space and its rules (`SearchSpace`, bound to this machine as a
`ResolvedSpace`), fitting it to /dev/shm, the pipeline model of what any setting would reach,
and the model-guided proposals (`Guide`) queued before the sampler takes over.

Callers outside this folder import from ``loader_search.study.search``. Names load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loader_search._faces import lazy

_EXPORTS = {
    # the search space
    "SearchSpace": "loader_search.study.search._space",
    "ResolvedSpace": "loader_search.study.search._space",
    "IntRange": "loader_search.study.search._space",
    "CpuRange": "loader_search.study.search._space",
    "power_of_two_steps": "loader_search.study.search._space",
    "default_torch_threads": "loader_search.study.search._space",
    "torch_version": "loader_search.study.search._space",
    # fitting it to this machine's shared memory
    "SHM_FIX": "loader_search.study.search._fit",
    "fit_space": "loader_search.study.search._fit",
    "sample_bytes": "loader_search.study.search._fit",
    "shm_footprint_bytes": "loader_search.study.search._fit",
    "largest_footprint": "loader_search.study.search._fit",
    "size_text": "loader_search.study.search._fit",
    # the pipeline model
    "PipelineModel": "loader_search.study.search._pipeline",
    "PipelineSnapshot": "loader_search.study.search._pipeline",
    "Observation": "loader_search.study.search._pipeline",
    "Prediction": "loader_search.study.search._pipeline",
    "Lift": "loader_search.study.search._pipeline",
    "BatchLimit": "loader_search.study.search._pipeline",
    "Bottleneck": "loader_search.study.search._pipeline",
    "BOTTLENECKS": "loader_search.study.search._pipeline",
    "LimitSource": "loader_search.study.search._pipeline",
    "SNAPSHOT_FORMAT": "loader_search.study.search._pipeline",
    # what the model asks to measure
    "Guide": "loader_search.study.search._guide",
    "Proposal": "loader_search.study.search._guide",
}

__all__ = [
    "BOTTLENECKS",
    "SHM_FIX",
    "SNAPSHOT_FORMAT",
    "BatchLimit",
    "Bottleneck",
    "CpuRange",
    "Guide",
    "IntRange",
    "Lift",
    "LimitSource",
    "Observation",
    "PipelineModel",
    "PipelineSnapshot",
    "Prediction",
    "Proposal",
    "ResolvedSpace",
    "SearchSpace",
    "default_torch_threads",
    "fit_space",
    "largest_footprint",
    "power_of_two_steps",
    "sample_bytes",
    "shm_footprint_bytes",
    "size_text",
    "torch_version",
]

if TYPE_CHECKING:
    from loader_search.study.search._fit import (
        SHM_FIX,
        fit_space,
        largest_footprint,
        sample_bytes,
        shm_footprint_bytes,
        size_text,
    )
    from loader_search.study.search._guide import Guide, Proposal
    from loader_search.study.search._pipeline import (
        BOTTLENECKS,
        SNAPSHOT_FORMAT,
        BatchLimit,
        Bottleneck,
        Lift,
        LimitSource,
        Observation,
        PipelineModel,
        PipelineSnapshot,
        Prediction,
    )
    from loader_search.study.search._space import (
        CpuRange,
        IntRange,
        ResolvedSpace,
        SearchSpace,
        default_torch_threads,
        power_of_two_steps,
        torch_version,
    )


__getattr__ = lazy(__name__, _EXPORTS)
