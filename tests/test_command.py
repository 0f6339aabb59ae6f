"""A trial that runs the user's own training command: real scripts in real processes, the
settings passed as flags or injected into the script's DataLoader by the start-up hook, the
throughput read in the script's own loop, and every way such a command can end classified,
with nothing of it left running."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from loader_search.errors import UserError
from loader_search.params import LoaderParams, RunPlan, TrainingSettings, TrialLimits
from loader_search.trial import CommandSpec, TrialJob, TrialOutcome, run_isolated
from loader_search.trial._placeholders import (
    placeholder_values,
    placeholders_in,
    render_command,
    to_inject,
)

# A small training script: a TensorDataset, a linear model, an epoch loop with a validation
# pass after each epoch. ``{flags}`` and ``{loader}`` are filled in per test.
SCRIPT = """
import argparse, json, os, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
import loader_search

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--prefetch", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--epochs", type=int, default=1000)
parser.add_argument("--report", default="api")
args = parser.parse_args()
torch.manual_seed(0)
x = torch.randn(512, 8)
y = (x.sum(1) > 0).long()
train = TensorDataset(x, y)
val = TensorDataset(x[:128], y[:128])
{loader}
val_loader = DataLoader(val, batch_size=64)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
{before}
for epoch in range(args.epochs):
    seen = 0
    for xb, yb in train_loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        seen += len(xb)
        time.sleep(0.002)
    with torch.no_grad():
        loss = sum(torch.nn.functional.cross_entropy(model(a), b).item() for a, b in val_loader)
    with open("seen.tmp", "w") as f:  # replaced whole: the trial may stop it at any time
        json.dump(dict(batch_size=train_loader.batch_size, workers=train_loader.num_workers,
                       epoch=epoch, seen=seen, env=sorted(os.environ)), f)
    os.replace("seen.tmp", "seen.json")
    if args.report == "api":
        loader_search.report(val_loss=loss)
    elif args.report == "print":
        print(f"epoch {{epoch}} val_loss={{loss:.6f}}", flush=True)
    {after}
