"""The same training over a stream: an ``IterableDataset`` that splits its shards among the
loader's workers with ``get_worker_info()``, as WebDataset does, so that more workers share the
stream rather than each repeating it. `loader-search` tunes its loader like any other
(`examples/iterable.toml`): a loader over an ``IterableDataset`` cannot shuffle, so the script
builds its training loader first, and the trial takes the first loader built (docs/scripts.md).

    python examples/train_iterable.py --batch-size 64 --workers 2
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from train import data_and_model, fit, parse_args  # examples/train.py


class ShardedStream(IterableDataset):
    """The samples of ``dataset`` in shards of ``shard_size`` (the files of a real stream).
    Each loader worker reads every n-th shard, in an order of its own every epoch."""

    def __init__(self, dataset: Dataset, shard_size: int = 256) -> None:
        self.dataset = dataset
        size = len(dataset)
        self.shards = [range(i, min(i + shard_size, size)) for i in range(0, size, shard_size)]

    def __len__(self) -> int:  # the samples of one epoch, all workers together
        return sum(len(shard) for shard in self.shards)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        worker = get_worker_info()
        mine = self.shards if worker is None else self.shards[worker.id :: worker.num_workers]
        for shard in torch.randperm(len(mine)).tolist():
            for index in torch.randperm(len(mine[shard])).tolist():
                yield self.dataset[mine[shard][index]]


def main() -> None:
    args = parse_args()
    train_set, val_set, model = data_and_model(args.seed)
    workers = args.workers > 0
    train_loader = DataLoader(
        ShardedStream(train_set),
        batch_size=args.batch_size,
        num_workers=args.workers,
        prefetch_factor=args.prefetch if workers else None,
        persistent_workers=bool(args.persistent) and workers,
        pin_memory=bool(args.pin_memory),
    )
    val_loader = DataLoader(val_set, batch_size=256)
    fit(model, train_loader, val_loader, args.lr, args.max_samples)


if __name__ == "__main__":
    main()
