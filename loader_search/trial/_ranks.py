"""Multi-rank trials: one trial, the whole node (``[training] ranks``).

A trial with N ranks trains as ``torchrun --nproc_per_node=N`` with DistributedDataParallel
does: N processes, each with its own DataLoader of the trial's (per-rank) settings over its
`DistributedSampler` share of the data, the model in DDP. Here the trial's process (forked by
the supervisor, see `loader_search.trial._supervisor`) is rank 0 and forks ranks 1..N-1 before
anything else runs in it, so every rank and every loader worker of every rank is in the
trial's process group: the supervisor's kill of the group, its timeout and its memory limit
cover them all, and a sibling dies with rank 0 (``PR_SET_PDEATHSIG``). The ranks meet through
a `torch.distributed.FileStore` in an anonymous in-memory file that rank 0 opens and every
rank inherits (no port, and no name on disk: a trial killed whatever way leaves nothing
behind), with the ``gloo`` backend (the CPU, or GPUs shared by ranks) or ``nccl`` (one GPU
per rank).

One trial, one set of failures: a sibling that raises sends its classified failure to rank 0;
one that crashes (a signal) is classified by its exit; rank 0, whose collective then fails,
reports the sibling's failure rather than its own broken connection (`RankFailed`). A
sibling's SIGKILL is the out-of-memory killer's only when the kernel's count of its kills
rose meanwhile (`loader_search.trial._processes.oom_kills`); else the rank crashed. A rank
that hangs stops everyone's progress, and the supervisor's trial timeout kills the group.

Measured across ranks: the window opens and closes at a barrier on every rank
(`rank_sync`), so the windows are aligned; the trial's throughput is the samples of all ranks
over the slowest rank's window. Rank 0 evaluates the whole validation set and reads the
ceiling on the plain model (no collectives), and the node's ceiling is N times it. Per-rank
figures (throughput, data wait, stage costs, CPU, peak memory) are kept in ``per_rank``.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from loader_search.errors import UserError
from loader_search.trial._failures import (
    CRASHED,
    HOST_OOM,
    RankFailed,
    TrialFailure,
    classify_exit,
    failure_for,
)
from loader_search.trial._messages import Failed, Trained, report_failure
from loader_search.trial._processes import die_with_parent, oom_kills, release_openmp_threads

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from loader_search.params import RunPlan
    from loader_search.trial._result import TrialResult

RANK_TIMEOUT_S = 300  # a collective waits this long for a rank at most (gloo, nccl)
SIBLING_REPORT_S = 5.0  # after rank 0 failed: how long it waits to hear why from a sibling
SIBLING_RESULT_S = 120.0  # after rank 0 finished: how long a sibling may take to report


@dataclass(frozen=True)
class RankContext:
    """Which rank this process is, of how many, over which backend."""

    rank: int
    world: int
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device, world: int) -> str:
    """``nccl`` when every rank has a GPU of its own, else ``gloo``."""
    if (
        device.type == "cuda"
        and torch.distributed.is_nccl_available()
        and torch.cuda.device_count() >= world
    ):
        return "nccl"
    return "gloo"


def rank_device(device: torch.device, rank: RankContext) -> torch.device:
    """Rank ``rank``'s device: its own GPU where there is one per rank, else ``device``."""
    if device.type == "cuda" and rank.backend == "nccl":
        return torch.device("cuda", rank.rank)
    return device


def rank_sync(sync: Callable[[], None]) -> Callable[[], None]:
    """``sync`` (the device's), then a barrier of all ranks: the window's edges line up."""

    def both() -> None:
        sync()
        torch.distributed.barrier()

    return both


TrainOne = Callable[["RankContext"], "TrialResult"]


def run_ranks(
    train_one: TrainOne, world: int, device: torch.device, progress: Callable[[], None]
) -> TrialResult:
    """Run ``train_one`` (a single-rank trial, given its `RankContext`) on ``world`` ranks:
    this process as rank 0, the others forked now; merge their results (see the module
    docstring). Raises `RankFailed` with the failing rank's failure."""
    backend = backend_for(device, world)
    exits = RankExits()  # before any sibling exists: its OOM kills count from here
    store_fd = _store_file()
    # Every rank reaches the file through the descriptor it inherits: nothing has a name.
    store = f"/proc/self/fd/{store_fd}"
    context = multiprocessing.get_context("fork")
    siblings: list[tuple[Any, Connection]] = []
    try:
        release_openmp_threads()
        for number in range(1, world):
            reader, writer = context.Pipe(duplex=False)
            rank = RankContext(number, world, backend)
            process = context.Process(
                target=_sibling_main,
                args=(writer, os.getpid(), rank, store, train_one),
                name=f"loader-search-rank-{number}",
            )
            process.start()
            writer.close()
            siblings.append((process, reader))
        main = RankContext(0, world, backend)
        try:
            first = _in_group(main, store, train_one)
        except BaseException as exc:
            found = _sibling_failure(siblings, SIBLING_REPORT_S, exits)
            if found is not None and not isinstance(exc, KeyboardInterrupt):
                raise RankFailed(*found) from exc
            raise
        results = [first]
        for number, (process, reader) in enumerate(siblings, start=1):
            results.append(_sibling_result(number, process, reader, progress, exits))
        return merge(results)
    finally:
        for process, reader in siblings:
            with contextlib.suppress(Exception):
                if process.is_alive():
                    process.kill()
                process.join(timeout=5)
            reader.close()
        os.close(store_fd)


