"""What a command's trial learns beyond its throughput: the stage costs the hook measures in
the script's loader workers (and in its own process without workers), the ceiling read by the
same script with its step fed from memory, and the first look at a command before its study
searches (which settings its training loader cannot take). Real scripts, real processes."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import optuna
import psutil
import pytest

from loader_search.params import LoaderParams, RunPlan, TrainingSettings, TrialLimits
from loader_search.study.search import IntRange, ResolvedSpace
from loader_search.study.work._script import baseline_batch_size, narrow
from loader_search.trial import CommandSpec, ScriptFacts, TrialJob, probe_command, run_isolated
from tests.conftest import run_cli

# Each sample costs about FETCH_MS of CPU to fetch (a busy loop, as a decode would), the step is
# a small linear model: the loader is the bottleneck, as in the cases a study is for.
SCRIPT = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
import loader_search

FETCH_MS = 1.0

def busy(ms):
    end = time.process_time() + ms / 1000
    while time.process_time() < end:
        pass

class Slow(Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        busy(FETCH_MS)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return x, int(x.sum() > 0)

class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info() if SHARDS else None
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, 10**9, step):
            busy(FETCH_MS)
            x = torch.randn(8)
            yield x, int(x.sum() > 0)

SHARDS = True
{setup}
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(1000):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        xv = torch.randn(256, 8)
        loss = torch.nn.functional.cross_entropy(model(xv), (xv.sum(1) > 0).long())
    loader_search.report(val_loss=loss)
"""
MAP_LOADER = "loader = DataLoader(Slow(), batch_size=32, shuffle=True)"
BATCH_SAMPLER = """
from torch.utils.data import BatchSampler, RandomSampler
loader = DataLoader(Slow(), batch_sampler=BatchSampler(RandomSampler(range(4096)), 24, False))
"""
STREAM = "loader = DataLoader(Stream(), batch_size=32)"
UNSHARDED = "SHARDS = False\nloader = DataLoader(Stream(), batch_size=32)"


def _script(folder: Path, setup: str) -> Path:
    path = folder / "train.py"
    path.write_text(SCRIPT.format(setup=textwrap.dedent(setup)))
    return path


def _spec(folder: Path, setup: str) -> CommandSpec:
    return CommandSpec((sys.executable, str(_script(folder, setup))), str(folder))


SETTINGS = TrainingSettings(train_samples=1024, batch_size=32, lr=0.1, warmup_batches=2)
LIMITS = TrialLimits(trial_timeout_s=60)


def _trial(spec: CommandSpec, params: LoaderParams, plan: RunPlan | None = None):  # type: ignore[no-untyped-def]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    job = TrialJob(None, params, SETTINGS, "cpu", plan=plan or RunPlan(), command=spec)
    outcome = run_isolated(job, limits=LIMITS)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], f"processes of the command left running: {left}"
    assert outcome.failure is None, outcome.failure
    assert outcome.result is not None
    return outcome.result


@pytest.mark.parametrize("workers", [0, 2])
def test_the_producers_cost_is_measured_in_the_scripts_own_loader(
    tmp_path: Path, workers: int
) -> None:
    params = LoaderParams(
        batch_size=32, num_workers=workers, prefetch_factor=2 if workers else None
    )
    result = _trial(_spec(tmp_path, MAP_LOADER), params)
    # About 1 ms of CPU per sample (the busy loop), plus making the sample itself.
    fetch = result.producer_cpu_s_per_sample
    assert fetch is not None and 0.0008 < fetch < 0.004, fetch
    collate = result.collate_cpu_s_per_batch
    assert collate is not None and 0 < collate < 32 * fetch
    # With workers, the training process's own share of a batch (receiving it) is measured.
    assert (result.main_cpu_s_per_batch is not None) == (workers > 0)


def test_the_ceiling_runs_the_scripts_step_without_its_loader(tmp_path: Path) -> None:
    spec = _spec(tmp_path, MAP_LOADER)
    result = _trial(spec, LoaderParams(batch_size=32), RunPlan(measure_ceiling=True))
    ceiling = result.ceiling_samples_per_s
    assert ceiling is not None
    # The loader costs ~1 ms a sample on the step's own core; the step alone costs a small
    # fraction of that: the script fed from memory is several times faster.
    assert ceiling > 3 * result.throughput_samples_per_s, (ceiling, result)
    # A plan without a ceiling reads none.
    assert _trial(spec, LoaderParams(batch_size=32)).ceiling_samples_per_s is None


