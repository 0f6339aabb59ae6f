"""The default rule that finds a validation loss in a command's output when the study gives
no ``val_loss_pattern`` (`loader_search.trial._command_output` matches it, line by line, under
the same time limit as a user's pattern, which replaces it).

It reads the forms scripts and frameworks print: ``val_loss=0.5``, ``val_loss: 0.5``,
``val loss 0.5``, ``Validation loss 0.5``, ``valid_loss``, ``eval_loss`` (Hugging Face's
``{'eval_loss': 0.59, ...}``), ``val/loss``, Keras's ``- val_loss: 0.25``, Lightning's
progress bar (``v_num=0, val_loss=0.456, train_loss=0.3]``) and PyTorch's examples'
``Test set: Average loss: 0.1234, Accuracy: ...``. A training loss (``loss=0.3``,
``train_loss=0.3``, ``training loss 0.3``, ``Train Epoch: 1 ... Loss: 0.25``) never matches:
every form needs a word that names the validation right before the loss.
"""

from __future__ import annotations

import regex

# Possessive repeats (*+, ?+) never give back what they took: a line of spaces after "val_loss"
# costs one pass, not one per split of them.
# A number as Python prints one: 0.5, -0.5, 1e-3, 2.5E+01, 12, .5 (a comma after it is not
# part of it: float() reads the group).
_NUMBER = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"
# The word before "loss" that makes it a validation loss. "test_loss" is left out (only
# PyTorch's "Test set: Average loss" form is read): a script that prints its test loss beside
# its validation loss would be read at random.
_VALIDATION = r"(?:val|valid|validation|eval|evaluation)"

VAL_LOSS_RULE: tuple[regex.Pattern[str], ...] = (
    # val_loss=0.5, val_loss: 0.5, val loss 0.5, Validation Loss = 0.5, val/loss 0.5,
    # 'eval_loss': 0.59. No letter or digit before the word: "interval loss 5", "retrieval
    # loss" are no validation; an underscore may be ("avg_val_loss", "epoch_val_loss").
    regex.compile(
        rf"(?<![A-Za-z0-9]){_VALIDATION}[ _./-]?loss['\"]?+\s*+[:=]?+\s*+{_NUMBER}",
        regex.IGNORECASE,
    ),
    # PyTorch's examples (mnist and others) after each test pass.
    regex.compile(
        rf"(?<![A-Za-z0-9])(?:test|{_VALIDATION})\s+set:\s*+average\s++loss:?+\s*+{_NUMBER}",
        regex.IGNORECASE,
    ),
)