def _store_file() -> int:
    """A descriptor of an anonymous file for the ranks' store: in memory (``memfd``), else
    an unlinked temporary file. A named folder was left behind by every trial killed before
    it could remove it (a timeout, an out-of-memory kill, ``kill -9``)."""
    with contextlib.suppress(AttributeError, OSError):
        return os.memfd_create("loader-search-ranks")  # forked ranks inherit it
    with tempfile.TemporaryFile(prefix="loader-search-ranks-") as file:  # unlinked at once
        return os.dup(file.fileno())


class RankExits:
    """Classifies the exit of a sibling that sent no report, with the kernel's count of
    out-of-memory kills read when the trial began."""

    def __init__(self) -> None:
        self.oom_before = oom_kills()

    def failure(self, exitcode: int | None) -> TrialFailure:
        """As `classify_exit`, but a SIGKILL is the out-of-memory killer's only when the
        count rose: something else killed a rank just as well (a scheduler, a watchdog, a
        user's ``kill -9``), and an out-of-memory class would retrain the batch as
        micro-batches, and every later trial of that batch size with it."""
        if exitcode != -signal.SIGKILL:
            return classify_exit(exitcode)
        now = oom_kills()
        if self.oom_before is not None and now is not None and now > self.oom_before:
            return failure_for(
                HOST_OOM,
                "the rank was killed by SIGKILL, and the kernel's out-of-memory killer"
                f" killed {now - self.oom_before} process(es) meanwhile",
            )
        known = "none was recorded" if now is not None else "no record of them can be read"
        return failure_for(
            CRASHED,
            "the rank died of signal 9 (SIGKILL), sent neither by loader-search nor, as far"
            f" as the kernel's count of out-of-memory kills says ({known}), by that killer",
            hint=(
                "something outside loader-search killed the rank: look for a job scheduler,"
                " a watchdog or a user that kills processes on this machine"
            ),
        )


def _in_group(
    rank: RankContext, store: str, train_one: TrainOne, *, leave_on_failure: bool = True
) -> TrialResult:
    """``train_one`` inside the process group (joined, then left; after a failure only with
    ``leave_on_failure``)."""
    torch.distributed.init_process_group(
        rank.backend,
        store=torch.distributed.FileStore(store, rank.world),  # type: ignore[attr-defined]
        rank=rank.rank,
        world_size=rank.world,
        timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S),
    )
    try:
        result = train_one(rank)
    except BaseException:
        if leave_on_failure:
            _leave_group()
        raise
    _leave_group()
    return result


def _leave_group() -> None:
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


def _sibling_main(
    conn: Connection, parent: int, rank: RankContext, store: str, train_one: TrainOne
) -> None:
    """A rank other than 0: train, send the result or the classified failure, exit."""
    die_with_parent(parent)
    try:
        # A failed rank does not leave the group: leaving can wait on the ranks still in a
        # collective, and the failure would then reach rank 0 only as a trial that stopped
        # making progress (a "timeout"). Its exit right after the report breaks their wait.
        result = _in_group(rank, store, train_one, leave_on_failure=False)
    except BaseException as exc:  # reported, and the process ends, before exc is let go
        report_failure(conn, exc)
    with contextlib.suppress(Exception):
        conn.send(Trained(result, time.perf_counter()))
        conn.close()
    os._exit(0)  # as the trial's process does: no finaliser talks on inherited handles


def _sibling_failure(
    siblings: list[tuple[Any, Connection]], wait_s: float, exits: RankExits
) -> tuple[int, TrialFailure] | None:
    """The first failure a sibling reported, or the exit of one that died (waiting up to
    ``wait_s`` for either); None when every sibling still runs or ended well."""
    deadline = time.perf_counter() + wait_s
    while True:
        for number, (process, reader) in enumerate(siblings, start=1):
            with contextlib.suppress(EOFError, OSError):
                if reader.poll():
                    message = reader.recv()
                    if isinstance(message, Failed):
                        return number, message.failure
            if process.exitcode not in (None, 0):
                return number, exits.failure(process.exitcode)
        if time.perf_counter() >= deadline:
            return None
        time.sleep(0.05)


def _sibling_result(
    number: int,
    process: Any,
    reader: Connection,
    progress: Callable[[], None],
    exits: RankExits,
) -> TrialResult:
    """Rank ``number``'s result, once it sends it (progress pings while waiting)."""
    deadline = time.perf_counter() + SIBLING_RESULT_S
    while not reader.poll(0.2):
        progress()
        if process.exitcode is not None and not reader.poll(0.2):
            raise RankFailed(number, exits.failure(process.exitcode))
        if time.perf_counter() > deadline:
            raise RankFailed(number, classify_exit(None))
    try:
        message = reader.recv()
    except EOFError:
        process.join(timeout=5)
        raise RankFailed(number, exits.failure(process.exitcode)) from None
    if isinstance(message, Failed):
        raise RankFailed(number, message.failure)
    result: TrialResult = message.result
    return result


