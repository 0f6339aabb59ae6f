"""``digits``: real handwritten digits bundled with scikit-learn (1,797 8x8 images, no download).

Samples are held as uint8 tensors and augmented per access (random one-pixel shift and pixel
noise). Loading is cheap next to the model, so this workload is compute-bound: a useful contrast
to ``synthetic-images``, where decoding dominates.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from loader_search._rules import Range, check_options
from loader_search.workloads._base import Workload


class DigitsDataset(Dataset[tuple[torch.Tensor, int]]):
    """Digits with a per-index augmentation (see `EncodedImageDataset` for why per index)."""

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, augment: bool, seed: int = 0
    ) -> None:
        self.images = images  # (n, 8, 8) uint8, 0..16
        self.labels = labels
        self.augment = augment
        self.seed = seed

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.images[index].float().div_(16.0).unsqueeze(0)
        if self.augment:
            rng = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            x = nn.functional.pad(x, [1, 1, 1, 1])
            top, left = torch.randint(0, 3, (2,), generator=rng).tolist()
            x = x[:, top : top + 8, left : left + 8] + 0.05 * torch.randn(1, 8, 8, generator=rng)
        return (x - 0.3) / 0.4, int(self.labels[index])


class DigitsNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(width * 16, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.body(x)
        return logits


OPTION_RULES = {
    "val_fraction": Range(0, 1, integer=False, low_open=True),
    "width": Range(1, 4096),
    "seed": Range(0, 2**32 - 1),
}


def digits(val_fraction: float = 0.2, width: int = 32, seed: int = 0) -> Workload:
    """Build the ``digits`` workload from scikit-learn's bundled data."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            "the 'digits' workload needs scikit-learn: pip install 'loader-search[digits]'"
        ) from None
    check_options(locals(), OPTION_RULES)
    if val_fraction >= 1:
        raise ValueError(f"val_fraction = {val_fraction!r}: must be below 1")

    data = load_digits()
    images = torch.from_numpy(data.images.astype(np.uint8))
    labels = torch.from_numpy(data.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(labels)))
    n_val = max(1, round(len(labels) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return Workload(
        name="digits",
        train_dataset=DigitsDataset(images[train], labels[train], augment=True, seed=seed),
        val_dataset=DigitsDataset(images[val], labels[val], augment=False),
        make_model=functools.partial(DigitsNet, width),
        base_lr=0.05,
        description=f"scikit-learn digits: {len(train)} train / {n_val} val 8x8 images; small CNN",
        options={"val_fraction": val_fraction, "width": width, "seed": seed},
    )
