"""Whole studies through the CLI of the kinds of training script people bring: a DDP script
launched by torchrun on two ranks, a Lightning script whose logged loss is read, and a script
over an IterableDataset that shards its stream across the loader's workers. Each is a real
study with a small budget and a real SQLite file."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_cli
from tests.test_command_study import EXAMPLES, _config, _no_process_left, _trials

# The venv's own torchrun (where torch's console scripts were installed), as a user types it.
TORCHRUN = Path(sys.executable).parent / "torchrun"
LAUNCH = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
# examples/flags.toml's flags, which train_ddp.py and train_iterable.py take too.
FLAGS = [
    "--batch-size", "{batch_size}", "--workers", "{num_workers}",
    "--prefetch", "{prefetch_factor}", "--persistent", "{persistent_workers}",
    "--lr", "{lr}", "--max-samples", "{train_samples}",
]  # fmt: skip


def _study(
    folder: Path,
    command: list[str],
    *,
    trials: int,
    space: str,
    training: str = "lr = 0.02",
    train_samples: int = 1024,
) -> Path:
    """`_config`'s small study with a budget and a [space] of its own."""
    path = _config(folder, command, trials=trials, training=training)
    head = path.read_text().split("[space]")[0]
    head = head.replace("train_samples = 1024\n", f"train_samples = {train_samples}\n")
    path.write_text(f"{head}[space]\n{space}\n")
    return path


def _site(script: str, text: str) -> str:
    """``file:line`` of the line of ``script`` (in examples/) that holds ``text``."""
    lines = (EXAMPLES / script).read_text().splitlines()
    return f"{EXAMPLES / script}:{next(n for n, line in enumerate(lines, 1) if text in line)}"


@pytest.mark.slow  # a whole study of torchrun trials, two ranks each
@pytest.mark.timeout(300)
def test_a_torchrun_study_measures_both_ranks_of_every_trial(
    tmp_path: Path, sqlite_url: str
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    command = [*LAUNCH, "--nproc-per-node", "{ranks}", "train_ddp.py", *FLAGS]
    # The two ranks share the budget: 1,024 samples each, 16 batches of 64 (half of 1,024
    # would leave a rank too few batches of 64 to measure).
    space = "batch_size = [32, 64]\nnum_workers = { min = 0, max = 1 }\nprefetch_factor = 2"
    config = _study(
        tmp_path,
        command,
        trials=2,
        space=space,
        training="lr = 0.02\nranks = 2",
        train_samples=2048,
    )
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "Pareto front of study (2 complete, 0 failed)" in ran.stdout
    # The recommendation as the command to run, {ranks} filled in, whole on one line however
    # long (a panel would cut it at the console's width).
    run_line = next(line for line in ran.stdout.splitlines() if "# run: " in line)
    assert f"# run: {shlex.join(LAUNCH)} --nproc-per-node 2 train_ddp.py --batch-size" in run_line
    assert run_line.rstrip().endswith("--max-samples 2048")
    trials = _trials(sqlite_url)
    assert len(trials) == 2
    for trial in trials:
        attrs = trial.user_attrs
        # Both ranks measured: the node's figures and each rank's, rank 0 first.
        assert attrs["ranks"] == 2, attrs
        per_rank = attrs["per_rank"]
        assert len(per_rank["throughput_samples_per_s"]) == 2
        assert all(rate > 0 for rate in per_rank["throughput_samples_per_s"])
        assert len(per_rank["data_wait_fraction"]) == 2
        # The node's rate is both ranks' samples over the slower window: at most their sum.
        assert 0 < trial.values[0] <= sum(per_rank["throughput_samples_per_s"]) * 1.001
        # The budget is the node's: every rank trained its half of it (at most a batch over),
        # or less in a trial stopped once measured (its batch size's loss known already).
        batch = int(trial.params["batch_size"])
        if attrs["stopped_early"]:
            assert attrs["val_loss_from"] and attrs["train_samples"] < 2048
        else:
            assert 2048 <= attrs["train_samples"] < 2048 + 2 * batch
        # Every rank's loader is built by examples/train.py's training_loader.
        assert attrs["loader_site"] == _site("train.py", "return DataLoader(")
    _no_process_left(before)


@pytest.mark.slow  # a whole study of Lightning trials
@pytest.mark.timeout(300)
def test_a_lightning_study_reads_the_loss_its_module_logs(tmp_path: Path, sqlite_url: str) -> None:
    pytest.importorskip("pytorch_lightning")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = _config(tmp_path, [sys.executable, "train_lightning.py"], trials=2, training="")
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "Pareto front of study (2 complete, 0 failed)" in ran.stdout
    trials = _trials(sqlite_url)
    # The script neither prints nor reports a loss: a trial's own is the val_loss the module
    # logs, read by the hook (a cross-entropy over 10 classes, near log(10) this early); a
    # trial stopped once measured reuses one of those.
    assert not trials[0].user_attrs["stopped_early"]  # the baseline
    for trial in trials:
        assert trial.values is not None and 0 < trial.values[1] < 10, trial.values
        if not trial.user_attrs["stopped_early"]:
            assert trial.user_attrs["val_loss"] == trial.values[1]
    # The trial's settings went into the loader handed to Trainer.fit.
    site = _site("train_lightning.py", "DataLoader(train_set")
    assert {t.user_attrs.get("loader_site") for t in trials} == {site}
    _no_process_left(before)


@pytest.mark.slow  # a whole study of command trials
@pytest.mark.timeout(240)
def test_an_iterable_dataset_study_tunes_the_loader_over_its_sharded_stream(
    tmp_path: Path, sqlite_url: str
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    command = [sys.executable, "train_iterable.py", *FLAGS]
    # Every trial after the baseline (no workers) splits the stream between its workers.
    space = "batch_size = [32, 64]\nnum_workers = { min = 1, max = 2 }\nprefetch_factor = 2"
    config = _study(tmp_path, command, trials=3, space=space)
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "Pareto front of study (3 complete, 0 failed)" in ran.stdout
    assert f"# run: {shlex.quote(sys.executable)} train_iterable.py --batch-size" in ran.stdout
    trials = _trials(sqlite_url)
    assert any(t.params.get("num_workers", 0) > 0 for t in trials)
    for trial in trials:
        # The budget ended the stream, at most one batch past it whatever the workers (a trial
        # stopped once measured, its batch size's loss known already, ended it sooner).
        attrs, batch = trial.user_attrs, int(trial.params["batch_size"])
        if not attrs["stopped_early"]:
            assert 1024 <= attrs["train_samples"] < 1024 + batch, attrs
    # A loader over a stream cannot shuffle: the first one the script builds is the training
    # one (its validation loader is built after it).
    site = _site("train_iterable.py", "train_loader = DataLoader(")
    assert {t.user_attrs.get("loader_site") for t in trials} == {site}
    _no_process_left(before)