"""
# The flags go straight into the DataLoader: a trial without workers renders
# {prefetch_factor} as 2, which the hook drops there (torch refuses it without workers).
FLAG_LOADER = (
    "train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True,"
    " num_workers=args.workers, prefetch_factor=args.prefetch)"
)
PLAIN_LOADER = "train_loader = DataLoader(train, batch_size=16, shuffle=True)"


def _script(folder: Path, loader: str = FLAG_LOADER, before: str = "", after: str = "") -> Path:
    path = folder / "train.py"
    path.write_text(textwrap.dedent(SCRIPT.format(loader=loader, before=before, after=after)))
    return path


def _job(
    folder: Path,
    argv: list[str],
    params: LoaderParams | None = None,
    *,
    train_samples: int = 1024,
    pattern: str | None = None,
    plan: RunPlan | None = None,
) -> TrialJob:
    return TrialJob(
        None,
        params or LoaderParams(batch_size=32),
        TrainingSettings(train_samples=train_samples, batch_size=32, lr=0.1, warmup_batches=2),
        "cpu",
        plan=plan or RunPlan(),
        command=CommandSpec(tuple(argv), str(folder), val_loss_pattern=pattern),
    )


def _run(job: TrialJob, timeout_s: float = 60.0) -> TrialOutcome:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=timeout_s))
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], f"processes of the command left running: {left}"
    return outcome


def _seen(folder: Path) -> dict[str, object]:
    return json.loads((folder / "seen.json").read_text())  # type: ignore[no-any-return]


def test_a_flag_script_trains_with_the_trials_flags_and_reports_its_loss(
    tmp_path: Path,
) -> None:
    script = _script(tmp_path)
    argv = [sys.executable, str(script), "--batch-size", "{batch_size}", "--workers"]
    argv += ["{num_workers}", "--prefetch", "{prefetch_factor}", "--lr", "{lr}"]
    params = LoaderParams(batch_size=64, num_workers=1, prefetch_factor=2)
    outcome = _run(_job(tmp_path, argv, params))
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None
    seen = _seen(tmp_path)
    assert (seen["batch_size"], seen["workers"]) == (64, 1)
    # The budget (1,024 samples of 512 an epoch) ended in the second epoch; the epochs after
    # it are empty until the trial, which has the loss it needs, stops the script.
    assert isinstance(seen["epoch"], int) and seen["epoch"] >= 1
    assert result.throughput_samples_per_s > 0 and result.measured_samples > 0
    assert result.train_samples >= 1024
    assert result.val_loss is not None and 0 < result.val_loss < 10
    assert result.loader_site is not None and result.loader_site.startswith(f"{script}:")
    without = _run(_job(tmp_path, argv, LoaderParams(batch_size=64)))
    assert without.failure is None, without.failure  # prefetch 2 with 0 workers: dropped
    assert _seen(tmp_path)["workers"] == 0


def test_a_script_without_flags_gets_the_settings_in_its_dataloader(tmp_path: Path) -> None:
    script = _script(tmp_path, PLAIN_LOADER)
    params = LoaderParams(batch_size=32, num_workers=2, prefetch_factor=2)
    outcome = _run(_job(tmp_path, [sys.executable, str(script)], params))
    assert outcome.failure is None, outcome.failure
    seen = _seen(tmp_path)
    assert (seen["batch_size"], seen["workers"]) == (32, 2)  # the script wrote 16 and 0
    assert outcome.result is not None and outcome.result.val_loss is not None


@pytest.mark.parametrize("pattern", [r"val_loss=([-+0-9.eE]+)", None], ids=["own", "default"])
def test_the_validation_loss_can_come_from_the_output(tmp_path: Path, pattern: str | None) -> None:
    # Without a pattern, the default rule reads the script's "epoch 3 val_loss=0.693147".
    script = _script(tmp_path)
    argv = [sys.executable, str(script), "--report", "print"]
    outcome = _run(_job(tmp_path, argv, pattern=pattern))
    assert outcome.failure is None, outcome.failure
    assert outcome.result is not None and outcome.result.val_loss is not None


def test_a_throughput_only_plan_stops_the_command_after_the_window(tmp_path: Path) -> None:
    # The script would sleep for ever after its budget: the trial needs no validation.
    script = _script(tmp_path, before="", after="time.sleep(3600)")
    plan = RunPlan(short_samples=512, stop_early=True)
    started = time.perf_counter()
    outcome = _run(_job(tmp_path, [sys.executable, str(script), "--report", "none"], plan=plan))
    assert outcome.failure is None, outcome.failure
    assert outcome.result is not None and outcome.result.val_loss is None
    assert time.perf_counter() - started < 60


def test_secrets_never_reach_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOADER_SEARCH_STORAGE", "postgresql://u:hunter2@db/x")
    monkeypatch.setenv("PGPASSWORD", "hunter2")
    script = _script(tmp_path)
    outcome = _run(_job(tmp_path, [sys.executable, str(script)]))
    assert outcome.failure is None, outcome.failure
    env = _seen(tmp_path)["env"]
    assert isinstance(env, list)
    assert "LOADER_SEARCH_STORAGE" not in env and "PGPASSWORD" not in env
    assert "LOADER_SEARCH_TRIAL_DIR" in env


WAITS = ("timeout", "budget_not_honoured")


@pytest.mark.parametrize(
    ("before", "after", "report", "reason", "words"),
    [
        ("raise RuntimeError('boom in the script')", "", "api", "exception", "boom in the script"),
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
            "",
            "api",
            "crashed",
            "SIGSEGV",
        ),
        ("time.sleep(3600)", "", "api", "timeout", "no training progress"),
        ("", "", "none", "no_val_loss", "without reporting"),
        ("", "time.sleep(3600) if epoch >= 2 else None", "none", "budget_not_honoured", "nor"),
        ("", "break", "api", "budget_not_honoured", "of its 1,024"),
    ],
    ids=["raises", "segfault", "hangs", "never reports", "never ends", "ends early"],
)
def test_every_way_a_command_fails_is_classified(
    tmp_path: Path, before: str, after: str, report: str, reason: str, words: str
) -> None:
    script = _script(tmp_path, before=before, after=after)
    argv = [sys.executable, str(script), "--report", report]
    started = time.perf_counter()
    # A short no-progress limit where the case waits for it; else room for a loaded machine.
    outcome = _run(_job(tmp_path, argv), timeout_s=5.0 if reason in WAITS else 30.0)
    assert outcome.result is None
    assert outcome.failure is not None
    assert (outcome.failure.reason, words in outcome.failure.message) == (reason, True), (
        outcome.failure
    )
    assert time.perf_counter() - started < 40


def test_a_script_that_builds_no_loader_fails_as_not_applied(tmp_path: Path) -> None:
    script = tmp_path / "nothing.py"
    script.write_text("import torch\nprint('no loader here')\n")
    outcome = _run(_job(tmp_path, [sys.executable, str(script)]))
    assert outcome.failure is not None and outcome.failure.reason == "not_applied"
    assert "no loader here" in outcome.failure.traceback


def test_a_grandchild_that_outlives_the_command_is_stopped(tmp_path: Path) -> None:
    # A daemon in a session of its own: the process group kill alone would miss it.
    spawn = (
        "import subprocess; p = subprocess.Popen(['sleep', '300'], start_new_session=True);"
        " open('grandchild.pid', 'w').write(str(p.pid))"
    )
    script = _script(tmp_path, before=spawn, after="time.sleep(1)")
    outcome = _run(_job(tmp_path, [sys.executable, str(script)]))
    assert outcome.failure is None, outcome.failure
    pid = int((tmp_path / "grandchild.pid").read_text())
    deadline = time.time() + 10
    while psutil.pid_exists(pid) and time.time() < deadline:
        time.sleep(0.1)
    gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert gone


def test_placeholders_render_as_ordinary_flags() -> None:
    argv = ["train.py", "--bs={batch_size}", "{prefetch_factor}", "{pin_memory}", "{lr}"]
    argv += ["{persistent_workers}", "{max_steps}", "{{literal}}"]
    settings = TrainingSettings(train_samples=1000, batch_size=32, lr=0.1, lr_scaling="linear")
    filled = placeholder_values(LoaderParams(batch_size=64, pin_memory=True), settings, ranks=1)
    assert render_command(argv, filled) == [
        "train.py",
        "--bs=64",
        "2",
        "1",
        "0.2",
        "0",
        "16",
        "{literal}",
    ]
    assert to_inject(argv) == ["num_workers"]  # the only loader setting without a flag
    assert placeholders_in(["x"]) == set()


@pytest.mark.parametrize(
    ("arg", "words"),
    [
        ("{batch}", "unknown placeholder {batch}"),
        ("{batch_size", "literal brace"),
        ("{batch_size:>9}", "only a bare {batch_size}"),
        ("--n={ranks!s}", "only a bare {ranks}"),
    ],
)
def test_a_bad_placeholder_is_one_line_naming_it(arg: str, words: str) -> None:
    with pytest.raises(UserError, match=r"workload\.command") as caught:
        placeholders_in(["train.py", arg])
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_lr_without_the_scripts_learning_rate_is_refused() -> None:
    filled = placeholder_values(LoaderParams(batch_size=64), TrainingSettings(), ranks=1)
    with pytest.raises(UserError, match=r"\[training\] lr"):
        render_command(["train.py", "--lr", "{lr}"], filled)


def test_a_command_that_cannot_start_fails_naming_it(tmp_path: Path) -> None:
    outcome = _run(_job(tmp_path, [str(tmp_path / "no-such-program")]))
    assert outcome.failure is not None and outcome.failure.reason == "exception"
    assert "no-such-program" in outcome.failure.message


def test_no_trial_folder_is_left_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    script = _script(tmp_path, before="raise SystemExit(3)")
    outcome = _run(_job(tmp_path, [sys.executable, str(script)]))
    assert outcome.failure is not None
    assert [name for name in os.listdir(temp) if name.startswith("loader-search")] == []


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow  # a framework's or torchrun's own start-up, seconds a trial
@pytest.mark.timeout(180)
def test_a_torchrun_trial_measures_every_rank_of_the_ddp_example() -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{ranks}"]
    argv += ["train_ddp.py", "--batch-size", "{batch_size}", "--workers", "{num_workers}"]
    argv += ["--max-samples", "{train_samples}"]
    job = TrialJob(
        None,
        LoaderParams(batch_size=32),
        TrainingSettings(train_samples=1024, batch_size=32, warmup_batches=2, ranks=2),
        "cpu",
        command=CommandSpec(tuple(argv), str(EXAMPLES)),
    )
    outcome = _run(job, timeout_s=90.0)
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None and result.ranks == 2 and result.per_rank is not None
    assert len(result.per_rank["throughput_samples_per_s"]) == 2
    # Each rank trained its share, 512, and the node's figure counts both.
    assert result.train_samples >= 1024 and result.val_loss is not None
    # Built by examples/train.py's training_loader, with the rank's DistributedSampler.
    assert result.loader_site is not None and result.loader_site.startswith(
        f"{EXAMPLES / 'train.py'}:"
    )


SHARDED = """
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
import loader_search

