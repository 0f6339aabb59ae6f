"""Workloads that fail on purpose, one per way a trial can end badly.

Each is a plug-in factory (``tests._faults:hang`` works as a workload spec) built on the small
real dataset of `tests._datasets`: the failures are real (a real signal, a real allocation, a
real sleep), only their cause is staged. Faults marked "in a worker" fire only inside a
DataLoader worker process, so the main training process sees what a real one would.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import get_worker_info

from loader_search.workloads import Workload
from tests._datasets import TimedDataset, linear_model

N = 256


class FaultyDataset(TimedDataset):
    """`TimedDataset` whose ``__getitem__`` first calls ``fault(index)``; with
    ``in_worker_only`` the fault fires only inside DataLoader workers."""

    def __init__(self, fault: Callable[[int], None], in_worker_only: bool = False) -> None:
        super().__init__(N)
        self.fault = fault
        self.in_worker_only = in_worker_only

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not self.in_worker_only or get_worker_info() is not None:
            self.fault(index)
        return super().__getitem__(index)


class FaultyModel(nn.Module):
    """The linear model, with ``fault()`` called in every forward pass."""

    def __init__(self, fault: Callable[[], None]) -> None:
        super().__init__()
        self.inner = linear_model()
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fault()
        out: torch.Tensor = self.inner(x)
        return out


def _workload(
    name: str,
    dataset: TimedDataset | None = None,
    model_fault: Callable[[], None] | None = None,
    **kwargs: object,
) -> Workload:
    make_model: Callable[[], nn.Module] = linear_model
    if model_fault is not None:
        fault = model_fault

        def make_model() -> nn.Module:
            return FaultyModel(fault)

    return Workload(
        name=name,
        train_dataset=dataset if dataset is not None else TimedDataset(N),
        val_dataset=TimedDataset(64),
        make_model=make_model,
        base_lr=0.05,
        **kwargs,  # type: ignore[arg-type]
    )


def good() -> Workload:
    """Trains normally, in a second or so."""
    return _workload("good")


_HOARD: list[torch.Tensor] = []


def _allocate(chunk_mb: int) -> Callable[[int], None]:
    def fault(index: int) -> None:
        # torch.ones writes every page: resident memory, not just reserved address space.
        _HOARD.append(torch.ones(chunk_mb * 2**20 // 4))
        time.sleep(0.005)  # ~1.6 GB/s at most: the parent's memory poll keeps up

    return fault


def memory_hog(chunk_mb: int = 8) -> Workload:
    """Keeps ``chunk_mb`` MiB per sample forever (a leak): passes any memory limit."""
    return _workload("memory-hog", FaultyDataset(_allocate(chunk_mb)))


def _signal_self(number: int) -> Callable[[int], None]:
    def fault(index: int) -> None:
        os.kill(os.getpid(), number)

    return fault


def worker_segfault() -> Workload:
    """A loader worker dies of SIGSEGV (a crashing native decoder, say). In a worker."""
    return _workload(
        "worker-segfault", FaultyDataset(_signal_self(signal.SIGSEGV), in_worker_only=True)
    )


def worker_sigbus() -> Workload:
    """A loader worker dies of SIGBUS, as one writing a batch into a full /dev/shm does."""
    return _workload(
        "worker-sigbus", FaultyDataset(_signal_self(signal.SIGBUS), in_worker_only=True)
    )


def worker_sigkill() -> Workload:
    """A loader worker is SIGKILLed, as by the kernel's out-of-memory killer. In a worker."""
    return _workload(
        "worker-sigkill", FaultyDataset(_signal_self(signal.SIGKILL), in_worker_only=True)
    )


def _sleep_forever(index: int) -> None:
    time.sleep(3600)


def hang(in_worker_only: bool = True) -> Workload:
    """Loading blocks forever (a deadlock, a network read that never returns)."""
    return _workload("hang", FaultyDataset(_sleep_forever, in_worker_only=in_worker_only))


