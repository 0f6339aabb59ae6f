"""The same training on several ranks with DistributedDataParallel, launched by torchrun: what
`loader-search` tunes per rank, the node's throughput bounded by its slowest rank
(`examples/torchrun.toml`). Every rank builds its loader over its share of the data
(`DistributedSampler`); rank 0 validates and reports.

    torchrun --nproc-per-node 2 examples/train_ddp.py --batch-size 64 --workers 0
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from train import data_and_model, parse_args, training_loader, validate  # examples/train.py

import loader_search

if __name__ == "__main__":
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(
        f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu"
    )
    train_set, val_set, model = data_and_model(args.seed)
    model = model.to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = training_loader(train_set, args, sampler)
    val_loader = DataLoader(val_set, batch_size=256)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    share = math.ceil(args.max_samples / dist.get_world_size())
    seen = 0
    for epoch in range(math.ceil(share / len(sampler))):
        sampler.set_epoch(epoch)
        ddp.train()
        for images, labels in train_loader:
            if seen >= share:
                break
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(ddp(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            seen += len(labels)
        if rank == 0:
            val_loss = validate(model, val_loader)
            print(f"epoch {epoch}: {seen} samples on rank 0, val_loss={val_loss:.4f}", flush=True)
            loader_search.report(val_loss=val_loss)
        dist.barrier()
    dist.destroy_process_group()