class Stream(IterableDataset):
    # Shards by worker, as WebDataset does: each worker yields every n-th sample.
    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, 10**9, step):
            x = torch.randn(8)
            yield x, int(x.sum() > 0)

model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Stream(), batch_size=16, num_workers=2)
for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
with torch.no_grad():
    xv = torch.randn(256, 8)
    loss = torch.nn.functional.cross_entropy(model(xv), (xv.sum(1) > 0).long())
    loader_search.report(val_loss=loss)  # a one-element tensor is a number too
"""


def test_an_endless_sharded_stream_ends_at_the_budget(tmp_path: Path) -> None:
    # An IterableDataset with no end: the hook ends its iteration once the budget is used,
    # and the loader built without shuffle is the training loader (the first built).
    script = tmp_path / "stream.py"
    script.write_text(SHARDED)
    params = LoaderParams(batch_size=16, num_workers=2, prefetch_factor=2)
    outcome = _run(_job(tmp_path, [sys.executable, str(script)], params, train_samples=800))
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None and 800 <= result.train_samples < 800 + 16
    assert result.val_loss is not None and result.throughput_samples_per_s > 0


def test_a_loader_whose_batches_hold_no_tensor_fails_at_once_naming_it(tmp_path: Path) -> None:
    # Its samples cannot be counted, so the budget could never end the loop: the trial fails
    # at once rather than at the no-progress limit.
    script = tmp_path / "words.py"
    script.write_text(
        "from torch.utils.data import DataLoader\n"
        "for epoch in range(10**6):\n"
        "    for batch in DataLoader(['a', 'b', 'c', 'd'] * 64, batch_size=4, shuffle=True):\n"
        "        pass\n"
    )
    started = time.perf_counter()
    outcome = _run(_job(tmp_path, [sys.executable, str(script)]), timeout_s=60.0)
    assert outcome.failure is not None and outcome.failure.reason == "not_applied"
    assert "counting a batch's samples" in outcome.failure.message
    assert time.perf_counter() - started < 30


KILLED_RANK = """
import os, signal
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
dist.init_process_group("gloo")
data = TensorDataset(torch.randn(4096, 8), torch.randint(0, 2, (4096,)))
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, shuffle=True))
for step, (x, y) in enumerate(loader):
    if dist.get_rank() == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(x.sum())
