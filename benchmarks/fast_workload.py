"""A plug-in workload that trains in milliseconds, for `benchmarks/scale.py`: its trials
cost the team's coordination (the database, the study lock) and little else."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from loader_search import Workload


def build(n: int = 96) -> Workload:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    y = (x.sum(1) > 0).long()
    split = n * 2 // 3
    return Workload(
        name="fast",
        train_dataset=TensorDataset(x[:split], y[:split]),
        val_dataset=TensorDataset(x[split:], y[split:]),
        make_model=lambda: nn.Linear(4, 2),
        base_lr=0.05,
    )
