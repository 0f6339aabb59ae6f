"""An ordinary training script that takes its loader settings as flags: what `loader-search`
tunes without a change (`examples/flags.toml`).

It trains a small CNN on the quickstart's data (generated PNG images, decoded and augmented per
sample), for ``--max-samples`` training samples, with a validation pass after every epoch. It
prints its validation loss, and tells it to a loader-search trial with
``loader_search.report`` (which does nothing outside a trial). Run it alone:

    python examples/train.py --batch-size 64 --workers 1 --prefetch 4
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import loader_search
from loader_search.workloads import load_workload


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--prefetch", type=int, default=2, help="ignored without workers")
    parser.add_argument("--persistent", type=int, default=0, help="1: persistent workers")
    parser.add_argument("--pin-memory", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--max-samples", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def data_and_model(seed: int) -> tuple[Dataset, Dataset, torch.nn.Module]:
    """The quickstart's data and model (any script builds its own however it likes)."""
    built = load_workload("synthetic-images", {"train_size": 4096, "val_size": 1024, "seed": 0})
    torch.manual_seed(seed)
    return built.train_dataset, built.val_dataset, built.make_model()


def fit(
    model: torch.nn.Module,
    train_loader: DataLoader,
    val_loader: DataLoader,
    lr: float,
    max_samples: int,
) -> float:
    """SGD with momentum for ``max_samples`` samples, validating after every epoch; the last
    validation loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    epochs = math.ceil(max_samples / len(train_loader.dataset))
    seen, val_loss = 0, math.nan
    for epoch in range(epochs):
        model.train()
        for images, labels in train_loader:
            if seen >= max_samples:
                break
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            seen += len(labels)
        val_loss = validate(model, val_loader)
        print(f"epoch {epoch}: {seen} samples, val_loss={val_loss:.4f}", flush=True)
        loader_search.report(val_loss=val_loss)
    return val_loss


def validate(model: torch.nn.Module, loader: DataLoader) -> float:
    """The mean validation loss (on the model's device)."""
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images.to(device))
            total += torch.nn.functional.cross_entropy(
                logits, labels.to(device), reduction="sum"
            ).item()
            count += len(labels)
    return total / count


def training_loader(
    train_set: Dataset, args: argparse.Namespace, sampler: Sampler | None = None
) -> DataLoader:
    """The training loader the flags describe (shuffled, unless a ``sampler`` orders it)."""
    workers = args.workers > 0
    return DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        prefetch_factor=args.prefetch if workers else None,
        persistent_workers=bool(args.persistent) and workers,
        pin_memory=bool(args.pin_memory),
    )


def main() -> None:
    args = parse_args()
    train_set, val_set, model = data_and_model(args.seed)
    train_loader = training_loader(train_set, args)
    val_loader = DataLoader(val_set, batch_size=256)
    fit(model, train_loader, val_loader, args.lr, args.max_samples)


if __name__ == "__main__":
    main()
