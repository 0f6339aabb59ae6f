"""A plug-in workload that trains in milliseconds, for `benchmarks/scale.py`: its trials
cost the team's coordination (the database, the study lock) and little else.

``wait_ms`` makes every forward pass wait that long without using a CPU (as a GPU step
keeps its process waiting), so trials last seconds while the machine's CPUs stay free for
the workers' coordination: on a 2-core machine, 32 workers of millisecond trials would
measure how the CPUs are shared out, not the database.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from loader_search import Workload


class _Waiting(nn.Module):
    """A linear layer whose forward pass waits ``wait_s`` first."""

    def __init__(self, wait_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.wait_s = wait_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wait_s > 0:
            time.sleep(self.wait_s)
        out: torch.Tensor = self.linear(x)
        return out


def build(n: int = 96, wait_ms: float = 0.0) -> Workload:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    y = (x.sum(1) > 0).long()
    split = n * 2 // 3
    return Workload(
        name="fast",
        train_dataset=TensorDataset(x[:split], y[:split]),
        val_dataset=TensorDataset(x[split:], y[split:]),
        make_model=lambda: _Waiting(wait_ms / 1000.0),
        base_lr=0.05,
    )
