"""Out-of-order delivery, the workers' start method and the thread backend as searchable
settings: real DataLoaders and thread pools, real studies."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import optuna
import psutil
import pytest
import torch

from loader_search import run_study
from loader_search._snippets import dataloader_snippet
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.study import stored_params
from loader_search.study.config import parse_config
from loader_search.trial import TrialJob, build_loader, run_isolated
from loader_search.trial._loader import ThreadLoader
from loader_search.workloads.synthetic_images import synthetic_images

SETTINGS = TrainingSettings(train_samples=512, batch_size=16, warmup_batches=1, eval_batch_size=64)


def _batches(params: LoaderParams, dataset: torch.utils.data.Dataset) -> list[list[int]]:
    loader = build_loader(dataset, params, shuffle=True, seed=3)
    batches = [batch[1].tolist() for batch in loader]
    del loader
    # The loader's worker processes are this process's children: none may outlive the test
    # (tests/test_isolation.py counts leftovers).
    _, alive = psutil.wait_procs(psutil.Process().children(), timeout=10)
    assert not [p for p in alive if p.name() == "pt_data_worker"]
    return batches


class Indexed(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Each sample carries its own index, so a batch shows which samples it holds."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(2), index


def test_every_backend_and_order_delivers_the_same_samples() -> None:
    dataset = Indexed()
    reference = _batches(LoaderParams(batch_size=8), dataset)
    assert sorted(itertools.chain(*reference)) == list(range(100))
    thread = LoaderParams(batch_size=8, num_workers=3, prefetch_factor=2, backend="thread")
    assert isinstance(build_loader(dataset, thread, shuffle=True), ThreadLoader)
    assert _batches(thread, dataset) == reference  # in order: the very same batches
    for params in (
        LoaderParams(batch_size=8, num_workers=2, prefetch_factor=2, in_order=False),
        LoaderParams(
            batch_size=8, num_workers=3, prefetch_factor=2, in_order=False, backend="thread"
        ),
    ):
        batches = _batches(params, dataset)
        # Out of order: the same samples, each once; the batches themselves may differ.
        assert collections.Counter(itertools.chain(*batches)) == collections.Counter(range(100))


def test_trials_of_every_backend_train_the_same_model() -> None:
    workload = synthetic_images(image_size=16, train_size=256, val_size=64)
    losses = {}
    for params in (
        LoaderParams(16),
        LoaderParams(16, 2, 2, backend="thread"),
        LoaderParams(16, 1, 2, start_method="forkserver"),
    ):
        # Isolated, as a study runs it: the forkserver's server process ends with the trial
        # (in this process it would outlive the test).
        result = run_isolated(TrialJob(workload, params, SETTINGS)).result
        assert result is not None and result.throughput_samples_per_s > 0
        losses[params.describe()] = result.val_loss
    assert len(set(losses.values())) == 1, losses  # in order: the same samples, same model
    out_of_order = run_isolated(
        TrialJob(workload, LoaderParams(16, 2, 2, in_order=False), SETTINGS)
    ).result
    assert out_of_order is not None
    assert out_of_order.val_loss == pytest.approx(losses["batch=16 workers=0 threads=1"], rel=0.1)


def test_params_and_snippets() -> None:
    params = LoaderParams(64, 2, 2, in_order=False, start_method="spawn")
    assert params.loader_kwargs()["in_order"] is False
    assert params.loader_kwargs()["multiprocessing_context"] == "spawn"
    assert "in_order" not in LoaderParams(64, 2, 2).loader_kwargs()  # torch < 2.6 has none
    assert params.describe() == "batch=64 workers=2 prefetch=2 out-of-order spawn threads=1"
    assert LoaderParams.from_dict(params.as_dict()) == params
    assert set(LoaderParams(64, 2, 2).as_dict()) == {
        "batch_size",
        "num_workers",
        "prefetch_factor",
        "pin_memory",
        "persistent_workers",
        "torch_threads",
    }  # stored as before these settings existed
    snippet = dataloader_snippet(params)
    assert "in_order=False," in snippet and 'multiprocessing_context="spawn",' in snippet
    thread = dataloader_snippet(LoaderParams(64, 4, 3, backend="thread"))
    assert "ParallelMapper(node, train_dataset.__getitem__, num_workers=4" in thread
    assert (
        "Batcher(node, batch_size=64" in thread and "Prefetcher(node, prefetch_factor=3)" in thread
    )
    assert "DataLoader(" not in thread
    for bad, message in [
        (dict(num_workers=0, in_order=False), "only valid with num_workers > 0"),
        (dict(num_workers=0, backend="thread"), "needs num_workers > 0"),
        (
            dict(num_workers=2, prefetch_factor=2, backend="thread", persistent_workers=True),
            "worker processes",
        ),
        (dict(num_workers=2, prefetch_factor=2, start_method="vfork"), "start_method must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            LoaderParams(batch_size=8, **bad)  # type: ignore[arg-type]


def test_the_space_keys_and_their_bad_values() -> None:
    space = parse_config({}).space
    assert (space.in_order, space.start_method, space.backend) == (True, (), ("process",))
    assert "in_order" not in space.as_dict()  # the fingerprint of older studies holds
    space = parse_config(
        {"space": {"in_order": "search", "start_method": "search", "backend": "search"}}
    ).space
    assert space.in_order is None
    assert space.start_method == ("fork", "forkserver", "spawn")
    assert space.backend == ("process", "thread")
    space = parse_config({"space": {"start_method": ["spawn", "fork"], "backend": "thread"}}).space
    assert (space.start_method, space.backend) == (("spawn", "fork"), ("thread",))
    for key, value, message in [
        ("in_order", "maybe", 'space.in_order = "maybe": use true, false or "search"'),
        ("start_method", "vfork", 'space.start_method = "vfork": use one of "fork"'),
        ("backend", ["process", "gpu"], "space.backend"),
    ]:
        with pytest.raises(Exception, match=message):
            parse_config({"space": {key: value}})


def test_the_grid_covers_every_combination_once(tmp_path: Path) -> None:
    space = parse_config(
        {
            "training": {"batch_size": 16},
            "space": {
                "batch_size": [16],
                "num_workers": {"min": 0, "max": 1},
                "prefetch_factor": {"min": 2, "max": 2},
                "persistent_workers": False,
                "in_order": "search",
                "start_method": ["fork", "forkserver"],
                "backend": "search",
                "torch_threads": 1,
            },
        }
    ).space.resolve(usable_cpus=2, cuda=False)
    # 0 workers: 1; process: 2 orders x 2 start methods; thread: 2 orders.
    assert space.size() == 1 + 4 + 2
    study = optuna.create_study(
        sampler=optuna.samplers.BruteForceSampler(seed=0), directions=["maximize"]
    )
    seen: list[LoaderParams] = []

    def objective(trial: optuna.Trial) -> float:
        seen.append(space.suggest(trial))
        assert space.trial_params(seen[-1]) == trial.params
        return 0.0

    study.optimize(objective, n_trials=space.size() + 3)  # the sampler stops when done
    assert len(seen) == space.size() == len(set(seen))


def test_a_study_searches_backend_and_order(tmp_path: Path) -> None:
    config = parse_config(
        {
            "study": {"name": "backends", "trials": 4, "confirm_top": 0},
            "sampler": {"name": "random"},
            "workload": {
                "name": "synthetic-images",
                "options": {"image_size": 16, "train_size": 256, "val_size": 64},
            },
            "training": {"train_samples": 512, "batch_size": 16, "eval_batch_size": 64},
            "space": {
                "batch_size": [16],
                "num_workers": {"min": 1, "max": 2},
                "prefetch_factor": {"min": 1, "max": 2},
                "in_order": "search",
                "backend": "search",
                "torch_threads": 1,
            },
        }
    )
    storage = f"sqlite:///{tmp_path / 'b.db'}"
    run_study(config, storage=storage, quiet=True)
    study = optuna.load_study(study_name="backends", storage=storage)
    searched = [stored_params(t) for t in study.trials if not t.user_attrs.get("baseline")]
    assert len(searched) == 3 and all(p is not None for p in searched)
    for trial in study.trials:
        assert trial.state == optuna.trial.TrialState.COMPLETE, trial.user_attrs
        params = stored_params(trial)
        assert (params is not None and params.num_workers == 0) or "backend" in trial.params


def test_slow_samples_cost_more_and_decode_to_the_same_size() -> None:
    plain = synthetic_images(image_size=16, train_size=200, val_size=32)
    varied = synthetic_images(image_size=16, train_size=200, val_size=32, slow_fraction=0.1)
    sizes = [len(b) for b in varied.train_dataset.images]
    larger = [
        i
        for i, b in enumerate(varied.train_dataset.images)
        if len(b) > 4 * len(plain.train_dataset.images[i])
    ]
    assert 10 <= len(larger) <= 30  # about 10% of 200, stored 4x larger each way
    assert all(varied.train_dataset[i][0].shape == (3, 16, 16) for i in larger[:3])
    others = [i for i in range(200) if i not in larger]
    assert all(varied.train_dataset.images[i] == plain.train_dataset.images[i] for i in others)
    assert varied.options["slow_fraction"] == 0.1 and "slow_fraction" not in plain.options
    assert max(sizes) > 4 * min(sizes)
