"""Small real datasets with known timing behaviour, for measurement tests."""

from __future__ import annotations

import functools
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from loader_search.workloads import Workload


class TimedDataset(Dataset[tuple[torch.Tensor, int]]):
    """``n`` random feature vectors; each access sleeps ``delay_s``, and the very first access
    in each process sleeps ``first_delay_s`` more (a slow start, like opening files)."""

    def __init__(self, n: int, delay_s: float = 0.0, first_delay_s: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=generator)
        self.y = (self.x[:, 0] > 0).long()
        self.delay_s = delay_s
        self.first_delay_s = first_delay_s
        self._started = False

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not self._started:
            self._started = True
            time.sleep(self.first_delay_s)
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[index], int(self.y[index])


def linear_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))


def timed_workload(n: int = 512, delay_s: float = 0.0, first_delay_s: float = 0.0) -> Workload:
    return Workload(
        name="timed",
        train_dataset=TimedDataset(n, delay_s, first_delay_s),
        val_dataset=TimedDataset(64),
        make_model=linear_model,
        base_lr=0.05,
    )


class SlowInWorkers(TimedDataset):
    """Fast in the main process, ``delay_s`` per item inside DataLoader workers."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(self.delay_s)
        return self.x[index], int(self.y[index])


def slow_in_workers(n: int = 256, delay_s: float = 0.005) -> Workload:
    """A plug-in workload whose trials with loader workers take long (for interrupt tests)."""
    return Workload(
        name="slow-in-workers",
        train_dataset=SlowInWorkers(n, delay_s),
        val_dataset=TimedDataset(64),
        make_model=linear_model,
        base_lr=0.05,
    )


def cap_address_space(headroom_bytes: int) -> None:
    """Let this process allocate at most ``headroom_bytes`` more than it holds now
    (``RLIMIT_AS``): a larger allocation then fails in torch's allocator for real."""
    import resource

    with open("/proc/self/statm") as statm:
        held = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (held + headroom_bytes, resource.RLIM_INFINITY))


class ActivationHungry(nn.Module):
    """A classifier whose wide hidden layer holds about ``width x 12`` bytes of activations and
    their gradients per sample, under a real memory limit: on its first forward pass (in the
    trial's process, never in the study's) it lets itself allocate ``headroom_mb`` more than
    it holds then (`cap_address_space`). A batch whose activations do not fit then fails in
    torch's CPU allocator, as a batch does on a device of that size."""

    def __init__(self, width: int, headroom_mb: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(16, width)
        self.out = nn.Linear(width, 2)
        self.headroom = headroom_mb * 2**20
        self.limited = headroom_mb <= 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.limited:
            cap_address_space(self.headroom)
            self.limited = True
        out: torch.Tensor = self.out(torch.relu(self.hidden(x)))
        return out


def activation_hungry(
    n: int = 1024, width: int = 2**15, headroom_mb: int = 0, val_n: int = 128
) -> Workload:
    """`TimedDataset` features through `ActivationHungry`; ``headroom_mb`` 0: no limit."""
    return Workload(
        name="activation-hungry",
        train_dataset=TimedDataset(n),
        val_dataset=TimedDataset(val_n),
        make_model=functools.partial(ActivationHungry, width, headroom_mb),
        base_lr=0.05,
    )


class RankFault(TimedDataset):
    """Fine in every rank but ``rank``, which, after ``after`` samples, does ``fault``:
    ``"raise"`` (a ValueError), ``"segfault"`` (SIGSEGV to itself) or ``"hang"`` (sleeps for
    an hour). Read with ``num_workers=0``, so the rank process itself is the one at fault."""

    def __init__(self, n: int, fault: str, rank: int = 1, after: int = 256) -> None:
        super().__init__(n)
        self.fault, self.rank, self.after, self.seen = fault, rank, after, 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import torch.distributed as dist

        self.seen += 1
        if dist.is_initialized() and dist.get_rank() == self.rank and self.seen > self.after:
            if self.fault == "raise":
                raise ValueError(f"planted fault in rank {self.rank}")
            if self.fault == "segfault":
                import os
                import signal

                os.kill(os.getpid(), signal.SIGSEGV)
            if self.fault == "hang":
                time.sleep(3600)
        return super().__getitem__(index)


def rank_fault(fault: str, n: int = 2048) -> Workload:
    """A workload one of whose ranks fails as ``fault`` says (see `RankFault`)."""
    return Workload(
        name=f"rank-{fault}",
        train_dataset=RankFault(n, fault),
        val_dataset=TimedDataset(64),
        make_model=linear_model,
        base_lr=0.05,
    )
