"""A command that ends its own training at the budget: the batch that reaches it is the last,
its step ends when the script leaves the loop (a ``break``, an iterator it holds and stops
asking), and the trial completes with the window of every step and the loss reported after
it. Real scripts, real processes (`tests.test_command`'s `_job` and `_run`)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from loader_search.params import LoaderParams
from tests.test_command import _job, _run
from tests.test_inject import _run as _hook_run
from tests.test_inject import _settings, _state

VALIDATION_S = 1.5  # each validation sleeps this long: no part of it is a training step

# ``{data}`` samples, the trial's batch size, an epoch loop that counts the samples it trained
# and stops where ``{stop}`` says, then one validation and its loss.
SCRIPT = """
import argparse, time
import torch
from torch.utils.data import DataLoader, TensorDataset
import loader_search

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int)
parser.add_argument("--max-samples", type=int)
args = parser.parse_args()
max_samples = args.max_samples
torch.manual_seed(0)
x = torch.randn({data}, 8)
y = (x.sum(1) > 0).long()
train_loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
val_loader = DataLoader(TensorDataset(x[:128], y[:128]), batch_size=64)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = 0
for epoch in range(1000):
    for xb, yb in train_loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        seen += len(xb)
        time.sleep(0.002)
        if {stop}:
            break
    if {stop}:
        break
print("trained", seen, flush=True)
time.sleep({validation_s})
with torch.no_grad():
    loss = sum(torch.nn.functional.cross_entropy(model(a), b).item() for a, b in val_loader)
loader_search.report(val_loss=loss)
"""

# An endless stream the script stops itself: it holds the iterator, asks it for its
# ``{max_steps}`` batches, then validates on another loader (slowly: none of it is training).
STREAM = """
import argparse, time
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
import loader_search

class Stream(IterableDataset):
    def __iter__(self):
        while True:
            x = torch.randn(8)
            yield x, int(x.sum() > 0)

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int)
parser.add_argument("--max-steps", type=int)
args = parser.parse_args()
torch.manual_seed(0)
train_loader = DataLoader(Stream(), batch_size=args.batch_size)  # built first: the trained one
x = torch.randn(128, 8)
val_loader = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=64)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = iter(train_loader)
for step in range(args.max_steps):
    xb, yb = next(batches)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
    time.sleep(0.002)
loss = 0.0
with torch.no_grad():
    for a, b in val_loader:
        loss += torch.nn.functional.cross_entropy(model(a), b).item()
        time.sleep({validation_s} / 2)
loader_search.report(val_loss=loss)
"""


@pytest.mark.parametrize(
    ("data", "budget", "stop", "trained"),
    [
        # 16 batches of 64 are the budget exactly; the script stops on the 16th.
        pytest.param(3000, 1024, "seen >= max_samples", 1024, id="break-at-the-budget"),
        # The script would train one batch more: the hook ends its loop at the budget.
        pytest.param(3000, 1024, "seen > max_samples", 1024, id="break-one-batch-over"),
        # One epoch of 3,000 and 18 batches of the next: the budget is reached inside it.
        pytest.param(3000, 4096, "seen >= max_samples", 4152, id="break-in-a-later-epoch"),
        # Four epochs of 512 are the budget: the script stops on an epoch's last batch.
        pytest.param(512, 2048, "seen >= max_samples", 2048, id="epochs-smaller-than-it"),
    ],
)
def test_a_script_that_stops_itself_at_its_budget_completes(
    tmp_path: Path, data: int, budget: int, stop: str, trained: int
) -> None:
    script = tmp_path / "train.py"
    text = SCRIPT.format(data=data, stop=stop, validation_s=VALIDATION_S)
    script.write_text(textwrap.dedent(text))
    argv = [sys.executable, str(script), "--batch-size", "{batch_size}"]
    argv += ["--max-samples", "{train_samples}"]
    job = _job(tmp_path, argv, LoaderParams(batch_size=64), train_samples=budget)
    outcome = _run(job)
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None
    assert result.train_samples == trained
    assert result.val_loss is not None and 0 < result.val_loss < 10
    assert result.throughput_samples_per_s > 0
    # The window ends with the last step: every batch after the warm-up, and not the
    # validation after it.
    assert result.measured_samples == trained - result.warmup_batches * 64
    assert result.measured_time_s < VALIDATION_S


def test_a_stream_the_script_stops_at_its_budget_completes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(STREAM.format(validation_s=VALIDATION_S)))
    argv = [sys.executable, str(script), "--batch-size", "{batch_size}"]
    argv += ["--max-steps", "{max_steps}"]
    outcome = _run(_job(tmp_path, argv, LoaderParams(batch_size=64), train_samples=4096))
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None
    assert result.train_samples == 4096
    assert result.val_loss is not None and 0 < result.val_loss < 10
    assert result.throughput_samples_per_s > 0
    assert result.measured_samples == 4096 - result.warmup_batches * 64
    assert result.measured_time_s < VALIDATION_S


# The hook alone (`tests.test_inject`'s script and trial folder, no trial watching): a loop
# that holds its iterator and stops asking it at the budget, with no other loader after it.
HELD = """
import time
loader = DataLoader(train, batch_size=32, shuffle=True)
batches = iter(loader)
for step in range(16):  # 512 samples: the budget
    xb, yb = next(batches)
    time.sleep(0.002)
time.sleep(0.5)  # a validation without a loader
{after}
"""


def test_a_reported_loss_ends_the_last_step_of_a_held_iterator(tmp_path: Path) -> None:
    after = "report_val_loss(1.0)\ntime.sleep(0.5)  # saving the model"
    _, trial, _ = _hook_run(
        tmp_path, HELD.format(after=after), _settings(train_samples=512, inject=[])
    )
    state = _state(trial)
    assert state["budget_reached"] is True and state["samples"] == 512
    # Reached with the 16th batch, before the validation and its loss.
    assert state["budget_reached_at"] < state["val_losses"][0][0] - 0.4
    window = state["window"]
    assert window["measured_samples"] == 512 - window["warmup_batches"] * 32
    # The loss ends the window; the validation before it is in it (no other loader's batch
    # said it began), the saving after it is not.
    assert window["measured_time_s"] < 1.0


def test_the_exit_ends_the_last_step_of_a_held_iterator(tmp_path: Path) -> None:
    _, trial, _ = _hook_run(
        tmp_path, HELD.format(after=""), _settings(train_samples=512, inject=[])
    )
    state = _state(trial)
    assert state["budget_reached"] is True and state["samples"] == 512
    window = state["window"]
    assert window is not None and window["throughput"] > 0
    assert window["measured_samples"] == 512 - window["warmup_batches"] * 32


def test_a_loop_left_early_ends_its_step_there_before_the_budget(tmp_path: Path) -> None:
    _, trial, out = _hook_run(
        tmp_path,
        """
        import time
        loader = DataLoader(train, batch_size=32, shuffle=True)
        for epoch in range(2):
            for step, (xb, yb) in enumerate(loader):
                time.sleep(0.002)
                if step == 7:
                    break
            time.sleep(0.5)  # a long validation: not training time
            print("epoch", epoch, step + 1)
        """,
        _settings(train_samples=10**6, inject=[]),
    )
    assert "epoch 1 8" in out
    state = _state(trial)
    assert state["budget_reached"] is False and state["batches"] == 16
    window = state["window"]
    assert window["measured_samples"] == (16 - window["warmup_batches"]) * 32
    assert window["measured_time_s"] < 0.5  # neither validation