"""


@pytest.mark.slow  # a framework's or torchrun's own start-up, seconds a trial
@pytest.mark.timeout(120)
def test_a_killed_torchrun_rank_is_no_out_of_memory_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(KILLED_RANK)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    outcome = _run(_job(tmp_path, argv), timeout_s=60.0)
    assert outcome.failure is not None
    assert outcome.failure.reason not in ("host_oom", "timeout"), outcome.failure
    assert "SIGKILL" in outcome.failure.traceback or "Signal 9" in outcome.failure.traceback


def _lightning_job(argv: list[str], folder: Path, samples: int) -> TrialJob:
    """A trial of batches of 32 with a loader worker, for a Lightning script written for 64."""
    return TrialJob(
        None,
        LoaderParams(batch_size=32, num_workers=1, prefetch_factor=2),
        TrainingSettings(train_samples=samples, batch_size=64, warmup_batches=2),
        "cpu",
        command=CommandSpec(tuple(argv), str(folder)),
    )


@pytest.mark.slow  # a framework's or torchrun's own start-up, seconds a trial
@pytest.mark.timeout(180)
def test_a_lightning_script_is_tuned_and_its_logged_loss_read() -> None:
    pytest.importorskip("pytorch_lightning")
    job = _lightning_job([sys.executable, "train_lightning.py"], EXAMPLES, 1024)
    outcome = _run(job, timeout_s=90.0)
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    # The loss the module logs (no report call in the script), after the budget.
    assert result is not None and result.val_loss is not None and 0 < result.val_loss < 10
    assert result.loader_site is not None and "train_lightning.py:" in result.loader_site
    assert 1024 <= result.train_samples < 1024 + 32


LIGHTNING_DDP = """
import sys
sys.path.insert(0, {examples!r})
import pytorch_lightning as pl
from torch.utils.data import DataLoader
from train import data_and_model
from train_lightning import Classifier