def merge(results: list[TrialResult]) -> TrialResult:
    """The trial's result from its ranks' (rank 0 first): throughput over the slowest rank's
    window, rank 0's validation, the node's ceiling, CPU use and memory (rank 0's process tree
    holds the siblings), and the per-rank figures."""
    main = results[0]
    world = len(results)
    samples = sum(r.measured_samples for r in results)
    window = max(r.measured_time_s for r in results)
    own_cpu = [r.cpu_used_cores for r in results[1:]]
    main_cpu = None
    if main.cpu_used_cores is not None and all(c is not None for c in own_cpu):
        main_cpu = max(0.0, main.cpu_used_cores - sum(c for c in own_cpu if c is not None))
    per_rank: dict[str, list[Any]] = {
        "throughput_samples_per_s": [r.throughput_samples_per_s for r in results],
        "data_wait_fraction": [r.data_wait_fraction for r in results],
        "measured_time_s": [r.measured_time_s for r in results],
        "producer_cpu_s_per_sample": [r.producer_cpu_s_per_sample for r in results],
        "main_cpu_s_per_batch": [r.main_cpu_s_per_batch for r in results],
        "cpu_used_cores": [main_cpu, *own_cpu],
        "peak_host_rss_bytes": [r.peak_host_rss_bytes for r in results],
        "time_to_first_batch_s": [r.time_to_first_batch_s for r in results],
        "window_minor_faults": [r.window_minor_faults for r in results],
    }

    faults = [f for f in per_rank["window_minor_faults"] if f is not None]

    def middle(key: str) -> float | None:
        values = [v for v in per_rank[key] if v is not None]
        return statistics.median(values) if values else None

    return replace(
        main,
        throughput_samples_per_s=samples / window,
        measured_samples=samples,
        measured_time_s=window,
        train_samples=sum(r.train_samples for r in results),
        data_wait_fraction=middle("data_wait_fraction") or 0.0,
        time_to_first_batch_s=max(per_rank["time_to_first_batch_s"]),
        window_minor_faults=sum(faults) if faults else None,
        producer_cpu_s_per_sample=middle("producer_cpu_s_per_sample"),
        main_cpu_s_per_batch=middle("main_cpu_s_per_batch"),
        ceiling_samples_per_s=(
            main.ceiling_samples_per_s * world if main.ceiling_samples_per_s else None
        ),
        full_window_throughput_samples_per_s=None,
        short_samples=main.short_samples * world if main.short_samples else None,
        ranks=world,
        per_rank=per_rank,
    )


def resolve_ranks(ranks: int | str, device: torch.device | str) -> int:
    """``[training] ranks`` as a number: ``"auto"`` is one per visible GPU on CUDA (asked
    without initialising CUDA: `PYTORCH_NVML_BASED_CUDA_CHECK`), 1 on a CPU."""
    if ranks == "auto":
        cuda = torch.device(device).type == "cuda"
        return max(1, torch.cuda.device_count()) if cuda else 1
    return int(ranks)


def check_ranks(ranks: int | str, device: torch.device | str) -> None:
    """Refuse, in one line, more ranks than the machine where the trials run has room for:
    one usable CPU each (this process's affinity, after any ``--cpus``), on CUDA too, where
    ranks beyond the visible GPUs share them. The config's own rule
    (`loader_search.params.MAX_RANKS`) is for any node; a value from a shared database or a
    typo must not start a thousand ranks here, nor reach a command's ``{ranks}``."""
    del device  # a rank is a process: the CPUs bound it on every device
    if ranks == "auto":
        return  # one per visible GPU, or 1: within the bound by construction
    bound = _usable_cpu_count()
    if int(ranks) > bound:
        raise UserError(
            f"[training] ranks = {int(ranks)}: this machine has {bound} usable CPU(s), one"
            f" per rank; set ranks to at most {bound}, or run the study where there is room"
            " for them"
        )


def _usable_cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask; all of them where the platform
    has none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def per_rank_plan(plan: RunPlan, world: int) -> RunPlan:
    """``plan`` with its early-stop mark per rank (the mark counts one rank's samples)."""
    if plan.short_samples is None:
        return plan
    return replace(plan, short_samples=-(-plan.short_samples // world))


def rank_budget(train_samples: int, rank: RankContext | None) -> int:
    """One rank's share of the global training budget (all of it without ranks)."""
    return train_samples if rank is None else -(-train_samples // rank.world)


def distributed_sampler(dataset: Any, rank: RankContext, seed: int) -> Any:
    """Rank ``rank``'s share of ``dataset``, shuffled by ``seed`` (and the epoch)."""
    from torch.utils.data.distributed import DistributedSampler

    return DistributedSampler(
        dataset, num_replicas=rank.world, rank=rank.rank, shuffle=True, seed=seed
    )


def wrap_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` in DistributedDataParallel for this rank."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return DistributedDataParallel(model, device_ids=ids)