@pytest.mark.parametrize(
    ("setup", "fixed", "batch_size", "max_workers"),
    [
        (MAP_LOADER, set(), None, None),
        (BATCH_SAMPLER, {"batch_size"}, 24, None),
        (STREAM, set(), None, None),
        (UNSHARDED, {"num_workers"}, None, 1),
    ],
    ids=["plain", "batch sampler", "sharded stream", "unsharded stream"],
)
def test_a_first_look_finds_what_the_training_loader_cannot_take(
    tmp_path: Path, setup: str, fixed: set[str], batch_size: int | None, max_workers: int | None
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    facts = probe_command(_spec(tmp_path, setup), SETTINGS, LIMITS)
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []
    assert facts.failure is None
    assert set(facts.fixed) == fixed
    assert (facts.batch_size, facts.max_workers) == (batch_size, max_workers)
    assert facts.site is not None and facts.site.startswith(str(tmp_path / "train.py"))
    assert ScriptFacts.from_dict(facts.as_dict()) == facts


def test_a_first_look_at_a_crashing_command_says_why_and_narrows_nothing(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text("raise SystemExit('no data here')\n")
    facts = probe_command(
        CommandSpec((sys.executable, str(script)), str(tmp_path)), SETTINGS, LIMITS
    )
    assert facts.failure is not None and "no data here" in facts.failure
    space = _space()
    narrowed, notes = narrow(space, facts, 32)
    assert narrowed == space
    assert len(notes) == 1 and "searched as declared" in notes[0]


def _space() -> ResolvedSpace:
    return ResolvedSpace(
        batch_sizes=(32, 64, 128),
        num_workers=IntRange(0, 2),
        prefetch_factor=IntRange(1, 4),
        persistent_workers=None,
        pin_memory=False,
        torch_threads=None,
        usable_cpus=2,
    )


def test_the_space_loses_what_the_script_fixes_and_says_so_in_one_line_each() -> None:
    facts = ScriptFacts(
        site="train.py:12",
        fixed={"batch_size": "a batch_sampler fixes the batch size", "num_workers": "unsplit"},
        batch_size=24,
        max_workers=1,
    )
    space, notes = narrow(_space(), facts, 32)
    assert space.batch_sizes == (24,) and space.num_workers == IntRange(0, 1)
    assert len(notes) == 2
    assert notes[0].startswith("batch_size is not searched: a batch_sampler fixes the batch size")
    assert "train.py:12" in notes[0] and "24" in notes[0]
    assert notes[1].startswith("num_workers is searched up to 1 only: unsplit")
    # The baseline runs at the batch size the script fixes, not the training's.
    assert baseline_batch_size(space, 32) == 24
    assert baseline_batch_size(_space(), 32) == 32
    # Stored facts that someone else wrote badly read as nothing found.
    assert ScriptFacts.from_dict({"fixed": "x", "batch_size": -3, "site": 5}) == ScriptFacts()


STUDY = """
[study]
trials = 3
confirm_top = 0
[workload]
command = {command}
[training]
train_samples = 768
batch_size = 32
[space]
batch_size = [32, 64]
num_workers = {{ min = 0, max = 1 }}
prefetch_factor = {{ min = 1, max = 2 }}
"""


@pytest.mark.slow  # a whole study of several command trials
@pytest.mark.timeout(240)
def test_a_study_over_a_batch_sampler_script_says_it_keeps_its_batch_size(
    tmp_path: Path, sqlite_url: str
) -> None:
    script = _script(tmp_path, BATCH_SAMPLER)
    config = tmp_path / "study.toml"
    config.write_text(STUDY.format(command=json.dumps([sys.executable, str(script)])))
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    said = ran.stdout + ran.stderr
    assert "batch_size is not searched: a batch_sampler fixes the batch size" in said
    assert said.count("batch_size is not searched") == 1
    trials = optuna.load_study(study_name="study", storage=sqlite_url).get_trials()
    assert len(trials) == 3
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert {t.params["batch_size"] for t in trials} == {24}  # the sampler's, baseline too
