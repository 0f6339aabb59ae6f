"""Whole studies of a user's own training script through the CLI: the examples' flag script and
zero-code script, `run -- COMMAND`, a worker's trust rule for a command from the database, and
the config's rules, each with real trials and a real SQLite file."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import optuna
import psutil
import pytest

from benchmarks.script import example_command
from loader_search.errors import UserError
from tests.conftest import ROOT, invoke, run_cli

EXAMPLES = ROOT / "examples"
# Small and quick: 3 search trials of 1,024 samples, no confirmation rounds.
SMALL = """
[study]
trials = {trials}
confirm_top = 0
[workload]
command = {command}
workdir = {workdir}
{extra}
[training]
train_samples = 1024
batch_size = 64
{training}
[space]
batch_size = [32, 64]
num_workers = {{ min = 0, max = 1 }}
prefetch_factor = {{ min = 1, max = 2 }}
"""
# The example's own command (examples/flags.toml), run by this interpreter.
FLAGS = list(example_command())


def _config(
    folder: Path,
    command: list[str] | str,
    *,
    trials: int = 3,
    extra: str = "",
    training: str = "lr = 0.02",
    workdir: Path = EXAMPLES,
) -> Path:
    path = folder / "study.toml"
    path.write_text(
        SMALL.format(
            trials=trials,
            command=json.dumps(command),
            workdir=json.dumps(str(workdir)),
            extra=extra,
            training=training,
        )
    )
    return path


def _no_process_left(before: set[int]) -> None:
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == []


def _trials(url: str) -> list[optuna.trial.FrozenTrial]:
    trials = optuna.load_study(study_name="study", storage=url).get_trials()
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    return trials


@pytest.mark.slow  # a whole study of several command trials
@pytest.mark.timeout(240)
def test_a_flag_script_study_runs_and_recommends_its_command_line(
    tmp_path: Path, sqlite_url: str
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = _config(tmp_path, FLAGS)
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    # The recommendation as the flags to pass, the placeholders filled in.
    assert f"# run: {shlex.quote(sys.executable)} train.py --batch-size" in ran.stdout
    assert "Pareto front of study (3 complete, 0 failed)" in ran.stdout
    sites = {t.user_attrs.get("loader_site") for t in _trials(sqlite_url)}
    assert len(sites) == 1 and str(next(iter(sites))).startswith(f"{EXAMPLES / 'train.py'}:")
    _no_process_left(before)


@pytest.mark.slow  # a whole study of several command trials
@pytest.mark.timeout(240)
def test_a_zero_code_script_study_puts_the_settings_into_its_loader(
    tmp_path: Path, sqlite_url: str
) -> None:
    config = _config(tmp_path, [sys.executable, "train_zero_code.py"], training="")
    ran = run_cli("run", str(config), "--storage", sqlite_url)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "Pareto front of study (3 complete, 0 failed)" in ran.stdout
    trials = _trials(sqlite_url)
    # Every trial's settings went into the loader the script builds on this line.
    line = next(
        n
        for n, text in enumerate((EXAMPLES / "train_zero_code.py").read_text().splitlines(), 1)
        if "train_loader = DataLoader(" in text
    )
    assert {t.user_attrs.get("loader_site") for t in trials} == {
        f"{EXAMPLES / 'train_zero_code.py'}:{line}"
    }


@pytest.mark.slow  # a whole study of several command trials
def test_run_dash_dash_names_the_study_after_the_script(tmp_path: Path, sqlite_url: str) -> None:
    script = tmp_path / "my_train.py"
    script.write_text((EXAMPLES / "train_zero_code.py").read_text())
    (tmp_path / "train.py").write_text((EXAMPLES / "train.py").read_text())
    ran = run_cli(
        "run", "--storage", sqlite_url, "--n-trials", "1", "--", sys.executable, "my_train.py",
        cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "Created study my_train" in ran.stdout
    assert "your command:" in ran.stdout


@pytest.mark.parametrize(
    ("command", "extra", "training", "words"),
    [
        (["python", "t.py", "{batch}"], "", "", "unknown placeholder {batch}"),
        (["python", "t.py", "--lr", "{lr}"], "", "", "training.lr"),
        (["python", "t.py"], "val_loss_pattern = 'val_loss'", "", "needs a group"),
        (["python", "t.py"], "train_loader = 0", "", "workload.train_loader"),
        (["python", "t.py"], "name = 'synthetic-images'", "", "workload.name"),
        ([], "", "", "workload.command"),
        ("python 't.py", "", "", "cannot be split"),
        # Only bare names are placeholders: a format spec is rendered in this process
        # (>400000000 is 400 MB of spaces), a conversion or an index breaks the value.
        (["python", "t.py", "{batch_size:>400000000}"], "", "", "only a bare {batch_size}"),
        (["python", "t.py", "{batch_size:d}"], "", "", "only a bare {batch_size}"),
        (["python", "t.py", "{batch_size!r}"], "", "", "only a bare {batch_size}"),
        (["python", "t.py", "{batch_size.real}"], "", "", "only a bare {batch_size}"),
        (["python", "t.py", "{seed[0]}"], "", "", "only a bare {seed}"),
    ],
    ids=[
        "placeholder",
        "lr",
        "pattern",
        "train_loader",
        "name",
        "empty",
        "quotes",
        "width",
        "spec",
        "conversion",
        "attribute",
        "index",
    ],
)
def test_a_bad_command_config_is_one_line(
    tmp_path: Path, command: list[str] | str, extra: str, training: str, words: str
) -> None:
    config = _config(tmp_path, command, extra=extra, training=training)
    ran = invoke("run", str(config), "--storage", f"sqlite:///{tmp_path / 'x.db'}")
    assert ran.returncode == 2
    message = ran.stderr.strip()
    assert words in message and "\n" not in message and "Traceback" not in message
    assert not (tmp_path / "x.db").exists()  # refused before anything is stored


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("", 'workload.command = "": give the command'),
        ("   ", 'workload.command = "   ": give the command'),
        (["python", ""], 'workload.command = ["python", ""]: every word'),
        ("python ''", "workload.command = \"python ''\": every word"),
        (["python", "t.py", "{batch_size!r}"], 'workload.command argument "{batch_size!r}"'),
        (["python", "t.py", "{batch}"], 'workload.command argument "{batch}"'),
    ],
    ids=["empty-string", "blank", "empty-word", "empty-quoted-word", "conversion", "unknown"],
)
def test_a_command_error_names_the_file_and_the_value_as_written(
    tmp_path: Path, command: list[str] | str, shown: str
) -> None:
    from loader_search.study import load_config

    config = _config(tmp_path, command)
    with pytest.raises(UserError) as caught:
        load_config(config)
    message = str(caught.value)
    assert message.startswith(f"{config}: {shown}"), message
    assert "\n" not in message


def test_a_pattern_error_names_the_file(tmp_path: Path) -> None:
    from loader_search.study import load_config

    config = _config(tmp_path, ["python", "t.py"], extra="val_loss_pattern = '('")
    with pytest.raises(UserError) as caught:
        load_config(config)
    assert str(caught.value).startswith(f'{config}: workload.val_loss_pattern = "(": not a regex')


@pytest.mark.timeout(120)
def test_a_formatted_placeholder_after_dash_dash_fails_at_once(tmp_path: Path) -> None:
    # The real CLI in its own process, its peak memory read from the kernel (wait4): a
    # {batch_size:>400000000} rendered would hold 400 MB of spaces before the start failed.
    # Beside it, the same refusal of a spec that allocates nothing: the imports' own peak.
    (tmp_path / "x.py").write_text("print('trained')\n")
    url = f"sqlite:///{tmp_path / 'x.db'}"

    def refused(spec: str) -> tuple[str, int]:
        argv = [sys.executable, "-m", "loader_search", "run", "--storage", url, "--"]
        argv += [sys.executable, "x.py", "--bs", spec]
        with (tmp_path / "err").open("w+") as err:
            child = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(child.pid, 0)
            err.seek(0)
            message = err.read().strip()
        assert os.waitstatus_to_exitcode(status) == 2, message
        return message, usage.ru_maxrss

    message, peak = refused("{batch_size:>400000000}")
    _, imports = refused("{batch_size:d}")
    assert "the command after --" in message and "only a bare {batch_size}" in message
    assert "\n" not in message and "Traceback" not in message
    assert peak < imports + 100_000, (peak, imports)  # KiB: far below the 400 MB string
    assert not (tmp_path / "x.db").exists()  # refused before anything is stored


def test_command_keys_without_a_command_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "study.toml"
    config.write_text("[workload]\nname = 'synthetic-images'\nval_loss_pattern = 'x(.)'\n")
    ran = invoke("run", str(config), "--storage", f"sqlite:///{tmp_path / 'x.db'}")
    assert ran.returncode == 2 and "applies only with workload.command" in ran.stderr


@pytest.mark.slow  # a whole study of several command trials
@pytest.mark.timeout(240)
def test_a_worker_runs_a_stored_command_only_when_named(tmp_path: Path, sqlite_url: str) -> None:
    config = _config(tmp_path, FLAGS, trials=1)
    created = invoke("init", str(config), "--storage", sqlite_url)
    assert created.returncode == 0, created.stdout
    refused = invoke("worker", "study", "--storage", sqlite_url)
    assert refused.returncode == 2
    assert "--allow-command" in refused.stderr and "\n" not in refused.stderr.strip()
    other = invoke("worker", "study", "--storage", sqlite_url, "--allow-command", "python x.py")
    assert other.returncode == 2
    allow = ["--allow-command", shlex.join(FLAGS)]
    elsewhere = invoke("worker", "study", "--storage", sqlite_url, *allow)
    assert elsewhere.returncode == 2 and "--workdir" in elsewhere.stderr  # its folder is its own
    allowed = run_cli(
        "worker", "study", "--storage", sqlite_url, "--allow-command", shlex.join(FLAGS),
        "--workdir", str(EXAMPLES),
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "1 complete" in allowed.stdout


def test_the_recommended_command_line_has_the_studys_values() -> None:
    from loader_search.params import LoaderParams
    from loader_search.study.stats._recommend import command_line

    stored = {"command": ["torchrun", "--nproc-per-node", "{ranks}", "t.py", "--lr", "{lr}"]}
    training = {"train_samples": 4096, "batch_size": 64, "lr": 0.1, "ranks": 2}
    line = command_line(stored, training, LoaderParams(batch_size=256))
    assert line == "torchrun --nproc-per-node 2 t.py --lr 0.2"  # sqrt scaling: 0.1 x 2
    assert command_line({"command": 5}, training, LoaderParams(batch_size=64)) is None
    # A stored command that no config reader checked (the database is written by other
    # hands): a format spec is not rendered (400 MB of spaces), the line is left out.
    wide = {"command": ["python", "t.py", "--bs", "{batch_size:>400000000}"]}
    assert command_line(wide, training, LoaderParams(batch_size=64)) is None


def test_one_executable_word_is_a_command_and_any_other_a_config_file(tmp_path: Path) -> None:
    program = tmp_path / "train.sh"
    program.write_text("#!/bin/sh\necho 'no training here'\nexit 3\n")
    program.chmod(0o755)
    url = f"sqlite:///{tmp_path / 'x.db'}"
    ran = invoke("run", "--storage", url, "--n-trials", "1", "--", str(program), cwd=tmp_path)
    # It ran (and failed as a command does), not read as a config file.
    assert ran.returncode == 1 and "exited with status 3" in ran.stderr, ran.stderr
    plain = tmp_path / "settings.txt"
    plain.write_text("not a study\n")
    read = invoke("run", "--storage", url, str(plain), cwd=tmp_path)
    assert read.returncode == 2 and "settings.txt" in read.stderr


def test_a_literal_brace_lr_is_no_placeholder(tmp_path: Path) -> None:
    from loader_search.study import load_config

    # `{{lr}}` is the text {lr}, not the placeholder: no [training] lr is needed for it.
    config = load_config(_config(tmp_path, ["python", "t.py", "--tag", "{{lr}}"], training=""))
    assert config.command is not None and "lr" not in config.command.placeholders
    with pytest.raises(UserError, match=r"training\.lr"):
        load_config(_config(tmp_path, ["python", "t.py", "--lr", "{lr}"], training=""))


# A script that only prints its losses, as most do: the training loss on every step, then
# the validation's as ``--says`` gives it (a fixed number, so that every trial's loss is
# known). Its epoch loop ends at an epoch without batches: once the budget is used, the
# hook's loader yields nothing.
PRINTS = """
import argparse
import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--says", default="val_loss=0.2103")
args = parser.parse_args()
torch.manual_seed(0)
x = torch.randn(512, 8)
y = (x.sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(1000):
    steps = 0
    for xb, yb in loader:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        steps += 1
        print(f"epoch {epoch} step {steps} loss={loss.item():.4f} train_loss=0.9", flush=True)
    print(f"Train Epoch: {epoch} Loss: 0.8", flush=True)
    print(f"epoch {epoch} {args.says}", flush=True)
    if steps == 0:
        break
"""


@pytest.mark.slow  # a whole study of a command
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("options", "says", "loss"),
    [
        ([], "val_loss=0.2103", 0.2103),
        # The own pattern replaces the rule: its val_loss= is not read.
        (["--val-loss-pattern", r"VL ([0-9.]+)"], "val_loss=0.2103 VL 0.31", 0.31),
    ],
    ids=["printed", "own pattern"],
)
def test_run_dash_dash_reads_the_printed_validation_loss(
    tmp_path: Path, sqlite_url: str, options: list[str], says: str, loss: float
) -> None:
    (tmp_path / "train.py").write_text(PRINTS)
    # One trial, the baseline: it reads its own loss (a later trial of its batch size stops
    # once measured and reuses it), in about 30 s.
    ran = run_cli(
        "run", "--storage", sqlite_url, "--n-trials", "1", *options, "--", sys.executable,
        "train.py", "--batch-size", "{batch_size}", "--says", says, cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    (trial,) = optuna.load_study(study_name="train", storage=sqlite_url).get_trials()
    assert trial.state == optuna.trial.TrialState.COMPLETE
    # Never a training loss (0.9, 0.8, a step's): the printed validation loss.
    assert trial.values[1] == trial.user_attrs["val_loss"] == loss, trial.values
    assert f"val_loss {loss}" in ran.stdout


def test_a_val_loss_pattern_option_with_a_config_file_is_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path, FLAGS)
    url = f"sqlite:///{tmp_path / 'x.db'}"
    ran = invoke("run", str(config), "--storage", url, "--val-loss-pattern", "VL (.+)")
    assert ran.returncode == 2
    message = ran.stderr.strip()
    assert "[workload] val_loss_pattern" in message and str(config) in message
    assert "\n" not in message and not (tmp_path / "x.db").exists()
