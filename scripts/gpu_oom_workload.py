"""A plug-in workload whose GPU memory grows with the batch size fast enough to run out on any
GPU: its forward pass builds a 4096 x 4096 outer product per sample (64 MiB in float32, twice
that with its gradient). Measured on an H200: batch 256 peaks at 48 GiB, 512 at 96 GiB, and
1024 does not fit in 140 GiB. scripts/gpu_check.sh uses it (scripts/gpu_oom.toml) to show real
CUDA out-of-memory handling.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from loader_search.workloads import Workload

WIDTH = 4096


class OuterProduct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(16, WIDTH)
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        outer = h.unsqueeze(2) * h.unsqueeze(1)  # (batch, WIDTH, WIDTH): the memory hog
        return self.head(outer.mean(dim=1))


def make(samples: int = 8192) -> Workload:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, 16, generator=generator)
    targets = torch.randint(0, 10, (samples,), generator=generator)
    return Workload(
        name="gpu-oom",
        train_dataset=TensorDataset(inputs, targets),
        val_dataset=TensorDataset(inputs[:1024], targets[:1024]),
        make_model=OuterProduct,
        base_lr=0.01,
        description="outer-product model: GPU memory grows 128 MiB per sample",
    )
