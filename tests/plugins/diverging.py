"""A plug-in workload one of whose batch sizes blows up while staying finite: trained with
batch 16, its validation loss is in the billions (as a real study once showed: 3,955,186,741
at batch 64 against 0.82 at 32 and 128). A stand-in for a learning rate that is too high for
one batch size, deterministic so the test knows which."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from loader_search import Workload

BLOWS_UP_AT = 16


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.trained_batch: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.trained_batch = x.shape[0] if self.trained_batch is None else self.trained_batch
            return self.net(x)
        scale = 1e9 if self.trained_batch == BLOWS_UP_AT else 1.0
        return self.net(x) * scale


def build(n: int = 512) -> Workload:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=generator)
    y = (x.sum(1) > 0).long()
    return Workload(
        name="diverging",
        train_dataset=TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]),
        val_dataset=TensorDataset(x[n * 3 // 4 :], y[n * 3 // 4 :]),
        make_model=_Model,
        base_lr=0.05,
    )
