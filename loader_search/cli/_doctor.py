"""What a search depends on, checked on this machine before a study spends hours on it.

`diagnose` gives one `Check` per dependency with a verdict (ok / warn / fail), what was found
and how to fix it; ``loader-search doctor`` prints them. The shared-memory check reports what
`loader_search.study.search._fit.fit_space` does to the space before every study: a setting whose
batches cannot fit in ``/dev/shm`` fails every trial with a bus error.

Nothing here initialises CUDA in this process (trials are forked from it, and a process that
has used CUDA cannot fork usable children): the GPU is probed in a forked child.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from loader_search._system import (
    affinity_cpus,
    available_ram_bytes,
    cgroup_cpu_limit,
    cgroup_memory_limit_bytes,
    cpu_model,
    host_cpus,
    resolve_device,
    shm_bytes,
    start_method,
    total_ram_bytes,
    usable_cpus,
)
from loader_search.errors import UserError
from loader_search.study import SHM_FIX, fit_space, largest_footprint, sample_bytes
from loader_search.study import size_text as _size
from loader_search.trial import can_isolate, resolve_ranks

if TYPE_CHECKING:
    from loader_search.study import StudyConfig
    from loader_search.workloads import Workload

Verdict = Literal["ok", "warn", "fail"]

# Check names, in the order `diagnose` returns them.
DEVICE = "device"
CPUS = "cpus"
MEMORY = "memory"
WORKLOAD = "workload"
SHARED_MEMORY = "shared memory"
START_METHOD = "start method"
ISOLATION = "trial isolation"
STORAGE = "storage"

# Without a workload to measure: below this, most image loaders with workers fail.
SMALL_SHM = 512 * 2**20


@dataclass(frozen=True)
class Check:
    """One dependency of the search: its verdict, what was found, and the fix ("" if none)."""

    name: str
    verdict: Verdict
    detail: str
    fix: str = ""


def diagnose(
    config: StudyConfig | None, storage_url: str | None, workload: Workload | None
) -> list[Check]:
    """Check this machine for the study ``config`` describes (or for any study, when None).

    ``storage_url`` None means the default (``LOADER_SEARCH_STORAGE``, else the SQLite file).
    With a ``workload`` the ``/dev/shm`` check measures its samples against the study's space.
    Never raises for what it finds: every problem is a ``fail`` check.
    """
    device_check, cuda = _device(config.device if config is not None else "auto")
    checks = [device_check, _cpus(), _memory(config)]
    bytes_per_sample: int | None = None
    if workload is not None:
        workload_check, bytes_per_sample = _workload(workload)
        checks.append(workload_check)
    checks += [
        _shared_memory(config, bytes_per_sample, cuda),
        _start_method(),
        _isolation(config),
        _storage(storage_url),
    ]
    return checks


def _device(spec: str) -> tuple[Check, bool]:
    """The training device; for CUDA, a forked child initialises it and allocates."""
    import torch

    try:
        device = resolve_device(spec)
    except UserError as exc:
        return Check(DEVICE, "fail", str(exc), "set training.device to 'auto' or 'cpu'"), False
    if device.type == "cpu":
        build = "CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
        gpus = torch.cuda.device_count()  # NVML: CUDA stays uninitialised here
        detail = f"cpu ({cpu_model()}); torch {torch.__version__} ({build})"
        if gpus:
            return Check(
                DEVICE,
                "warn",
                f"{detail}; {gpus} CUDA GPU(s) present but training.device = {spec!r}",
                "set training.device = 'auto' to search on the GPU",
            ), False
        return Check(DEVICE, "ok", f"{detail}; no CUDA GPU"), False
    index = device.index or 0
    probe = _probe_cuda(index)
    if isinstance(probe, str):
        return Check(
            DEVICE,
            "fail",
            f"{device}: CUDA does not work in a trial process: {probe}",
            "check the driver (nvidia-smi) and that torch's CUDA version matches it",
        ), True
    name, total, free = probe
    return Check(
        DEVICE,
        "ok",
        f"{device}: {name}, {_size(total)} ({_size(free)} free); torch {torch.__version__},"
        f" CUDA {torch.version.cuda}; usable in forked trial processes",
    ), True


def _probe_cuda(index: int) -> tuple[str, int, int] | str:
    """(name, total, free bytes) of GPU ``index`` as a forked trial process sees it, or the
    error text. Run in a child so that this process never initialises CUDA."""
    context = multiprocessing.get_context("fork") if can_isolate() else None
    if context is None:
        return _cuda_facts(index)
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_cuda_probe_child, args=(writer, index))
    process.start()
    writer.close()
    try:
        if not reader.poll(120):
            return "the probe did not answer within 120 s"
        answer: tuple[str, int, int] | str = reader.recv()
        return answer
    except EOFError:
        return "the probe process died"
    finally:
        reader.close()
        process.kill()
        process.join()


def _cuda_probe_child(conn: Any, index: int) -> None:
    conn.send(_cuda_facts(index))
    conn.close()


def _cuda_facts(index: int) -> tuple[str, int, int] | str:
    import torch

    try:
        torch.ones(1, device=f"cuda:{index}")  # initialises CUDA and allocates
        free, total = torch.cuda.mem_get_info(index)
        return torch.cuda.get_device_name(index), int(total), int(free)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"


def _cpus() -> Check:
    pinned = affinity_cpus()
    affinity = len(pinned) if pinned is not None else host_cpus() or 1  # None: not Linux
    host = host_cpus() or affinity
    quota = cgroup_cpu_limit()
    usable = usable_cpus()
    quota_text = "no cgroup CPU quota" if quota is None else f"cgroup quota {quota:g} CPUs"
    detail = f"{usable} usable: affinity {affinity} of {host} CPUs, {quota_text}"
    if usable == 1:
        return Check(
            CPUS,
            "warn",
            detail + "; loader workers and training share one CPU",
            "give the process more CPUs (taskset, docker --cpus) for workers to overlap",
        )
    if quota is not None and quota < affinity and quota != math.floor(quota):
        return Check(
            CPUS,
            "warn",
            detail + f"; a fractional quota throttles {usable} threads to {quota:g} CPUs",
            "use a whole number of CPUs (docker --cpus) so throughput is stable",
        )
    return Check(CPUS, "ok", detail)


def _memory(config: StudyConfig | None) -> Check:
    total = total_ram_bytes()
    limit = cgroup_memory_limit_bytes()
    available = available_ram_bytes()
    usable = min(total, limit) if limit is not None else total
    detail = (
        f"{_size(total)} RAM, {_size(available)} available;"
        f" {'no cgroup memory limit' if limit is None else f'cgroup limit {_size(limit)}'}"
    )
    trial_limit = config.limits.memory_limit_bytes if config is not None else None
    if trial_limit is not None:
        detail += f"; trial memory limit {_size(trial_limit)}"
        if trial_limit > usable:
            return Check(
                MEMORY,
                "warn",
                detail + f": above the {_size(usable)} this process can have, so the kernel's"
                " out-of-memory killer acts first (still recorded as host_oom)",
                f"set [limits] memory_limit_gb below {usable / 2**30:.1f}",
            )
    if min(available, usable) < 2 * 2**30:
        return Check(
            MEMORY,
            "warn",
            detail + "; under 2 GiB to train in: trials with many workers may run out",
            "free memory, or raise the container's memory limit",
        )
    return Check(MEMORY, "ok", detail)


def _workload(workload: Workload) -> tuple[Check, int | None]:
    try:
        per_sample = sample_bytes(workload)
    except Exception as exc:
        return Check(
            WORKLOAD,
            "fail",
            f"{workload.name}: loading a training sample failed:"
            f" {type(exc).__name__}: {str(exc).strip()[:300]}",
            "fix the workload's dataset or collate_fn",
        ), None
    train: Any = workload.train_dataset
    return Check(
        WORKLOAD,
        "ok",
        f"{workload.name}: {len(train)} training samples, {_size(per_sample)} per collated sample",
    ), per_sample


def _shared_memory(config: StudyConfig | None, bytes_per_sample: int | None, cuda: bool) -> Check:
    size = shm_bytes()
    if size is None:
        return Check(SHARED_MEMORY, "ok", "no /dev/shm on this platform: nothing to size")
    detail = f"/dev/shm {_size(size)}"
    if config is None or bytes_per_sample is None:
        if size < SMALL_SHM:
            return Check(
                SHARED_MEMORY,
                "warn",
                detail + " (Docker's default is 64 MiB): loader workers with larger batches"
                " fail with a bus error",
                SHM_FIX,
            )
        return Check(SHARED_MEMORY, "ok", detail)
    # With ranks, every rank's loader has batches in flight at once: the node's total counts.
    ranks = resolve_ranks(config.training.ranks, "cuda" if cuda else "cpu")
    space = config.space.resolve(max(1, usable_cpus() // ranks), cuda)
    need = largest_footprint(space, bytes_per_sample) * ranks
    per_rank = f" x {ranks} ranks" if ranks > 1 else ""
    detail += (
        f"; the space's largest setting needs {_size(need)} ({space.num_workers.high} worker(s) x"
        f" prefetch_factor {space.prefetch_factor.high} x batch {max(space.batch_sizes)} x"
        f" {_size(bytes_per_sample)}{per_rank})"
    )
    if need <= size:
        return Check(SHARED_MEMORY, "ok", detail)
    _, messages = fit_space(space, bytes_per_sample, size // ranks)
    if messages:
        return Check(
            SHARED_MEMORY,
            "warn",
            detail + "; run will narrow the space: " + "; ".join(messages),
            SHM_FIX,
        )
    return Check(
        SHARED_MEMORY,
        "warn",
        detail + "; trials combining many workers, a high prefetch_factor and large batches"
        " will fail (worker_killed)",
        SHM_FIX,
    )


def _start_method() -> Check:
    method = start_method()
    if method == "fork":
        return Check(START_METHOD, "ok", "fork: loader workers start in ~0.1 s")
    return Check(
        START_METHOD,
        "warn",
        f"{method}: every loader worker imports torch again (~1.35 s each, one after another),"
        " at every epoch unless persistent_workers; the search measures that cost",
        "where your training uses fork, call multiprocessing.set_start_method('fork') first"
        " (Python 3.14 made forkserver the Linux default)",
    )


def _isolation(config: StudyConfig | None) -> Check:
    from loader_search.params import TrialLimits

    limits = config.limits if config is not None else TrialLimits()
    memory = (
        "no memory limit"
        if limits.memory_limit_bytes is None
        else f"memory limit {_size(limits.memory_limit_bytes)}"
    )
    if can_isolate():
        return Check(
            ISOLATION,
            "ok",
            f"every trial in a forked child process; killed after {limits.trial_timeout_s:g} s"
            f" without progress, {memory}",
        )
    return Check(
        ISOLATION,
        "warn",
        "no fork on this platform: trials run in this process, so a crash ends the study and"
        " no timeout or memory limit applies",
        "run the search on Linux",
    )


def _storage(storage_url: str | None) -> Check:
    from sqlalchemy.engine import make_url

    from loader_search.team import in_memory, mask_url, open_storage, resolve_storage_url

    try:
        url = resolve_storage_url(storage_url)
    except UserError as exc:
        return Check(STORAGE, "fail", str(exc), "give --storage a database URL")
    shown = mask_url(url)
    try:
        parsed = make_url(url)
    except Exception:
        parsed = None
    if parsed is not None and parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if in_memory(parsed):
            return Check(
                STORAGE,
                "fail",
                f"{shown}: an in-memory database, which run, init and worker refuse (a study"
                " in it would vanish when the process ends)",
                "use a file, e.g. sqlite:///loader_search.db",
            )
        path = Path(database)  # type: ignore[arg-type]
        if not path.exists():
            folder = path.parent if str(path.parent) else Path(".")
            if folder.is_dir() and os.access(folder, os.W_OK):
                return Check(STORAGE, "ok", f"{shown}: will be created by `run`")
            return Check(
                STORAGE,
                "fail",
                f"{shown}: the folder {str(folder)!r} does not exist or is not writable",
                "create the folder or point --storage elsewhere",
            )
        must_exist = True
    else:
        must_exist = False
    try:
        storage = open_storage(url, must_exist=must_exist)
    except UserError as exc:
        return Check(STORAGE, "fail", str(exc), "check --storage / $LOADER_SEARCH_STORAGE")
    try:
        studies = _study_names(storage)
    finally:
        with contextlib.suppress(Exception):
            storage.engine.dispose()
    return Check(STORAGE, "ok", f"{shown}: reachable, {len(studies)} study(ies)")


def _study_names(storage: Any) -> Sequence[str]:
    from loader_search.study import study_names  # the names alone: see its docstring

    return study_names(storage)
