"""The pipeline model (`loader_search.study.search._pipeline`) on hand-made numbers whose answers
can be worked out by hand, a round trip through `fit`, and its cost per call."""

from __future__ import annotations

from typing import Any

import pytest

from loader_search.params import LoaderParams
from loader_search.study import CpuRange, IntRange, SearchSpace
from loader_search.study.search import (
    SNAPSHOT_FORMAT,
    BatchLimit,
    Lift,
    Observation,
    PipelineModel,
    PipelineSnapshot,
)
from loader_search.study.search._pipeline import fit

# Per-sample CPU demands in round numbers: fetching 100 us, collating 10 us in a worker and
# 2 us in place, receiving 10 us from a worker and copying 2 us in place.
MODEL = PipelineModel(
    device="cpu",
    cpus=4,
    fetch_s=100e-6,
    collate_worker_s=10e-6,
    collate_inline_s=2e-6,
    main_worker_s=10e-6,
    main_inline_s=2e-6,
    ceilings=((64, 1, 5_000.0), (64, 2, 8_000.0), (64, 3, 10_000.0), (64, 4, 12_000.0)),
)


def _params(workers: int, threads: int, batch: int = 64) -> LoaderParams:
    return LoaderParams(batch, workers, 2 if workers else None, False, workers > 0, threads)


def test_without_workers_the_stages_add_up() -> None:
    prediction = MODEL.predict(_params(0, 4))
    # 100 + 2 us to produce, 2 us to copy, 1/12000 s to train: one sample at a time.
    assert prediction.throughput == pytest.approx(1 / (104e-6 + 1 / 12_000))
    assert prediction.bottleneck == "loader_workers"  # 102 us of 187: the largest demand
    assert not prediction.extrapolated


def test_one_worker_is_the_bottleneck_and_more_of_them_lift_it() -> None:
    one = MODEL.predict(_params(1, 3))
    assert one.throughput == pytest.approx(1 / 110e-6)  # 9,091/s: one worker, 110 us/sample
    assert one.bottleneck == "loader_workers"
    two = MODEL.predict(_params(2, 2))
    # Two workers could pass 18,182/s; the step on 2 threads (10 us + 125 us) allows 7,407/s;
    # the 4 CPUs allow 4 / (110 + 10 + 2 * 125 us) = 10,811/s.
    assert two.throughput == pytest.approx(1 / (10e-6 + 1 / 8_000))
    assert two.bottleneck == "cpus"  # the step, on the CPUs the loading shares: no device
    assert two.bounds["cpus"] == pytest.approx(4 / (120e-6 + 2 / 8_000))


def test_the_cpus_bound_a_pipeline_that_asks_for_more_than_there_are() -> None:
    model = PipelineModel(**{**MODEL.__dict__, "cpus": 2})
    prediction = model.predict(_params(3, 4))
    # 3 workers and 4 threads on 2 CPUs: the threads share cores with the workers, so the
    # step runs at the 1-thread ceiling (200 us) while all 4 spin: 110 + 10 + 4 x 200 us of
    # CPU per sample.
    assert prediction.throughput == pytest.approx(2 / (120e-6 + 4 / 5_000))
    assert prediction.bottleneck == "cpus"  # the 4 threads' 800 us is the largest share


def test_threads_beside_busy_workers_train_no_faster_than_one() -> None:
    alone = MODEL.predict(_params(0, 4))  # no workers: the 4 threads have the 4 CPUs
    assert MODEL.ceiling(64, 4) == (12_000.0, False)
    crowded = MODEL.predict(_params(1, 4))  # 1 worker + 4 threads on 4 CPUs
    assert crowded.throughput == pytest.approx(
        min(1 / (10e-6 + 1 / 5_000), 4 / (120e-6 + 4 / 5_000))
    )
    fits = MODEL.predict(_params(1, 3))  # 1 worker + 3 threads: the 3-thread ceiling holds
    assert fits.bounds["device"] == pytest.approx(1 / (10e-6 + 1 / 10_000))
    assert alone.throughput > 0


