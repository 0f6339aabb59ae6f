"""The training loader is the one the script trains with: the loader whose batches its optimizer
steps follow, whatever the shuffle rule first guessed; ``train_loader = N`` still wins. Real
scripts in real processes: the hook alone (its state file), and a whole command trial."""

from __future__ import annotations

import sys
from pathlib import Path

from loader_search.params import LoaderParams
from tests.test_command import _job, _run, _script, _seen
from tests.test_inject import _epochs, _line_of, _settings, _state
from tests.test_inject import _run as _run_hook

# The validation loader shuffles, the training loader does not: the shuffle rule guesses the
# validation loader. Built first, it gets the trial's settings (64) in place of its own 16.
_SHUFFLED_VALIDATION = """
val_loader = DataLoader(val, batch_size=16, shuffle=True)
loader = DataLoader(train, batch_size=32)
epochs(loader, val_loader)
print("sizes", loader.batch_size, val_loader.batch_size)
"""


def test_the_loader_the_optimizer_steps_follow_trains_not_the_shuffled_one(
    tmp_path: Path,
) -> None:
    script, trial, out = _run_hook(tmp_path, _SHUFFLED_VALIDATION, _settings())
    state = _state(trial)  # no hook error either
    assert state["train_rule"] == "optimizer_steps"
    val, train = state["loaders"]
    assert val["shuffle"] and not val["train"] and val["applied"] == {}
    assert train["train"] and not train["shuffle"]
    assert train["site"] == _line_of(script, "loader = DataLoader(train, batch_size=32)")
    assert train["applied"]["batch_size"] == 64 and train["batch_size"] == 64
    # The first step follows the first batch (32, the script's own size); from the next batch
    # the epoch is the trial's (512 / 64 = 8 batches), and the budget is the training
    # loader's: 512 + 512 + 3 * 64 = 1216 >= 1200, the later epoch empty.
    assert _epochs(out) == [9, 8, 3, 0]
    assert state["samples"] == 1216 and state["batches"] == 19 and state["budget_reached"]
    # The guessed loader is back at the script's own batch size, never cut: 8 batches of 16
    # in each of the four epochs, plus the training loader's first batch before the switch.
    assert "sizes 64 16" in out
    assert state["ticks"] == 4 * 8 + 1


def test_a_shuffled_training_loader_is_the_guess_the_steps_confirm(tmp_path: Path) -> None:
    _, trial, out = _run_hook(
        tmp_path,
        """
        val_loader = DataLoader(val, batch_size=64)
        loader = DataLoader(train, batch_size=32, shuffle=True)
        epochs(loader, val_loader)
        """,
        _settings(),
    )
    state = _state(trial)
    assert state["train_rule"] == "guess"
    assert [loader["train"] for loader in state["loaders"]] == [False, True]
    assert _epochs(out) == [8, 8, 3, 0]
    assert state["samples"] == 1216 and state["ticks"] == 4 * 2


def test_train_loader_wins_over_the_optimizer_steps(tmp_path: Path) -> None:
    # The user named the first loader: the steps after the second one's batches change nothing.
    _, trial, out = _run_hook(tmp_path, _SHUFFLED_VALIDATION, _settings(train_loader=1))
    state = _state(trial)
    assert state["train_rule"] == "train_loader"
    assert [loader["train"] for loader in state["loaders"]] == [True, False]
    assert _epochs(out) == [16, 16, 16, 16]  # the script's own 32, never cut
    assert "sizes 32 64" in out
    assert state["samples"] == 4 * 128 and state["ticks"] == 4 * 16


def test_a_command_trial_measures_the_loader_it_trains_with(tmp_path: Path) -> None:
    # The script's training loader does not shuffle; a validation loader built after it does.
    script = _script(
        tmp_path,
        "train_loader = DataLoader(train, batch_size=16)",
        before="val_loader = DataLoader(val, batch_size=64, shuffle=True)",
    )
    outcome = _run(_job(tmp_path, [sys.executable, str(script)], LoaderParams(batch_size=32)))
    assert outcome.failure is None, outcome.failure
    result = outcome.result
    assert result is not None
    assert _seen(tmp_path)["batch_size"] == 32  # the script wrote 16
    # The training budget, in the training loader's batches: 16 (the first, before the
    # switch) and then 32 at a time, so the budget is reached at most one batch past 1,024.
    assert 1024 <= result.train_samples < 1024 + 32
    assert result.loader_site == _line_of(script, "train_loader = DataLoader(train")
    assert result.throughput_samples_per_s > 0 and result.val_loss is not None
