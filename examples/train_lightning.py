"""The same training with PyTorch Lightning: `loader-search` tunes the DataLoader the script
hands to ``Trainer.fit`` and reads the ``val_loss`` the module logs, with no line for it in
the script (`examples/lightning.toml`).

    python examples/train_lightning.py
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader
from train import data_and_model  # examples/train.py


class Classifier(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.model(images), labels)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        self.log("val_loss", loss, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


if __name__ == "__main__":
    train_set, val_set, model = data_and_model(seed=0)
    trainer = pl.Trainer(
        max_epochs=1000,  # the trial's budget ends the training loader long before
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Classifier(model, lr=0.02),
        DataLoader(train_set, batch_size=64, shuffle=True, num_workers=0),
        DataLoader(val_set, batch_size=256),
    )