def _bad_sample(index: int) -> None:
    if index % 7 == 3:
        raise ValueError(f"sample {index} is corrupt")


def user_error() -> Workload:
    """The dataset's own code raises ValueError (in whichever process loads)."""
    return _workload("user-error", FaultyDataset(_bad_sample))


def _cuda_oom() -> None:
    # What the CUDA caching allocator raises; constructible on a CPU-only build of torch.
    raise torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8 GiB"
    )


def cuda_oom() -> Workload:
    """The model's forward pass runs out of GPU memory (simulated: raised, on CPU)."""
    return _workload("cuda-oom", model_fault=_cuda_oom)


def _huge_allocation() -> None:
    torch.empty(2**60, dtype=torch.uint8)  # a real allocation the CPU allocator refuses


def cpu_alloc_failure() -> Workload:
    """The forward pass asks for more host memory than exists: torch's CPU allocator fails."""
    return _workload("cpu-alloc-failure", model_fault=_huge_allocation)


def _nan_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, targets) * float("nan")


def nan_loss() -> Workload:
    """The loss is NaN from the first step: training diverges."""
    return _workload("nan-loss", loss_fn=_nan_loss)


def _signal_main(number: int) -> Callable[[], None]:
    def fault() -> None:
        faulthandler.disable()  # pytest's would print every thread's stack: noise here
        os.kill(os.getpid(), number)

    return fault


def main_segfault() -> Workload:
    """The training process itself dies of SIGSEGV in the forward pass."""
    return _workload("main-segfault", model_fault=_signal_main(signal.SIGSEGV))


def main_sigkill() -> Workload:
    """The training process is SIGKILLed, as by the kernel's out-of-memory killer."""
    return _workload("main-sigkill", model_fault=_signal_main(signal.SIGKILL))


def _check_affinity(expected: list[int]) -> Callable[[int], None]:
    def fault(index: int) -> None:
        got = sorted(os.sched_getaffinity(0))
        if got != expected:
            raise ValueError(f"running on CPUs {got}, expected {expected}")

    return fault


def affinity_probe(cpus: list[int]) -> Workload:
    """Raises unless the process loading the data may run on exactly ``cpus``."""
    return _workload("affinity-probe", FaultyDataset(_check_affinity(sorted(cpus))))


def _hang_after(samples: int) -> Callable[[int], None]:
    loaded = [0]  # per process: each loader worker counts its own

    def fault(index: int) -> None:
        loaded[0] += 1
        if loaded[0] > samples:
            time.sleep(3600)

    return fault


def main_segfault_beside_hung_worker() -> Workload:
    """The training process dies of SIGSEGV in its first forward pass while its loader worker
    is blocked in the dataset (it loads one batch of 16, then hangs)."""
    return _workload(
        "main-segfault-hung-worker",
        FaultyDataset(_hang_after(16), in_worker_only=True),
        model_fault=_signal_main(signal.SIGSEGV),
    )


def _segfault_after(samples: int) -> Callable[[int], None]:
    loaded = [0]  # per process

    def fault(index: int) -> None:
        loaded[0] += 1
        if loaded[0] > samples:
            time.sleep(0.5)  # the training process is in its first forward pass by then
            os.kill(os.getpid(), signal.SIGSEGV)

    return fault


def _swallow_first_call() -> Callable[[], None]:
    calls = [0]

    def fault() -> None:
        calls[0] += 1
        if calls[0] == 1:
            with contextlib.suppress(Exception):  # a library's broad except
                time.sleep(5)

    return fault


def worker_segfault_report_lost() -> Workload:
    """A loader worker dies of SIGSEGV while the training process runs code that swallows
    exceptions: torch's report of the death (a RuntimeError raised from its SIGCHLD handler,
    wherever the main thread is) is lost there, and the training waits for torch's next
    check, 5 s later. The worker loads one batch of 16, then crashes during the first step."""
    return _workload(
        "worker-segfault-report-lost",
        FaultyDataset(_segfault_after(16), in_worker_only=True),
        model_fault=_swallow_first_call(),
    )