if __name__ == "__main__":
    train_set, val_set, model = data_and_model(seed=0)
    trainer = pl.Trainer(
        max_epochs=1000, accelerator="cpu", devices=2, strategy="ddp", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(
        Classifier(model, lr=0.02),
        DataLoader(train_set, batch_size=64, shuffle=True, num_workers=0),
        DataLoader(val_set, batch_size=256),
    )
"""


@pytest.mark.slow  # a framework's own start-up and two ranks, seconds a trial
@pytest.mark.timeout(240)
def test_lightning_ddp_re_creates_the_loader_in_every_rank_and_keeps_the_trials_settings(
    tmp_path: Path,
) -> None:
    # Lightning's DDP starts the second rank as a new process of the same script and, in
    # each rank, re-creates the script's DataLoader with a DistributedSampler: the hook sees
    # both ranks, and the re-created loader keeps the trial's batch size and workers.
    pytest.importorskip("pytorch_lightning")
    script = tmp_path / "ddp_lightning.py"
    script.write_text(LIGHTNING_DDP.format(examples=str(EXAMPLES)))
    job = _lightning_job([sys.executable, str(script)], tmp_path, 2048)
    outcome = _run(job, timeout_s=120.0)
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None and result.ranks == 2 and result.per_rank is not None
    # Each rank trained its share of the budget in batches of the trial's 32, not the 64
    # the script wrote: 1,024 samples a rank, at most one batch over.
    assert 2048 <= result.train_samples <= 2048 + 2 * 32
    assert result.val_loss is not None and 0 < result.val_loss < 10
    assert result.loader_site is not None and "ddp_lightning.py:" in result.loader_site


def test_a_setting_the_training_loader_cannot_take_fails_naming_it(tmp_path: Path) -> None:
    # A batch_sampler fixes the batch size: injecting another is impossible, and measuring
    # the script's own would be a silent no-op.
    loader = (
        "from torch.utils.data import BatchSampler, RandomSampler\n"
        "train_loader = DataLoader(train, batch_sampler=BatchSampler("
        "RandomSampler(train), batch_size=16, drop_last=False))"
    )
    script = _script(tmp_path, loader)
    outcome = _run(_job(tmp_path, [sys.executable, str(script)], LoaderParams(batch_size=64)))
    assert outcome.failure is not None and outcome.failure.reason == "not_applied"
    assert "batch_size cannot reach" in outcome.failure.message
    assert "batch_sampler fixes the batch size" in outcome.failure.message
    # The trial of the batch size the sampler has measures the script as it is.
    same = _run(_job(tmp_path, [sys.executable, str(script)], LoaderParams(batch_size=16)))
    assert same.failure is None, same.failure


def test_a_loader_re_created_over_the_same_data_keeps_the_trials_settings(
    tmp_path: Path,
) -> None:
    # As Lightning re-creates the user's loader with a DistributedSampler: the loader the
    # script iterates is a second one, over the training loader's own data set.
    loader = (
        "first = DataLoader(train, batch_size=16, shuffle=True)\n"
        "from torch.utils.data import RandomSampler\n"
        "train_loader = DataLoader(first.dataset, batch_size=16, sampler=RandomSampler(train))"
    )
    script = _script(tmp_path, loader)
    params = LoaderParams(batch_size=32, num_workers=1, prefetch_factor=2)
    outcome = _run(_job(tmp_path, [sys.executable, str(script)], params))
    assert outcome.failure is None, outcome.failure
    assert (_seen(tmp_path)["batch_size"], _seen(tmp_path)["workers"]) == (32, 1)


HF_TRAINER = """
import sys
import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 100, (n, 16), generator=g)
        self.labels = (self.ids[:, 0] > 50).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
                "labels": self.labels[i]}


config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=32, num_labels=2)
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=16,
                         num_train_epochs=50, eval_strategy="epoch", save_strategy="no",
                         report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True)
Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Tokens(512, 0),
        eval_dataset=Tokens(128, 1)).train()
"""


@pytest.mark.slow  # a framework's or torchrun's own start-up, seconds a trial
@pytest.mark.timeout(180)
def test_a_hugging_face_trainer_is_tuned_and_its_eval_loss_read(tmp_path: Path) -> None:
    # The Trainer builds its loaders from TrainingArguments; the hook finds the training one
    # (a RandomSampler) and reads the eval_loss each evaluation logs.
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = tmp_path / "hf.py"
    script.write_text(HF_TRAINER)
    params = LoaderParams(batch_size=32, num_workers=1, prefetch_factor=2)
    argv = [sys.executable, str(script), str(tmp_path / "out")]
    outcome = _run(_job(tmp_path, argv, params), timeout_s=90.0)
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None and result.val_loss is not None and 0 < result.val_loss < 5
    assert result.train_samples == 1024  # 32 batches of 32: the trial's batch size
    assert result.loader_site is not None and "transformers" in result.loader_site
