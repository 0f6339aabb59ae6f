"""The same training with every loader setting written in the code: `loader-search` puts the
trial's settings into its training DataLoader through a start-up hook, with no flag and no
change here (`examples/zero-code.toml`). Only the ``loader_search.report`` line (optional,
see docs/scripts.md) knows about loader-search.

    python examples/train_zero_code.py
"""

from __future__ import annotations

from torch.utils.data import DataLoader
from train import data_and_model, fit  # examples/train.py: the model, the data, the loop

if __name__ == "__main__":
    train_set, val_set, model = data_and_model(seed=0)
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True, num_workers=0)
    val_loader = DataLoader(val_set, batch_size=256)
    # The budget: the trial ends the training loader's iteration once its samples are used,
    # so this loop of many epochs reaches its validation and ends by itself.
    fit(model, train_loader, val_loader, lr=0.02, max_samples=10**9)
