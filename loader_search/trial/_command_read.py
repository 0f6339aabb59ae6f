"""What a command's trial folder says (`loader_search.trial._command`): the state files the
hook writes in the command's processes (``proc-PID.json``, `loader_search.trial._hookstate`) and
loader workers (``worker-PID.json``, `loader_search.trial._hookworker`), its error files, and
the `TrialResult` they add up to, or why they add up to none."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loader_search.trial._command_text import (
    ELASTIC,
    NO_HOOK_HINT,
    NOTHING_SEEN,
    WRONG_PYTHON_HINT,
    command_python,
    interpreter_flag,
    lacks_torch,
    last_error,
    no_hook,
    wrong_python,
)
from loader_search.trial._failures import (
    EXCEPTION,
    NOT_APPLIED,
    FailureReason,
    TrialFailure,
    failure_for,
)
from loader_search.trial._job import TrialJob
from loader_search.trial._result import TrialResult

# What a study keeps of a failure's traceback (its end): a rank's own lines must fit in it.
TRACE_CHARS = 4000


@dataclass
class Seen:
    """What the hook's files said at the last look."""

    procs: list[dict[str, Any]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    hook_errors: list[str] = field(default_factory=list)
    # What the hook could not import, per process (``import-error-PID.json``): its Python
    # lacks loader-search's dependencies, so the hook stayed out.
    imports: list[dict[str, Any]] = field(default_factory=list)

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

    @property
    def world(self) -> int:
        worlds = [int(p.get("world_size", 1)) for p in self.trainers]
        return max(worlds, default=1)

    def budget_reached_at(self, world: int) -> float | None:
        """When the last rank used up its budget (``time.time()``), None before."""
        done = [p for p in self.trainers if p.get("budget_reached")]
        if not done or len(done) < world:
            return None
        return max(float(p.get("budget_reached_at") or 0.0) for p in done)

    def train_loaders(self) -> list[dict[str, Any]]:
        """The training loader's record in each process that built one."""
        return [
            loader
            for proc in self.procs
            for loader in proc.get("loaders", [])
            if loader.get("train")
        ]

    def loaders_seen(self) -> str:
        sites = [
            f"#{loader.get('index')} at {loader.get('site')}"
            for p in self.procs
            for loader in p.get("loaders", [])
        ]
        return ", ".join(sites) if sites else "none"

    def hook_missing(
        self, argv: Sequence[str], output: str, *, final: bool
    ) -> TrialFailure | None:
        """The failure of a command ``argv`` the hook did not load in, where that is known:
        no process of it loaded the hook, and its interpreter runs with a flag that keeps the
        hook out, or (the command over: ``final``) a process wrote without it."""
        if any(p.get("hooked") for p in self.procs):
            return None
        flag = interpreter_flag(argv)
        if flag is None and not (final and self.procs):
            return None
        return failure_for(NOT_APPLIED, no_hook(flag), output, hint=NO_HOOK_HINT)

    def wrong_python(self, argv: Sequence[str], workdir: str, output: str) -> TrialFailure | None:
        """The failure of a command ``argv`` whose Python cannot import torch (its ``output``
        says so) or what the hook needs (the hook's record), naming that Python; else None."""
        missing = ["torch"] if lacks_torch(output) else []
        for record in self.imports:
            missing += [str(m) for m in record.get("missing") or [] if str(m) not in missing]
        if not missing:
            return None
        python = next((str(r["python"]) for r in self.imports if r.get("python")), None)
        line = wrong_python(python or command_python(argv, workdir), missing, found=bool(python))
        # The hook stayed out (its record): no setting applied; else the script's own import.
        reason: FailureReason = NOT_APPLIED if self.imports else EXCEPTION
        return failure_for(reason, line, output, hint=WRONG_PYTHON_HINT)

    def no_loader(self, within_s: float, output: str) -> TrialFailure | None:
        """Why a command that built no DataLoader in ``within_s`` was stopped: never a
        deadlock, as no loader was there to wait for. None once one was built (a hang before
        its first batch is the command's own)."""
        if any(p.get("loaders") for p in self.procs):
            return None
        return failure_for(
            NOT_APPLIED,
            f"the command built no torch.utils.data.DataLoader in {within_s:g} s, so there is"
            " nothing to tune: feed its training loop from a DataLoader (its settings in the"
            " code or as flags, docs/scripts.md), or raise [limits] trial_timeout_s if it"
            " builds one later",
            output,
        )

    def no_trainer(self, argv: Sequence[str], output: str) -> TrialFailure:
        """Why the command ``argv``, over, gave no training loader to measure."""
        missing = self.hook_missing(argv, output, final=True)
        if missing is not None:
            return missing
        if not self.procs:  # no process wrote a thing: none built a loader, or none could
            return failure_for(NOT_APPLIED, NOTHING_SEEN, output)
        return failure_for(
            NOT_APPLIED,
            "the command ended without iterating a training DataLoader (loaders seen:"
            f" {self.loaders_seen()})",
            output,
        )

    def error_tail(self, output: str) -> tuple[str, str]:
        """What a command that exited with an error says: the line naming its error, and the
        failure's traceback. Where the command's last ``output`` lost the traceback of the
        first exception a process of it ended in (the hook's record; torchrun's own is none),
        as torchrun's banner and rank prefixes make it, that traceback leads: its last line
        names the error (the rank's, with ranks), its lines come first, then as much of the
        ``output`` as fits beside them in `TRACE_CHARS`. Else the error is read from the
        ``output`` (`last_error`)."""
        errors = [
            (float(error.get("at") or 0.0), proc, str(error.get("traceback") or ""))
            for proc in self.procs
            if isinstance(error := proc.get("error"), dict)
            and not str(error.get("type", "")).startswith(ELASTIC)
        ]
        if not errors:
            return last_error(output), output
        _, proc, trace = min(errors, key=lambda found: found[0])
        if not trace.strip() or trace in output:  # a plain script's, printed whole
            return last_error(output), output
        line = last_error(trace.splitlines()[-1])
        if int(proc.get("world_size") or 1) > 1:
            line = f"rank {proc.get('rank')}: {line}"
        room = TRACE_CHARS - len(trace) - 1
        kept = output[-room:] if room > 0 else ""
        if len(kept) < len(output):
            kept = kept.partition("\n")[2]  # whole lines only
        return line, "\n".join(part for part in (trace, kept) if part)


def look(folder: Path) -> Seen:
    """Read the trial folder now (a file being replaced is read at the next look)."""

    def read(pattern: str) -> list[dict[str, Any]]:
        found = []
        for path in folder.glob(pattern):
            with contextlib.suppress(OSError, ValueError):
                value = json.loads(path.read_text())
                if isinstance(value, dict):
                    found.append(value)
        return found

    procs = sorted(read("proc-*.json"), key=lambda p: (p.get("rank", 0), p.get("pid", 0)))
    return Seen(
        procs=procs,
        workers=read("worker-*.json"),
        hook_errors=[
            p.read_text(errors="replace").strip() for p in folder.glob("hook-error-*.txt")
        ],
        imports=read("import-error-*.json"),
    )


def stage_costs(seen: Seen) -> dict[str, float | None]:
    """The `TrialResult` stage-cost fields: the producer's from the loader workers' files
    (or the training processes' own, without workers), the main process's from the ranks."""
    ranks = [p.get("stages") or {} for p in seen.trainers]
    main_batches = sum(float(s.get("window_batches", 0)) for s in ranks)
    main = sum(float(s.get("main_cpu_s", 0.0)) for s in ranks)
    sources = seen.workers if seen.workers else ranks
    samples = sum(float(s.get("samples", 0)) for s in sources)
    batches = sum(float(s.get("batches", 0)) for s in sources)
    fetch = sum(float(s.get("fetch_cpu_s", 0.0)) for s in sources)
    collate = sum(float(s.get("collate_cpu_s", 0.0)) for s in sources)
    return {
        "producer_cpu_s_per_sample": fetch / samples if samples else None,
        "collate_cpu_s_per_batch": collate / batches if batches else None,
        # Without workers the training process produces its batches: its overhead beside
        # them is not measured apart (the pipeline model scales the workers' figure).
        "main_cpu_s_per_batch": main / main_batches if seen.workers and main_batches else None,
    }


def command_result(
    seen: Seen,
    job: TrialJob,
    lr: str | None,
    val_loss: float | None,
    peak_pss: int,
    began: float,
) -> TrialResult:
    """The result of a run whose every rank has a window (``lr``: the ``{lr}`` placeholder's
    text, empty without one; ``val_loss`` None: not needed)."""
    ranks = seen.trainers
    windows = [p["window"] for p in ranks]
    samples = sum(int(w["measured_samples"]) for w in windows)
    window_s = max(float(w["measured_time_s"]) for w in windows)
    waits = sorted(float(w["data_wait_s"]) / float(w["measured_time_s"]) for w in windows)
    main = ranks[0]
    return TrialResult(
        throughput_samples_per_s=samples / window_s,
        val_loss=val_loss,
        val_accuracy=None,
        data_wait_fraction=waits[len(waits) // 2],
        time_to_first_batch_s=max(float(w["time_to_first_batch_s"]) for w in windows),
        peak_host_rss_bytes=max(peak_pss, sum(int(p.get("peak_rss_bytes", 0)) for p in ranks)),
        peak_gpu_bytes=None,
        train_samples=sum(int(p.get("samples", 0)) for p in ranks),
        measured_samples=samples,
        measured_time_s=window_s,
        warmup_batches=int(windows[0]["warmup_batches"]),
        epochs=0,
        lr=float(lr) if lr else math.nan,
        final_train_loss=None,
        train_time_s=max(0.0, (seen.budget_reached_at(len(ranks)) or 0.0) - began),
        eval_time_s=0.0,
        device=str(job.device),
        stopped_early=job.plan.stop_early,
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
        cpus_available=len(job.cpus) if job.cpus is not None else None,
        **stage_costs(seen),  # type: ignore[arg-type]
    )
