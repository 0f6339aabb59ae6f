"""A trial that runs the user's own training command (`CommandSpec`), unchanged.

The command is started under a keeper (`loader_search.trial._keeper`: nothing it starts
outlives the run, nor a worker killed outright), in a session of its own, never through a
shell, in its working folder, with the trial's environment: this process's, without the
database's URL or password, plus a start-up hook on ``PYTHONPATH``
(`loader_search.trial._hook`) that finds the script's training DataLoader, puts the trial's
settings into it where the command has no placeholder for them
(`loader_search.trial._placeholders`), times its iteration in the script's own loop and ends
it once the budget is used. The hook and this parent talk only through
files in the trial's private folder (``settings.json`` in, one ``proc-PID.json`` per process of
the command out).

The parent watches as it watches a forked trial (`loader_search.trial._supervisor`): a
no-progress limit (progress is samples the training loader delivered, or batches of any other
loader: the validation; past the budget, the same limit counts from the budget's end whatever
arrives), the memory limit, Ctrl-C. Its output is read with each line cut short and the
pattern's time on a line bounded (`loader_search.trial._command_output`). It stops the whole
command (SIGTERM, then SIGKILL after a grace period) as soon as the trial has what it needs:
every rank past its budget with a throughput window, and the validation loss the script
reported after it (``loader_search.report(val_loss=...)`` or ``val_loss_pattern`` over its
output) unless the plan needs throughput only. Every other end becomes a `TrialFailure` with
the command's last lines of output.

A plan that asks for the ceiling runs the command a second time, the hook in ``ceiling`` mode
(`loader_search.trial._hookloop`: the script's step fed two batches from memory); the reading
is the trial's ``ceiling_samples_per_s``, and a second run that fails leaves the trial without
one. The stage costs come from the hook's files (`loader_search.trial._command_read`), and a
first look before a study searches (`loader_search.trial._probe`) runs the command in ``probe``
mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import regex

from loader_search import interrupts
from loader_search.params import TrialLimits
from loader_search.trial._command_group import (
    STOP_GRACE_S,
    finish,
    start_error,
    start_kept,
    stop_kept,
    wait,
)
from loader_search.trial._command_output import MATCH_LIMIT_S, SLOW_MATCHES, Output
from loader_search.trial._command_read import Seen, command_result, look
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
    diverged_if_non_finite,
    failure_for,
)
from loader_search.trial._job import CommandSpec, TrialJob
from loader_search.trial._keeper import FOLDER_PREFIX, MARKER_ENV, remove_stale
from loader_search.trial._placeholders import (
    placeholder_values,
    placeholders_in,
    render_command,
    to_inject,
)
from loader_search.trial._processes import POLL_S, gib, tree_pss
from loader_search.trial._result import TrialResult

HOOK_DIR = Path(__file__).parent / "_hook"
TRIAL_DIR_ENV = MARKER_ENV  # also the marker every process of the trial inherits
MEMORY_POLL_S = 0.5
_PRINTED_SETTLE_S = 0.3  # a printed loss stands alone this long before it is taken
# Variables a command never inherits: the study's database and its password.
_SECRET_VARS = ("LOADER_SEARCH_STORAGE", "PGPASSWORD", "MYSQL_PWD", "DATABASE_URL")
_CUDA_OOM_TEXT = ("CUDA out of memory", "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError")


def run_command(job: TrialJob, limits: TrialLimits, ranks: int = 1) -> TrialOutcome:
    """Run the trial ``job.command`` describes and classify its end (see the module)."""
    assert job.command is not None
    started = time.perf_counter()
    # A nan or inf loss is diverged before any ceiling run is spent on it.
    outcome = diverged_if_non_finite(_run_once(job, limits, ranks, "train", started))
    if outcome.result is None or not job.plan.measure_ceiling:
        return outcome
    # The ceiling: the script again, its step fed from memory (loader_search.trial._hookloop).
    # A run that fails leaves the trial without one, as a busy machine's reading would.
    ceiling = _run_once(job, limits, ranks, "ceiling", time.perf_counter()).result
    if ceiling is None:
        return outcome
    result = dataclasses.replace(
        outcome.result, ceiling_samples_per_s=ceiling.throughput_samples_per_s
    )
    return dataclasses.replace(outcome, result=result, wall_s=time.perf_counter() - started)


def _run_once(
    job: TrialJob, limits: TrialLimits, ranks: int, mode: str, started: float
) -> TrialOutcome:
    assert job.command is not None
    with trial_folder() as folder:
        return _Command(job, job.command, limits, folder, ranks, mode).run(started)


@contextlib.contextmanager
def trial_folder() -> Iterator[Path]:
    """A run's private folder (settings in, the hook's files out; its path is the marker
    every process of the run inherits), removed after the run. A worker killed outright left
    its run's folder (and, where its keeper was killed too, processes): those go first."""
    remove_stale(Path(tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Command:
    """One run of the command for one trial: start it, watch it, read what it says, stop it,
    and say how it went (see the module's docstring)."""

    def __init__(
        self,
        job: TrialJob,
        spec: CommandSpec,
        limits: TrialLimits,
        folder: Path,
        ranks: int,
        mode: str = "train",
    ) -> None:
        self.job = job
        self.mode = mode  # train, ceiling or probe (loader_search.trial._hookloop)
        self.result: TrialResult | None = None
        self.spec = spec
        self.limits = limits
        self.folder = folder  # the trial's private folder: settings in, state files out
        self.ranks = ranks
        # Every placeholder's value in this trial (the lr too, for its result).
        self.filled = placeholder_values(job.params, job.settings, ranks)
        self.peak_pss = 0
        self.began = time.time()
        pattern = regex.compile(spec.val_loss_pattern) if spec.val_loss_pattern else None
        self.output = Output(pattern)
        self.reader_done = threading.Event()  # the output was read to its end
        self.seen = Seen()

    def run(self, started: float) -> TrialOutcome:
        argv = render_command(self.spec.argv, self.filled)
        self._write_settings()
        out, into = os.pipe()
        try:
            process = start_kept(
                argv,
                cwd=self.spec.workdir,
                env=self._environment(),
                folder=self.folder,
                stdout=into,
                cpus=self.job.cpus,
            )
        except OSError as exc:
            os.close(out)
            why = failure_for(
                EXCEPTION,
                f"the command's working folder {self.spec.workdir!r} cannot be used: {exc}",
                hint="give [workload] workdir (or run the worker) in a folder that exists",
            )
            return TrialOutcome(None, why, time.perf_counter() - started, 0.0)
        finally:
            os.close(into)  # the command's processes hold it now: its end is theirs
        done = threading.Event()

        def read() -> None:
            self.output.read(out, done)
            self.reader_done.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            failure = self._watch(process)
        except BaseException:  # Ctrl-C above all: nothing of the command may be left
            stop_kept(process, grace_s=0.0)
            raise
        finally:
            finish(process, self.folder)
            done.set()
            reader.join(timeout=STOP_GRACE_S)
            if not reader.is_alive():
                os.close(out)
        return TrialOutcome(self.result, failure, time.perf_counter() - started, 0.0)

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
            # A plan that needs throughput only ends the loop at its window's mark; the
            # ceiling and the probe end by their own rules.
            "train_samples": (
                None
                if self.mode != "train"
                else self.job.plan.short_samples
                if self.job.plan.stop_early and self.job.plan.short_samples
                else settings.train_samples
            ),
            "mode": self.mode,
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

    def _watch(self, process: subprocess.Popen[bytes]) -> TrialFailure | None:
        """Watch the command (its keeper: ``process``) until `_done` or a failure
        (returned)."""
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
                stop_kept(process, 0.0)
                return failure_for(
                    NOT_APPLIED,
                    f"the loader-search hook failed in the command: {self.seen.hook_errors[0]}",
                    self.output.text(),
                )
            # A Python that lacks what the hook needs (its record): said now, not at the end.
            refused = (
                (
                    self.seen.wrong_python(self.spec.argv, self.spec.workdir, self.output.text())
                    if self.seen.imports
                    else None
                )
                or self._not_applied()
                or self._slow_pattern()
            )
            if refused is not None:  # the trial would measure the script's own setting
                stop_kept(process, 0.0)
                return refused
            if self._done():
                stop_kept(process, STOP_GRACE_S)
                return None
            if ended:  # the keeper ends once nothing of the command is left
                self._look()
                self.reader_done.wait(STOP_GRACE_S)  # its last lines: a printed loss
                if self._done(ended=True):
                    return None
                return self._start_failure() or self._ended(process.returncode)
            reached = self.seen.budget_reached_at(self.seen.world)
            # Past its budget a command has trial_timeout_s to report and end, however many
            # batches another loader delivers meanwhile (a script that trains on for ever on a
            # second loader).
            late = reached is not None and time.time() - reached > limits.trial_timeout_s
            if late or now - last_progress > limits.trial_timeout_s:
                stop_kept(process, 0.0)
                return self._silent(limits.trial_timeout_s)
            if now >= next_memory:
                next_memory = now + MEMORY_POLL_S
                used = tree_pss(process.pid, include_root=False)  # the command's, not its keeper's
                self.peak_pss = max(self.peak_pss, used)
                if limits.memory_limit_bytes is not None and used > limits.memory_limit_bytes:
                    stop_kept(process, 0.0)
                    return failure_for(
                        HOST_OOM,
                        f"the command used {gib(used)} of host memory (PSS of its process"
                        f" tree), above the limit of {gib(limits.memory_limit_bytes)}; it was"
                        " stopped",
                    )

    def _slow_pattern(self) -> TrialFailure | None:
        """A failure once the val_loss_pattern ran out of time on `SLOW_MATCHES` lines: it
        is no longer tried, so the loss would never be found."""
        if self.output.slow_matches < SLOW_MATCHES:
            return None
        return failure_for(
            NO_VAL_LOSS,
            f"the val_loss_pattern {self.spec.val_loss_pattern!r} ran out of time"
            f" ({MATCH_LIMIT_S:g} s) on {SLOW_MATCHES} lines of the command's output: it"
            " backtracks without end",
            self.output.text(),
            hint=(
                "write the pattern without nested repetition, e.g. 'val_loss[=:]\\s*([0-9.eE+-]+)'"
            ),
        )

    def _start_failure(self) -> TrialFailure | None:
        """The failure of a command whose program could not start (not found, a folder)."""
        why = start_error(self.folder)
        if why is None:
            return None
        return failure_for(
            EXCEPTION, why, hint="fix the command's first word: it names the program to run"
        )

    def _look(self) -> None:
        self.seen = look(self.folder)

    def _not_applied(self) -> TrialFailure | None:
        """A failure naming the trial's settings the training loader could not take (a
        batch_sampler fixes the batch size, torch refused one): never a silent no-op."""
        if missing := self.seen.hook_missing(self.spec.argv, self.output.text(), final=False):
            return missing  # the hook cannot load: no setting can apply
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

    def _val_loss(self, after: float, ended: bool) -> float | None:
        """The first validation loss reported at or after ``after`` (``time.time()``): the
        script's exact ``loader_search.report`` first, else one read from its output. A
        script that prints its loss rounded, then reports it, races the two; so a printed
        loss is taken only once it stood alone for `_PRINTED_SETTLE_S`, or the command
        ended."""
        reported = sorted(
            (float(at), float(value))
            for p in self.seen.procs
            for at, value in p.get("val_losses", [])
            if float(at) >= after
        )
        if reported:
            return reported[0][1]
        settled = time.time() - (0.0 if ended else _PRINTED_SETTLE_S)
        printed = sorted(v for v in self.output.losses if after <= v[0] <= settled)
        return printed[0][1] if printed else None

    def _done(self, ended: bool = False) -> bool:
        """Whether the run has all it needs (then its `result` is set); ``ended``: the
        command has ended and its output is read."""
        reached = self.seen.budget_reached_at(self.seen.world)
        if reached is None or any(p.get("window") is None for p in self.seen.trainers):
            return False
        val_loss = None
        if self.mode == "train" and not self.job.plan.stop_early:
            val_loss = self._val_loss(reached, ended)
            if val_loss is None:
                return False
        self.result = command_result(
            self.seen, self.job, self.filled["lr"], val_loss, self.peak_pss, self.began
        )
        return True

    def _ended(self, returncode: int | None) -> TrialFailure:
        """Why a command that ended by itself gave no result (a Python without torch or
        loader-search first, then a rank's own error)."""
        wrong = self.seen.wrong_python(self.spec.argv, self.spec.workdir, self.output.text())
        if wrong is not None:
            return wrong
        line, tail = self.seen.error_tail(self.output.text())
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
                EXCEPTION, f"the command exited with status {returncode}: {line}", tail
            )
        return self._short(tail)

    def _short(self, tail: str) -> TrialFailure:
        """A command that exited 0 without what the trial needs."""
        if self.seen.hook_errors:
            return failure_for(
                NOT_APPLIED, f"the loader-search hook failed: {self.seen.hook_errors[0]}", tail
            )
        if not self.seen.trainers:
            return self.seen.no_trainer(self.spec.argv, tail)
        if self.seen.budget_reached_at(self.seen.world) is None:
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
        if wrong := self.seen.wrong_python(self.spec.argv, self.spec.workdir, tail):
            return wrong
        if missing := self.seen.hook_missing(self.spec.argv, tail, final=True):
            return missing
        if nothing := self.seen.no_loader(timeout_s, tail):  # no loader: never a deadlock
            return nothing
        samples, _ = self.seen.progress
        if self.seen.budget_reached_at(self.seen.world) is not None:
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
