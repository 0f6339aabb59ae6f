"""A trial that runs the user's own training command (`CommandSpec`), unchanged.

The command is started in a process group of its own, never through a shell, in its working
folder, with the trial's environment: this process's, without the database's URL or
password, plus a start-up hook on ``PYTHONPATH`` (`loader_search.trial._hook`) that finds the
script's training DataLoader, puts the trial's settings into it where the command has no
placeholder for them (`loader_search.trial._placeholders`), times its iteration in the script's
own loop and ends it once the budget is used. The hook and this parent talk only through
files in the trial's private folder (``settings.json`` in, one ``proc-PID.json`` per process of
the command out).

The parent watches as it watches a forked trial (`loader_search.trial._supervisor`): a
no-progress limit (progress is samples the training loader delivered, or batches of any other
loader: the validation), the memory limit, Ctrl-C. It stops the whole group (SIGTERM, then
SIGKILL after a grace period) as soon as the trial has what it needs: every rank past its
budget with a throughput window, and the validation loss the script reported after it
(``loader_search.report(val_loss=...)`` or ``val_loss_pattern`` over its output) unless the
plan needs throughput only. Every other end becomes a `TrialFailure` with the command's last
lines of output.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from loader_search import interrupts
from loader_search.params import TrialLimits
from loader_search.trial._command_group import (
    STOP_GRACE_S,
    remember,
    stop_group,
    stop_known,
    wait,
)
from loader_search.trial._failures import (
    BUDGET_NOT_HONOURED,
    CRASHED,
    CUDA_OOM,
    EXCEPTION,
    HOST_OOM,
    INTERRUPTED,
    NO_VAL_LOSS,
    NOT_APPLIED,
    TIMEOUT,
    TrialFailure,
    TrialOutcome,
    failure_for,
)
from loader_search.trial._job import CommandSpec, TrialJob
from loader_search.trial._placeholders import (
    placeholder_values,
    placeholders_in,
    render_command,
    to_inject,
)
from loader_search.trial._processes import POLL_S, gib, tree_pss
from loader_search.trial._result import TrialResult

HOOK_DIR = Path(__file__).parent / "_hook"
TRIAL_DIR_ENV = "LOADER_SEARCH_TRIAL_DIR"
OUTPUT_LINES = 40  # the command's last lines kept with a failure
MEMORY_POLL_S = 0.5
# Variables a command never inherits: the study's database and its password.
_SECRET_VARS = ("LOADER_SEARCH_STORAGE", "PGPASSWORD", "MYSQL_PWD", "DATABASE_URL")
_CUDA_OOM_TEXT = ("CUDA out of memory", "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError")


def run_command(job: TrialJob, limits: TrialLimits, ranks: int = 1) -> TrialOutcome:
    """Run the trial ``job.command`` describes and classify its end (see the module)."""
    assert job.command is not None
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="loader-search-command-"))
    try:
        return _Command(job, job.command, limits, folder, ranks).run(started)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class _Output:
    """The command's output, read by a thread: its last lines, and the validation losses
    ``pattern`` found in it with when they were printed (``time.time()``)."""

    pattern: re.Pattern[str] | None
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES)
    )
    losses: list[tuple[float, float]] = field(default_factory=list)

    def read(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            if self.pattern is not None:
                found = self.pattern.search(line)
                if found:
                    with contextlib.suppress(ValueError, IndexError):
                        self.losses.append((time.time(), float(found.group(1))))
        stream.close()

    def text(self) -> str:
        return "\n".join(self.tail)


@dataclass
class _Seen:
    """What the hook's files said at the last look."""

    procs: list[dict[str, Any]] = field(default_factory=list)
    hook_errors: list[str] = field(default_factory=list)

    @property
    def trainers(self) -> list[dict[str, Any]]:
        """The processes that iterated a training loader: the ranks."""
        return [p for p in self.procs if p.get("batches", 0) > 0]

    @property
    def progress(self) -> tuple[int, int]:
        return (
            sum(int(p.get("samples", 0)) for p in self.procs),
            sum(int(p.get("ticks", 0)) for p in self.procs),
        )

    def budget_reached_at(self, world: int) -> float | None:
        """When the last rank used up its budget (``time.time()``), None before."""
        done = [p for p in self.trainers if p.get("budget_reached")]
        if not done or len(done) < world:
            return None
        return max(float(p.get("budget_reached_at") or 0.0) for p in done)


