from __future__ import annotations

import optuna
import pytest

from loader_search._system import usable_cpus
from loader_search.params import LoaderParams
from loader_search.study import CpuRange, IntRange, SearchSpace, default_torch_threads
from loader_search.study.search import power_of_two_steps


def _draw(space: SearchSpace, n: int, cpus: int, cuda: bool = False) -> list[LoaderParams]:
    resolved = space.resolve(usable_cpus=cpus, cuda=cuda)
    study = optuna.create_study(
        directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=1)
    )
    drawn = []
    for _ in range(n):
        trial = study.ask()
        params = resolved.suggest(trial)
        drawn.append(params)
        study.tell(trial, [1.0, 1.0])
    return drawn


def test_power_of_two_steps() -> None:
    assert power_of_two_steps(32, 256) == (32, 64, 128, 256)
    assert power_of_two_steps(48, 200) == (48, 96, 192)
    assert power_of_two_steps(64, 64) == (64,)


def test_prefetch_and_persistent_only_with_workers() -> None:
    drawn = _draw(SearchSpace(num_workers=CpuRange(0, 3)), 200, cpus=4)
    assert {p.num_workers for p in drawn} == {0, 1, 2, 3}
    for params in drawn:
        if params.num_workers == 0:
            assert params.prefetch_factor is None
            assert params.persistent_workers is False
        else:
            assert params.prefetch_factor is not None and 1 <= params.prefetch_factor <= 8


def test_prefetch_not_suggested_as_a_param_without_workers() -> None:
    resolved = SearchSpace().resolve(usable_cpus=2, cuda=False)
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.enqueue_trial({"num_workers": 0})
    trial = study.ask()
    resolved.suggest(trial)
    assert trial.params["num_workers"] == 0
    assert "prefetch_factor" not in trial.params
    assert "persistent_workers" not in trial.params


def test_workers_never_above_usable_cpus() -> None:
    space = SearchSpace(num_workers=CpuRange(0, 64))
    resolved = space.resolve(usable_cpus=2, cuda=False)
    assert resolved.num_workers == IntRange(0, 2)
    assert any("above the 2 CPU(s)" in note for note in resolved.notes)
    assert max(p.num_workers for p in _draw(space, 100, cpus=2)) == 2


def test_auto_workers_follow_usable_cpus() -> None:
    resolved = SearchSpace().resolve(usable_cpus=usable_cpus(), cuda=False)
    assert resolved.num_workers.high == usable_cpus()
    assert resolved.notes == ()


def test_pin_memory_searched_only_on_cuda() -> None:
    cpu = _draw(SearchSpace(), 30, cpus=2, cuda=False)
    assert all(p.pin_memory is False for p in cpu)
    cuda = _draw(SearchSpace(), 60, cpus=2, cuda=True)
    assert {p.pin_memory for p in cuda} == {False, True}
    notes = SearchSpace(pin_memory=True).resolve(2, cuda=False).notes
    assert any("pin_memory" in note for note in notes)


def test_threads_default_rule_and_search() -> None:
    assert default_torch_threads(0, 8) == 8
    assert default_torch_threads(3, 8) == 5
    assert default_torch_threads(8, 8) == 1
    for params in _draw(SearchSpace(), 50, cpus=4):
        assert params.torch_threads == max(1, 4 - params.num_workers)
    searched = _draw(SearchSpace(torch_threads=CpuRange(1, None)), 80, cpus=3)
    assert {p.torch_threads for p in searched} == {1, 2, 3}
    fixed = _draw(SearchSpace(torch_threads=2), 10, cpus=4)
    assert {p.torch_threads for p in fixed} == {2}


def test_baseline_is_the_plain_loader() -> None:
    resolved = SearchSpace(torch_threads=CpuRange(1, None)).resolve(usable_cpus=4, cuda=True)
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.enqueue_trial(resolved.baseline(64))
    params = resolved.suggest(study.ask())
    assert params == LoaderParams(batch_size=64, num_workers=0, torch_threads=4)


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_sizes": ()}, {"batch_sizes": (0, 32)}, {"prefetch_factor": IntRange(0, 2)}],
)
def test_invalid_spaces_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SearchSpace(**kwargs)


@pytest.mark.parametrize(
    "space",
    [
        SearchSpace(
            batch_sizes=(16, 32), num_workers=CpuRange(0, 2), prefetch_factor=IntRange(1, 3)
        ),
        SearchSpace(batch_sizes=(8,), num_workers=CpuRange(1, 2), persistent_workers=False),
        SearchSpace(batch_sizes=(8,), num_workers=CpuRange(0, 1), torch_threads=CpuRange(1, 2)),
    ],
)
def test_size_counts_every_distinct_setting(space: SearchSpace) -> None:
    resolved = space.resolve(usable_cpus=2, cuda=True)  # pin_memory searched too
    study = optuna.create_study(
        directions=["maximize", "minimize"], sampler=optuna.samplers.BruteForceSampler(seed=0)
    )
    study.optimize(lambda t: (resolved.suggest(t) and 1.0, 1.0), n_trials=1000)
    assert len(study.trials) == resolved.size()
