"""The default rule that reads a validation loss from a command's output without a
``val_loss_pattern``: the lines real scripts and frameworks print, each read to its number,
and no training loss ever read; then the rule through the output reader, and a user's own
pattern replacing it."""

from __future__ import annotations

import os
import threading

import pytest
import regex

from loader_search.trial._command_output import Output
from loader_search.trial._command_val_loss import VAL_LOSS_RULE


def _read(line: str) -> float | None:
    for pattern in VAL_LOSS_RULE:
        if found := pattern.search(line):
            return float(found.group(1))
    return None


@pytest.mark.parametrize(
    ("line", "value"),
    [
        ("epoch 3 val_loss=0.5", 0.5),
        ("epoch 3: val_loss: 0.5", 0.5),
        ("val loss 0.5", 0.5),
        ("validation loss 0.5", 0.5),
        ("Validation Loss: 0.5", 0.5),
        ("epoch 1 valid_loss 0.75", 0.75),
        ("eval_loss = 0.5", 0.5),
        # Hugging Face's Trainer after an evaluation.
        (
            "{'eval_loss': 0.59, 'eval_runtime': 1.2345, 'eval_samples_per_second': 810.2,"
            " 'eval_steps_per_second': 101.3, 'epoch': 1.0}",
            0.59,
        ),
        # PyTorch's examples (mnist) after each test pass.
        ("Test set: Average loss: 0.1234, Accuracy: 9823/10000 (98%)", 0.1234),
        # Lightning's progress bar, the validation's loss logged with prog_bar=True.
        (
            "Epoch 0: 100%|██████████| 16/16 [00:00<00:00, 41.02it/s, v_num=0, val_loss=0.456,"
            " train_loss=0.3]",
            0.456,
        ),
        # Keras's epoch line: the training loss first, the validation's after it.
        ("32/32 - 1s - loss: 0.3012 - val_loss: 0.2500", 0.25),
        ("val/loss 0.5", 0.5),
        ("epoch 2 avg_val_loss=0.5", 0.5),
        ("val_loss=1e-3", 1e-3),
        ("val_loss=2.5E+01", 25.0),
        ("val_loss=-0.5", -0.5),
        ("val_loss: 0.25, val_acc: 0.9", 0.25),
        ("val_loss=12", 12.0),
    ],
)
def test_the_rule_reads_a_printed_validation_loss(line: str, value: float) -> None:
    assert _read(line) == pytest.approx(value)


@pytest.mark.parametrize(
    "line",
    [
        "loss=0.3",
        "step 10 loss: 0.3",
        "train_loss=0.3",
        "training loss 0.3",
        "Train Epoch: 1 [0/60000 (0%)]\tLoss: 0.250000",
        # Lightning before any validation: its training loss only.
        "Epoch 0:  50%|█████     | 8/16 [00:00<00:00, 40.00it/s, v_num=0, train_loss=0.3]",
        # Hugging Face's Trainer while it trains.
        "{'loss': 0.3012, 'grad_norm': 1.5, 'learning_rate': 5e-05, 'epoch': 0.5}",
        "32/32 - 1s - loss: 0.3012 - accuracy: 0.9",
        # A word that only ends in "val", and one that only starts with "valid".
        "interval loss 5",
        "retrieval loss 0.3",
        "invalid loss 0.3",
        # Keras's checkpoint line: no number right after the loss's name.
        "Epoch 1: val_loss improved from inf to 0.35000, saving model to best.h5",
        "val_accuracy=0.9",
        "test_loss=0.3",
    ],
)
def test_the_rule_never_reads_a_training_loss(line: str) -> None:
    assert _read(line) is None


def _output_of(text: bytes, pattern: str | None = None) -> Output:
    output = Output(regex.compile(pattern) if pattern is not None else None)
    out, into = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(into, text), os.close(into)))
    writer.start()
    output.read(out, threading.Event())
    writer.join()
    os.close(out)
    return output


def test_without_a_pattern_the_reader_reads_the_rule_and_only_validation_lines() -> None:
    text = (
        b"Train Epoch: 1 [0/512 (0%)]\tLoss: 0.693147\n"
        b"Test set: Average loss: 0.6012, Accuracy: 300/512 (59%)\n"
        b"epoch 1 train_loss=0.55\n"
        b"epoch 1 val_loss=0.2103\n"
    )
    output = _output_of(text)
    assert [value for _, value in output.losses] == [0.6012, 0.2103]
    assert output.slow_matches == 0


def test_a_progress_bar_is_read_at_its_last_update() -> None:
    # tqdm redraws with carriage returns on one line: its first update shows the previous
    # validation's loss, its last one the new.
    bar = "Epoch 1: {}%|, v_num=0, val_loss={}, train_loss=0.3]"
    text = "\r".join([bar.format(50, 0.9), bar.format(100, 0.9), bar.format(100, 0.456)])
    output = _output_of(text.encode() + b"\n")
    assert [value for _, value in output.losses] == [0.456]


def test_a_users_pattern_replaces_the_rule() -> None:
    output = _output_of(b"epoch 1 val_loss=0.2103\nVL 0.31\n", pattern=r"VL ([0-9.]+)")
    assert [value for _, value in output.losses] == [0.31]
