"""A first look at a command before its study searches: which DataLoader trains, and which of
the trial's settings cannot reach it (`probe_command`).

The command runs once with the study's baseline batch size and two loader workers, the hook
in ``probe`` mode (no budget; `loader_search.trial._hookloop`), and is stopped as soon as the
training loader has delivered a batch and, for an `IterableDataset`, its workers have shown
whether they split the stream (`loader_search.trial._hookworker`). What it finds, a
`ScriptFacts`, narrows the study's space before any trial (`loader_search.study.search`):

* a ``batch_sampler`` fixes the batch size: ``batch_size`` is not searched, the study keeps
  the sampler's;
* a loader that does not batch (``batch_size=None``): ``batch_size`` is not searched;
* an `IterableDataset` whose workers never ask `get_worker_info` which part of the stream is
  theirs: each of N workers yields the whole stream, so ``num_workers`` is searched only up to
  one (a worker of its own, or none);
* a ``multiprocessing_context`` of the script's own: searched as declared, but a trial without
  workers runs without it (torch takes it only with workers), which the study says once.

A look that shows the command cannot be tuned at all stops the study before any trial
(``fatal``): its Python has no torch or no loader-search, or it iterates no DataLoader by its
end or the no-progress limit (a script that batches by hand would otherwise run whole twice,
then fail as if it hung). A setting a trial still cannot apply fails that trial as
``not_applied``, naming it: never a silent no-op.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loader_search.params import LoaderParams, TrainingSettings, TrialLimits
from loader_search.trial._command import _Command, trial_folder
from loader_search.trial._failures import NOT_APPLIED, TrialFailure
from loader_search.trial._job import CommandSpec, TrialJob

PROBE_WORKERS = 2  # enough to see whether an iterable stream is split
UNSHARDED = (
    "its IterableDataset does not split the stream across loader workers (no worker asked"
    " get_worker_info()): each of N workers would yield every sample"
)


@dataclass(frozen=True)
class ScriptFacts:
    """What `probe_command` found. ``fixed``: each setting not searched, with why; the
    training loader's own ``batch_size`` where the script fixes it; ``max_workers`` where
    workers beyond it would repeat the data; ``context``: the start method the loader's own
    ``multiprocessing_context`` names; ``failure``: why the look found nothing (the space
    stays as declared); ``fatal``: that reason says the command cannot be tuned."""

    site: str | None = None
    fixed: Mapping[str, str] = field(default_factory=dict)
    batch_size: int | None = None
    max_workers: int | None = None
    failure: str | None = None
    context: str | None = None
    fatal: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "site": self.site,
            "fixed": dict(self.fixed),
            "batch_size": self.batch_size,
            "max_workers": self.max_workers,
            "failure": self.failure,
            "context": self.context,
            "fatal": self.fatal,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScriptFacts:
        """The stored form back; anything malformed (other people write the database) reads
        as nothing found."""

        def count(value: object) -> int | None:
            return value if isinstance(value, int) and value > 0 else None

        fixed = data.get("fixed")
        return cls(
            site=str(data["site"]) if isinstance(data.get("site"), str) else None,
            fixed=({str(k): str(v) for k, v in fixed.items()} if isinstance(fixed, dict) else {}),
            batch_size=count(data.get("batch_size")),
            max_workers=count(data.get("max_workers")),
            failure=str(data["failure"]) if isinstance(data.get("failure"), str) else None,
            context=str(data["context"]) if isinstance(data.get("context"), str) else None,
            fatal=data.get("fatal") is True,
        )


class _Probe(_Command):
    """A run of the command in ``probe`` mode: done once the training loader is known."""

    def _not_applied(self) -> TrialFailure | None:
        # What cannot apply is what the probe is looking for; a hook that cannot load is not,
        # nor a Python without what the hook imports (said at once, not at the limit).
        text = self.output.text()
        if self.seen.imports:
            return self.seen.wrong_python(self.spec.argv, self.spec.workdir, text)
        return self.seen.hook_missing(self.spec.argv, text, final=False)

    def _done(self, ended: bool = False) -> bool:
        loaders = self.seen.train_loaders()
        if not loaders or not self.seen.trainers:
            return False
        loader = loaders[0]
        workers = int(loader.get("num_workers") or 0)
        if not loader.get("iterable") or workers < 2:
            return True
        if any(w.get("asked") for w in self.seen.workers):
            return True
        started = [w for w in self.seen.workers if int(w.get("produced", 0)) > 0]
        batches = max(int(p.get("batches", 0)) for p in self.seen.trainers)
        return len(started) >= 2 or batches > 2 * workers + 2


def probe_command(
    spec: CommandSpec,
    settings: TrainingSettings,
    limits: TrialLimits,
    *,
    device: str = "cpu",
    ranks: int = 1,
    max_workers: int = PROBE_WORKERS,
) -> ScriptFacts:
    """Run the command once and say what its training loader allows (see the module)."""
    workers = max(0, min(PROBE_WORKERS, max_workers))
    params = LoaderParams(
        batch_size=settings.batch_size,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
    )
    job = TrialJob(None, params, settings, device, command=spec)
    with trial_folder() as folder:
        probe = _Probe(job, spec, limits, folder, ranks, mode="probe")
        outcome = probe.run(time.perf_counter())
        seen = probe.seen
    loaders = seen.train_loaders()
    if not loaders:
        failure = outcome.failure
        why = failure.message if failure else "no training DataLoader iterated"
        # The wrong Python, or no loader the hook could see (`_Command._short`, `_silent`):
        # every trial would fail the same way. A crash or an error of the script's is left to
        # the baseline, which says it with its traceback.
        wrong = seen.wrong_python(spec.argv, spec.workdir, probe.output.text())
        fatal = wrong is not None or (failure is not None and failure.reason == NOT_APPLIED)
        return ScriptFacts(failure=wrong.message if wrong else why, fatal=fatal)
    return facts_of(loaders[0], seen.workers)


def facts_of(loader: Mapping[str, Any], workers: list[dict[str, Any]]) -> ScriptFacts:
    """`ScriptFacts` from the training loader's record and its workers' files."""
    fixed: dict[str, str] = {}
    batch_size = None
    for name, why in (loader.get("not_applied") or {}).items():
        if name == "batch_size":
            fixed[name] = str(why)
            own = loader.get("batch_size")
            batch_size = own if isinstance(own, int) and own > 0 else None
    max_workers = None
    started = [w for w in workers if int(w.get("produced", 0)) > 0 or w.get("asked")]
    if (
        loader.get("iterable")
        and int(loader.get("num_workers") or 0) >= 2
        and len(started) >= 2
        and not any(w.get("asked") for w in workers)
    ):
        fixed["num_workers"] = UNSHARDED
        max_workers = 1
    context = loader.get("multiprocessing_context")
    return ScriptFacts(
        site=str(loader.get("site")) if loader.get("site") else None,
        fixed=fixed,
        batch_size=batch_size,
        max_workers=max_workers,
        context=str(context) if context else None,
    )
