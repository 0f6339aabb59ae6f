from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from loader_search._snippets import dataloader_snippet
from loader_search.params import LoaderParams
from loader_search.trial import build_loader


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"batch_size": 8, "num_workers": -1},
        {"batch_size": 8, "num_workers": 0, "prefetch_factor": 2},
        {"batch_size": 8, "num_workers": 0, "persistent_workers": True},
        {"batch_size": 8, "num_workers": 2, "prefetch_factor": None},
        {"batch_size": 8, "num_workers": 2, "prefetch_factor": 0},
        {"batch_size": 8, "torch_threads": 0},
    ],
)
def test_params_refuse_what_pytorch_refuses(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LoaderParams(**kwargs)


def test_loader_kwargs_match_pytorch_rules() -> None:
    assert "prefetch_factor" not in LoaderParams(8).loader_kwargs()
    kwargs = LoaderParams(8, 2, 4, persistent_workers=True).loader_kwargs()
    assert kwargs == {
        "batch_size": 8,
        "num_workers": 2,
        "pin_memory": False,
        "prefetch_factor": 4,
        "persistent_workers": True,
    }


def test_shuffle_order_does_not_depend_on_loader_settings() -> None:
    dataset = TensorDataset(torch.arange(64))
    orders = []
    for params in (LoaderParams(8), LoaderParams(8, 2, 2, persistent_workers=True)):
        loader = build_loader(dataset, params, shuffle=True, seed=3)
        orders.append([torch.cat([b[0] for b in loader]).tolist() for _ in range(2)])
    assert orders[0] == orders[1]
    assert orders[0][0] != orders[0][1]  # a new order each epoch
    assert sorted(orders[0][0]) == list(range(64))


def test_snippet_is_runnable_python() -> None:
    params = LoaderParams(16, 1, 3, persistent_workers=True, torch_threads=1)
    snippet = dataloader_snippet(params, lr=0.014142)
    assert snippet.startswith("# train with lr=0.01414 at this batch size")
    namespace = {
        "torch": torch,
        "DataLoader": DataLoader,
        "train_dataset": TensorDataset(torch.arange(40)),
    }
    previous = torch.get_num_threads()
    try:
        exec(snippet, namespace)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
    loader = namespace["loader"]
    assert isinstance(loader, DataLoader)
    assert (loader.batch_size, loader.num_workers, loader.prefetch_factor) == (16, 1, 3)
    assert loader.persistent_workers is True
    assert sum(len(b[0]) for b in loader) == 40