def test_on_cuda_the_device_and_the_main_process_are_separate_stages() -> None:
    model = PipelineModel(**{**MODEL.__dict__, "device": "cuda", "cpus": 16})
    fast = model.predict(_params(15, 1))
    assert fast.throughput == pytest.approx(5_000.0)  # the device's ceiling at 1 thread
    assert fast.bottleneck == "device"
    decoding = PipelineModel(**{**model.__dict__, "fetch_s": 1e-3})  # 1 ms per sample
    slow = decoding.predict(_params(2, 1))
    assert slow.throughput == pytest.approx(2 / 1010e-6)  # 1,980/s: two workers' worth
    assert slow.bottleneck == "loader_workers"


def test_unmeasured_ceilings_are_extrapolated_and_say_so() -> None:
    ceiling, extrapolated = MODEL.ceiling(64, 8)
    assert extrapolated and ceiling == pytest.approx(12_000 * 2**0.6)
    ceiling, extrapolated = MODEL.ceiling(128, 2)  # nearest batch size, same threads
    assert extrapolated and ceiling == 8_000
    assert MODEL.ceiling(64, 2) == (8_000, False)


def test_the_best_setting_of_a_batch_size_is_the_pipeline_limit() -> None:
    space = SearchSpace(num_workers=CpuRange(0, 4)).resolve(4, cuda=False)
    best = MODEL.best(64, space)
    # 1 worker + 3 threads: min(9,091; 1/(10 us + 100 us) = 9,091; 4 / (120 + 300 us)).
    predictions = {p.num_workers: MODEL.predict(p).throughput for p in MODEL.candidates(64, space)}
    assert best.throughput == pytest.approx(max(predictions.values()))
    assert best.params.num_workers == min(
        w for w, x in predictions.items() if x >= 0.98 * best.throughput
    )
    assert best.params.torch_threads == 4 - best.params.num_workers
    assert best.params.prefetch_factor in (None, 2)


def test_fit_recovers_the_demands_it_was_given() -> None:
    observations = []
    for workers, threads in [(0, 4), (1, 3), (2, 2), (3, 1)]:
        params = _params(workers, threads)
        ceiling, _ = MODEL.ceiling(64, threads)
        collate = (MODEL.collate_worker_s if workers else MODEL.collate_inline_s) * 64
        main = (MODEL.main_worker_s if workers else MODEL.main_inline_s) * 64
        observations.append(
            Observation(
                params,
                MODEL.predict(params).throughput * 0.9,  # the real pipeline loses 10%
                ceiling,
                MODEL.fetch_s,
                collate,
                main,
            )
        )
    model = fit(observations, "cpu", 4)
    assert model is not None
    assert model.fetch_s == pytest.approx(MODEL.fetch_s)
    assert model.collate_worker_s == pytest.approx(MODEL.collate_worker_s)
    assert model.main_inline_s == pytest.approx(MODEL.main_inline_s)
    assert model.calibration_inline == pytest.approx(0.9)
    assert model.calibration_workers == pytest.approx(0.9)
    for observation in observations:
        assert model.predict(observation.params).throughput == pytest.approx(
            observation.throughput
        )


def test_fit_needs_costs_and_a_ceiling() -> None:
    params = _params(0, 4)
    assert fit([Observation(params, 1000.0)], "cpu", 4) is None
    assert fit([Observation(params, 1000.0, 2000.0)], "cpu", 4) is None
    only_inline = fit([Observation(params, 1000.0, 2000.0, 1e-4, 1e-4, 1e-4)], "cpu", 4)
    assert only_inline is not None  # the worker costs are guessed until a worker runs
    assert only_inline.collate_worker_s > only_inline.collate_inline_s


def test_a_long_study_fits_and_proposes_within_its_space() -> None:
    observations = [
        Observation(_params(w % 4, 1 + w % 3, 32 * 2 ** (w % 4)), 5000.0, 8000.0, 1e-4, 1e-3, 1e-3)
        for w in range(200)
    ]
    space = SearchSpace(
        batch_sizes=(32, 64, 128, 256), num_workers=CpuRange(0, 8), torch_threads=CpuRange(1, 8)
    ).resolve(8, cuda=False)
    assert isinstance(space.torch_threads, IntRange)
    model = fit(observations, "cpu", 8)
    assert model is not None and model.observations == 200
    for batch in space.batch_sizes:
        best = model.best(batch, space).params
        assert best.batch_size == batch
        assert 0 <= best.num_workers <= 8 and 1 <= best.torch_threads <= 8


