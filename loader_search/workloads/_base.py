"""The `Workload` type: what a study trains. Built-ins and users' plug-ins return one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (model, batch) -> the batch's mean loss, a scalar tensor
StepFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]


def sgd_momentum(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The default optimiser: SGD with momentum 0.9."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@dataclass(frozen=True)
class Workload:
    """A model and its data, as a training run needs them.

    Every trial calls ``make_model()`` for a fresh model (seeded identically, so trials start
    from the same weights) and ``make_optimizer(model.parameters(), lr)`` with ``base_lr``
    scaled for the trial's batch size. By default datasets yield ``(inputs, targets)`` pairs
    that the default collate (or ``collate_fn``) stacks into tensors, and
    ``loss_fn(model(inputs), targets)`` is the batch's mean loss.

    A step of your own, for batches of any structure (a dict of tensors, a dataclass, ...):
    ``train_step(model, batch)`` returns the batch's mean loss as a scalar tensor (the service
    runs the backward pass, gradient scaling and accumulation, and the optimizer step; the
    batch is already on the device, under the study's autocast); ``eval_step(model, batch)``
    the same for validation (default: ``train_step`` under ``torch.no_grad()``); and
    ``batch_size_of(batch)`` its number of samples (default: the first dimension of the first
    tensor found). A Hugging Face-style model: ``train_step=lambda model, batch:
    model(**batch).loss``.

    A plug-in is a function returning a Workload, named as ``package.module:function`` or
    ``path/to/file.py:function``; options from the study config's ``[workload.options]`` are
    passed to it as keyword arguments.
    """

    name: str
    train_dataset: Dataset[Any]
    val_dataset: Dataset[Any]
    make_model: Callable[[], nn.Module]
    loss_fn: LossFn = nn.functional.cross_entropy
    make_optimizer: OptimizerFactory = sgd_momentum
    base_lr: float = 0.05
    collate_fn: Callable[[list[Any]], Any] | None = None
    train_step: StepFn | None = None
    eval_step: StepFn | None = None
    batch_size_of: Callable[[Any], int] | None = None
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.make_model):
            raise TypeError("Workload.make_model must be a callable returning an nn.Module")
        for name in ("train_step", "eval_step", "batch_size_of"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"Workload.{name} must be callable or None")
        if not self.base_lr > 0:
            raise ValueError(f"Workload.base_lr must be positive, got {self.base_lr}")
        for name in ("train_dataset", "val_dataset"):
            dataset = getattr(self, name)
            if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
                raise TypeError(f"Workload.{name} must be a map-style Dataset (with __len__)")
            if len(dataset) == 0:
                raise ValueError(f"Workload.{name} is empty")
