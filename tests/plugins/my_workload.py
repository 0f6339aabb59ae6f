"""A user's own workload, as docs/workloads.md's plug-in example shows it (file form)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from loader_search import Workload


def build(n: int = 256, hidden: int = 16) -> Workload:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=generator)
    y = (x.sum(1) > 0).long()
    return Workload(
        name="my-workload",
        train_dataset=TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]),
        val_dataset=TensorDataset(x[n * 3 // 4 :], y[n * 3 // 4 :]),
        make_model=lambda: nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2)),
        base_lr=0.05,
    )


def not_a_workload() -> int:
    return 42


def broken() -> Workload:
    raise RuntimeError("the user's factory has a bug")