def test_with_ranks_the_model_is_one_ranks_pipeline_on_its_share_times_the_ranks() -> None:
    # Two ranks on 8 CPUs: each rank is MODEL's pipeline on 4 of them, and the node measures
    # twice what one rank does (its throughput and its ceiling, as a 2-rank trial stores them).
    observations = []
    for workers, threads in [(0, 4), (1, 3), (2, 2), (3, 1)]:
        params = _params(workers, threads)
        ceiling, _ = MODEL.ceiling(64, threads)
        collate = (MODEL.collate_worker_s if workers else MODEL.collate_inline_s) * 64
        main = (MODEL.main_worker_s if workers else MODEL.main_inline_s) * 64
        one_rank = MODEL.predict(params).throughput
        observations.append(
            Observation(params, 2 * one_rank, 2 * ceiling, MODEL.fetch_s, collate, main)
        )
    node = fit(observations, "cpu", 4, ranks=2)
    assert node is not None and node.ranks == 2
    assert node.calibration_workers == pytest.approx(1.0)  # nothing left to explain
    for observation in observations:
        assert node.predict(observation.params).throughput == pytest.approx(observation.throughput)
        assert node.ceiling(64, observation.params.torch_threads)[0] == pytest.approx(
            observation.ceiling / 2
        )
    assert PipelineModel.from_dict(node.as_dict()) == node


# One batch size's entry of a pipeline snapshot exactly as studies have stored it since the
# model was introduced (keys and their order): the typed entry must read it and write it back
# unchanged, or stored studies would read differently and every worker would rewrite them.
STORED_ENTRY: dict[str, Any] = {
    "limit_samples_per_s": 9090.9,
    "limit_from": "model",
    "bottleneck": "loader_workers",
    "extrapolated": False,
    "limit_params": {
        "batch_size": 64,
        "num_workers": 1,
        "prefetch_factor": 2,
        "pin_memory": False,
        "persistent_workers": True,
        "torch_threads": 3,
    },
    "lifts": [
        {
            "lever": "more_cpus",
            "what": "twice the CPUs (8)",
            "predicted_limit_samples_per_s": 18181.8,
            "gain": 2.0,
        }
    ],
}


def test_a_stored_snapshot_entry_reads_and_writes_back_unchanged() -> None:
    entry = BatchLimit.from_dict(STORED_ENTRY)
    assert entry.lifts == (Lift("more_cpus", "twice the CPUs (8)", 18181.8, 2.0),)
    assert entry.limit_params == _params(1, 3)
    written = entry.as_dict()
    assert written == STORED_ENTRY
    assert list(written) == list(STORED_ENTRY)
    assert list(written["lifts"][0]) == list(STORED_ENTRY["lifts"][0])
    snapshot = PipelineSnapshot(MODEL, {64: entry}).as_dict()
    assert list(snapshot) == ["format", "model", "batch_sizes"]
    assert snapshot["format"] == SNAPSHOT_FORMAT == 1
    assert snapshot["batch_sizes"] == {"64": STORED_ENTRY}
    assert PipelineModel.from_dict(snapshot["model"]) == MODEL
    assert PipelineSnapshot.read(snapshot, 64) == (MODEL, entry)


def test_a_snapshot_stored_before_its_format_reads_and_a_newer_format_is_refused() -> None:
    # Snapshots stored before the "format" key have the layout of format 1.
    older = {"model": MODEL.as_dict(), "batch_sizes": {"64": STORED_ENTRY}}
    assert PipelineSnapshot.read(older, 64) == (MODEL, BatchLimit.from_dict(STORED_ENTRY))
    # One a newer loader-search wrote into a shared database is not misread.
    with pytest.raises(ValueError, match="format 2; this version reads 1"):
        PipelineSnapshot.read({**older, "format": 2}, 64)
    with pytest.raises(ValueError, match="not a stored pipeline snapshot"):
        PipelineSnapshot.read(["not", "a", "snapshot"], 64)


@pytest.mark.parametrize(
    "damage",
    [
        {"bottleneck": "the moon"},
        {"limit_from": "a hunch"},
        {"limit_samples_per_s": "fast"},
        {"limit_params": {"num_workers": 2}},
        {"lifts": [{"lever": "more_cpus"}]},
        {"lifts": 7},
    ],
)
def test_a_damaged_snapshot_entry_is_refused(damage: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        BatchLimit.from_dict({**STORED_ENTRY, **damage})