class _Command:
    """One run of the command for one trial: start it, watch it, read what it says, stop it,
    and say how it went (see the module's docstring)."""

    def __init__(
        self, job: TrialJob, spec: CommandSpec, limits: TrialLimits, folder: Path, ranks: int
    ) -> None:
        self.job = job
        self.spec = spec
        self.limits = limits
        self.folder = folder  # the trial's private folder: settings in, state files out
        self.ranks = ranks
        # Every placeholder's value in this trial (the lr too, for its result).
        self.filled = placeholder_values(job.params, job.settings, ranks)
        self.peak_pss = 0
        self.began = time.time()
        # Every process of the command seen so far (pid: start time): one that left the
        # group and outlived its parent is still found and stopped.
        self.known: dict[int, float] = {}
        pattern = re.compile(spec.val_loss_pattern) if spec.val_loss_pattern else None
        self.output = _Output(pattern)
        self.seen = _Seen()

    def run(self, started: float) -> TrialOutcome:
        argv = render_command(self.spec.argv, self.filled)
        self._write_settings()
        try:
            process = subprocess.Popen(
                argv,
                cwd=self.spec.workdir,
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a group of its own: stopped whole, Ctrl-C ours only
            )
        except OSError as exc:
            why = failure_for(EXCEPTION, f"the command {argv[0]!r} could not start: {exc}")
            return TrialOutcome(None, why, time.perf_counter() - started, 0.0)
        if self.job.cpus is not None:
            with contextlib.suppress(OSError):  # before its interpreter starts any thread
                os.sched_setaffinity(process.pid, self.job.cpus)
        reader = threading.Thread(target=self.output.read, args=(process.stdout,), daemon=True)
        reader.start()
        try:
            result, failure = self._watch(process)
        except BaseException:  # Ctrl-C above all: nothing of the command may be left
            stop_group(process, grace_s=0.0)
            raise
        finally:
            stop_known(self.known)
            reader.join(timeout=STOP_GRACE_S)
        return TrialOutcome(result, failure, time.perf_counter() - started, 0.0)

    def _write_settings(self) -> None:
        params, settings = self.job.params, self.job.settings
        workers = params.num_workers > 0
        data = {
            "batch_size": params.batch_size,
            "num_workers": params.num_workers,
            "prefetch_factor": params.prefetch_factor if workers else None,
            "pin_memory": params.pin_memory,
            "persistent_workers": params.persistent_workers and workers,
            "inject": to_inject(self.spec.argv),
            # A plan that needs throughput only ends the loop at its window's mark.
            "train_samples": (
                self.job.plan.short_samples
                if self.job.plan.stop_early and self.job.plan.short_samples
                else settings.train_samples
            ),
            "warmup_batches": settings.warmup_batches,
            "train_loader": self.spec.train_loader,
            "progress_interval_s": 0.5,
        }
        (self.folder / "settings.json").write_text(json.dumps(data))

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SECRET_VARS}
        package_parent = str(Path(__file__).resolve().parents[2])
        path = [str(HOOK_DIR), package_parent]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path)
        env[TRIAL_DIR_ENV] = str(self.folder)
        env["PYTHONUNBUFFERED"] = "1"  # its lines (and a validation loss) as they are printed
        if "torch_threads" not in placeholders_in(self.spec.argv):
            env["OMP_NUM_THREADS"] = str(self.job.params.torch_threads)
        if self.job.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.job.gpu)
        return env

    def _watch(
        self, process: subprocess.Popen[bytes]
    ) -> tuple[TrialResult | None, TrialFailure | None]:
        limits = self.limits
        last_progress = time.perf_counter()
        next_memory = last_progress
        progress = (0, 0)
        while True:
            interrupts.check()
            ended = wait(process, POLL_S)
            now = time.perf_counter()
            self._look()
            if self.seen.progress != progress:
                progress, last_progress = self.seen.progress, now
            if self.seen.hook_errors:  # the hook cannot do its part: no honest reading
                stop_group(process, 0.0)
                return None, failure_for(
                    NOT_APPLIED,
                    f"the loader-search hook failed in the command: {self.seen.hook_errors[0]}",
                    self.output.text(),
                )
            refused = self._not_applied()
            if refused is not None:  # the trial would measure the script's own setting
                stop_group(process, 0.0)
                return None, refused
            done = self._done()
            if done is not None:
                stop_group(process, STOP_GRACE_S)
                return done, None
            if ended:
                stop_group(process, 0.0)  # a grandchild left behind goes with the group
                self._look()
                return None, self._ended(process.returncode)
            if now - last_progress > limits.trial_timeout_s:
                stop_group(process, 0.0)
                return None, self._silent(limits.trial_timeout_s)
            if now >= next_memory:
                next_memory = now + MEMORY_POLL_S
                used = tree_pss(process.pid)
                remember(process.pid, self.known)
                self.peak_pss = max(self.peak_pss, used)
                if limits.memory_limit_bytes is not None and used > limits.memory_limit_bytes:
                    stop_group(process, 0.0)
                    return None, failure_for(
                        HOST_OOM,
                        f"the command used {gib(used)} of host memory (PSS of its process"
                        f" tree), above the limit of {gib(limits.memory_limit_bytes)}; it was"
                        " stopped",
                    )

    def _look(self) -> None:
        procs = []
        for path in self.folder.glob("proc-*.json"):
            with contextlib.suppress(OSError, ValueError):
                procs.append(json.loads(path.read_text()))
        self.seen.procs = sorted(procs, key=lambda p: (p.get("rank", 0), p.get("pid", 0)))
        self.seen.hook_errors = [
            p.read_text(errors="replace").strip() for p in self.folder.glob("hook-error-*.txt")
        ]

    def _not_applied(self) -> TrialFailure | None:
        """A failure naming the trial's settings the training loader could not take (a
        batch_sampler fixes the batch size, torch refused one): never a silent no-op."""
        for proc in self.seen.procs:
            for loader in proc.get("loaders", []):
                skipped = {
                    name: why
                    for name, why in (loader.get("not_applied") or {}).items()
                    # the loader has the trial's value anyway (a batch_sampler of that size)
                    if loader.get(name) != getattr(self.job.params, name, None)
                }
                if loader.get("train") and skipped:
                    name, why = next(iter(skipped.items()))
                    return failure_for(
                        NOT_APPLIED,
                        f"{name} cannot reach the training DataLoader built at"
                        f" {loader.get('site')}: {why}; pass it as a flag, or fix it in"
                        f" [space] (e.g. {name} = [one value])",
                        self.output.text(),
                    )
        return None

    def _val_loss(self, after: float) -> float | None:
        """The first validation loss reported at or after ``after`` (``time.time()``)."""
        reported = [
            (float(at), float(value))
            for p in self.seen.procs
            for at, value in p.get("val_losses", [])
        ]
        found = sorted(v for v in reported + self.output.losses if v[0] >= after)
        return found[0][1] if found else None

    def _done(self) -> TrialResult | None:
        """The result once the trial has all it needs, else None."""
        reached = self.seen.budget_reached_at(self._world())
        if reached is None or any(p.get("window") is None for p in self.seen.trainers):
            return None
        plan = self.job.plan
        val_loss = None
        if not plan.stop_early:
            val_loss = self._val_loss(reached)
            if val_loss is None:
                return None
        return self._result(val_loss)

    def _world(self) -> int:
        worlds = [int(p.get("world_size", 1)) for p in self.seen.trainers]
        return max(worlds, default=1)

    def _result(self, val_loss: float | None) -> TrialResult:
        ranks = self.seen.trainers
        windows = [p["window"] for p in ranks]
        samples = sum(int(w["measured_samples"]) for w in windows)
        window_s = max(float(w["measured_time_s"]) for w in windows)
        waits = sorted(float(w["data_wait_s"]) / float(w["measured_time_s"]) for w in windows)
        main = ranks[0]
        lr = self.filled["lr"]
        return TrialResult(
            throughput_samples_per_s=samples / window_s,
            val_loss=val_loss,
            val_accuracy=None,
            data_wait_fraction=waits[len(waits) // 2],
            time_to_first_batch_s=max(float(w["time_to_first_batch_s"]) for w in windows),
            peak_host_rss_bytes=max(
                self.peak_pss, sum(int(p.get("peak_rss_bytes", 0)) for p in ranks)
            ),
            peak_gpu_bytes=None,
            train_samples=sum(int(p.get("samples", 0)) for p in ranks),
            measured_samples=samples,
            measured_time_s=window_s,
            warmup_batches=int(windows[0]["warmup_batches"]),
            epochs=0,
            lr=float(lr) if lr else math.nan,
            final_train_loss=None,
            train_time_s=max(0.0, (self.seen.budget_reached_at(len(ranks)) or 0.0) - self.began),
            eval_time_s=0.0,
            device=str(self.job.device),
            stopped_early=self.job.plan.stop_early,
            ranks=len(ranks) if len(ranks) > 1 else None,
            per_rank=(
                {
                    "throughput_samples_per_s": [
                        float(w["measured_samples"]) / float(w["measured_time_s"]) for w in windows
                    ],
                    "data_wait_fraction": [
                        float(w["data_wait_s"]) / float(w["measured_time_s"]) for w in windows
                    ],
                    "peak_host_rss_bytes": [int(p.get("peak_rss_bytes", 0)) for p in ranks],
                }
                if len(ranks) > 1
                else None
            ),
            loader_site=next(
                (str(x.get("site")) for x in main.get("loaders", []) if x.get("train")), None
            ),
        )

    def _ended(self, returncode: int | None) -> TrialFailure:
        """Why a command that ended by itself gave no result."""
        tail = self.output.text()
        if returncode is not None and returncode != 0:
            if any(text in tail for text in _CUDA_OOM_TEXT):
                return failure_for(CUDA_OOM, "the command ran out of GPU memory", tail)
            if returncode < 0:
                number = -returncode
                name = signal.Signals(number).name if number in signal.valid_signals() else "?"
                if number == signal.SIGINT:
                    return failure_for(INTERRUPTED, "the command was interrupted (SIGINT)", tail)
                return failure_for(CRASHED, f"the command died of signal {number} ({name})", tail)
            if "MemoryError" in tail:
                return failure_for(HOST_OOM, "the command ran out of host memory", tail)
            return failure_for(
                EXCEPTION, f"the command exited with status {returncode}: {_last(tail)}", tail
            )
        return self._short(tail)

    def _short(self, tail: str) -> TrialFailure:
        """A command that exited 0 without what the trial needs."""
        if self.seen.hook_errors:
            return failure_for(
                NOT_APPLIED, f"the loader-search hook failed: {self.seen.hook_errors[0]}", tail
            )
        if not self.seen.trainers:
            return failure_for(
                NOT_APPLIED,
                f"the command ended without iterating a training DataLoader (loaders seen:"
                f" {self._loaders_seen()})",
                tail,
            )
        if self.seen.budget_reached_at(self._world()) is None:
            samples, _ = self.seen.progress
            return failure_for(
                BUDGET_NOT_HONOURED,
                f"the command ended after {samples:,} of its {self.job.settings.train_samples:,}"
                " training samples",
                tail,
            )
        if any(p.get("window") is None for p in self.seen.trainers):
            return failure_for(
                BUDGET_NOT_HONOURED,
                "the budget ended inside the warm-up: no batch was measured; raise"
                " [training] train_samples",
                tail,
            )
        return failure_for(
            NO_VAL_LOSS, "the command ended without reporting a validation loss", tail
        )

    def _silent(self, timeout_s: float) -> TrialFailure:
        """Why a command that made no progress for ``timeout_s`` was stopped."""
        tail = self.output.text()
        samples, _ = self.seen.progress
        if self.seen.budget_reached_at(self._world()) is not None:
            return failure_for(
                BUDGET_NOT_HONOURED,
                f"the command used its budget ({samples:,} samples), then neither reported a"
                f" validation loss nor ended for {timeout_s:g} s; it was stopped",
                tail,
            )
        return failure_for(
            TIMEOUT,
            f"no training progress for {timeout_s:g} s ({samples:,} samples trained); the"
            " command was stopped",
            tail,
        )

    def _loaders_seen(self) -> str:
        sites = [
            f"#{loader.get('index')} at {loader.get('site')}"
            for p in self.seen.procs
            for loader in p.get("loaders", [])
        ]
        return ", ".join(sites) if sites else "none"


def _last(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else "(no output)"
