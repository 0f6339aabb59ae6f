"""Machine facts every layer may read: what this process may use (CPUs by affinity and cgroup
quota, memory, /dev/shm), the training device, and how busy the machine is."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection
from pathlib import Path

import torch

from loader_search.errors import UserError

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_STAT = Path("/proc/stat")


def _read_cpu_max(path: Path) -> float | None:
    """A cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") in CPUs; None if unlimited."""
    quota, period = path.read_text().split()[:2]
    return None if quota == "max" else int(quota) / int(period)


def cgroup_cpu_limit(root: Path = _CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """The CPU quota of this process's cgroup in CPUs, or None when unlimited or unknown.

    Under cgroup v2 the process may sit in a nested group (a systemd scope with CPUQuota=,
    a container's sub-group): every level from its own group up to the root can cap it, so the
    smallest quota on that path counts. ``self_cgroup`` is the text of /proc/self/cgroup.
    """
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    relative = next(
        (line[3:].strip("/") for line in self_cgroup.splitlines() if line.startswith("0::")), ""
    )
    group = root / relative if relative else root
    limits = []
    for level in [group, *group.parents]:
        try:
            limit = _read_cpu_max(level / "cpu.max")
        except (OSError, ValueError):
            limit = None
        if limit is not None:
            limits.append(limit)
        if level == root:
            break
    if limits:
        return min(limits)
    if (root / "cpu.max").exists() or (group / "cpu.max").exists():
        return None  # cgroup v2, unlimited
    try:  # cgroup v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus() -> int:
    """CPUs this process may actually run on: its affinity mask, capped by a cgroup CPU quota.

    ``os.cpu_count()`` reports the host's CPUs, which overstates what a container or a pinned
    process gets; loader workers beyond this number only fight each other.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def resolve_device(spec: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; ``cpu``, ``cuda`` and ``cuda:N`` are checked."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(
            f"training.device = {spec!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"training.device = {spec!r} but CUDA is not available here: use 'auto' or 'cpu'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(
                f"training.device = {spec!r} but only {torch.cuda.device_count()} CUDA device(s)"
                " are visible: pick a smaller index"
            )
    elif device.type != "cpu":
        raise UserError(
            f"training.device = {spec!r} is not supported: use 'auto', 'cpu' or 'cuda'"
        )
    return device


def device_name(device: torch.device) -> str:
    """A human name for the device, e.g. 'NVIDIA H200' or 'cpu (AMD EPYC ...)'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({cpu_model()})"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def total_ram_bytes() -> int:
    """Physical memory of the host (a cgroup memory limit, when lower, is reported apart)."""
    import psutil

    return int(psutil.virtual_memory().total)


def available_ram_bytes() -> int:
    """Memory the host could give now without swapping (page cache counts as free)."""
    import psutil

    return int(psutil.virtual_memory().available)


def cgroup_memory_limit_bytes(root: Path = _CGROUP_ROOT) -> int | None:
    """This process's cgroup memory limit (v2 ``memory.max`` or v1), or None when unlimited."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        # cgroup v1 reports "unlimited" as a huge page-aligned number.
        return None if value >= 2**60 else value
    return None


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """Size of the shared-memory file system loader workers pass batches through, or None
    where there is none (not Linux). Docker's default is 64 MiB, too small for most loaders."""
    import shutil

    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


def start_method() -> str:
    """The multiprocessing start method DataLoader workers will use (fork, spawn or
    forkserver). Python 3.14 made forkserver the Linux default; spawn and forkserver re-import
    torch in every worker, about a second each."""
    import multiprocessing

    # Not get_start_method(allow_none=False): that would fix the method for the process.
    return (
        multiprocessing.get_start_method(allow_none=True)
        or (
            multiprocessing.get_all_start_methods()[0]  # the platform default comes first
        )
    )


def machine_busy_cpu_s(
    cpus: Collection[int] | None = None, path: Path = _PROC_STAT
) -> float | None:
    """CPU seconds the ``cpus`` (every CPU of the machine: None) have spent busy since boot,
    from ``/proc/stat`` (user, nice, system, irq, softirq, steal); None where there is none."""
    try:
        lines = path.read_text().splitlines()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    wanted = {"cpu"} if cpus is None else {f"cpu{n}" for n in cpus}
    busy = 0
    found = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 9 or fields[0] not in wanted:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
        busy += user + nice + system + irq + softirq + steal
        found += 1
    return busy / ticks if found == len(wanted) else None


def affinity_cpus() -> list[int] | None:
    """The CPUs this process may run on (None where the platform cannot say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def host_cpus() -> int | None:
    """The host's CPUs, all of them (None where the platform cannot say): more than a pinned
    or containerised process may use (`usable_cpus`), shown beside it by ``doctor``."""
    return os.cpu_count()


class OtherLoad:
    """How busy the rest of the machine was, on the CPUs this process may run on, over a
    stretch of its work: the CPU seconds other processes used there, as a share of those
    CPUs (0: idle, 1: all of them busy). Workers pinned to other CPUs do not count. Start
    it, do the work, read `share`."""

    def __init__(self) -> None:
        self._cpus = affinity_cpus()
        self._busy = machine_busy_cpu_s(self._cpus)
        self._own = time.process_time()
        self._wall = time.perf_counter()

    def share(self) -> float | None:
        busy = machine_busy_cpu_s(self._cpus)
        cpus = len(self._cpus) if self._cpus is not None else os.cpu_count()
        wall = time.perf_counter() - self._wall
        if busy is None or self._busy is None or not cpus or wall <= 0:
            return None
        others = (busy - self._busy) - (time.process_time() - self._own)
        return min(1.0, max(0.0, others / (wall * cpus)))
