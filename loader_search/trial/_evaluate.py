"""The validation pass of one trial: mean loss over the validation set, and accuracy when the
targets are class indices."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loader_search.params import LoaderParams, TrainingSettings
from loader_search.trial._loader import build_loader
from loader_search.trial._step import Step


def evaluate(
    step: Step,
    params: LoaderParams,
    settings: TrainingSettings,
    progress: Callable[[], None],
    max_batches: int | None = None,
) -> tuple[float, float | None]:
    """Mean validation loss over all samples (and accuracy for class-index targets, with the
    default step); over the first ``max_batches`` only when given."""
    workers = params.num_workers if max_batches is None else 0  # one batch: no start-up
    eval_params = LoaderParams(
        batch_size=settings.eval_batch_size,
        num_workers=workers,
        prefetch_factor=params.prefetch_factor if workers else None,
        pin_memory=params.pin_memory,
        torch_threads=params.torch_threads,
        start_method=params.start_method if workers else None,
        backend=params.backend if workers else "process",
    )
    workload = step.workload
    loader = build_loader(
        workload.val_dataset, eval_params, shuffle=False, collate_fn=workload.collate_fn
    )
    step.module.eval()
    total_loss = 0.0
    correct = 0
    count = 0
    classification = True
    for batches, batch in enumerate(loader, start=1):
        n = step.size(batch, eval_params.batch_size)
        batch = step.prepare(batch)
        loss, outputs = step.eval_loss(batch)
        total_loss += float(loss) * n
        count += n
        targets = batch[1] if outputs is not None else None
        if (
            classification
            and outputs is not None
            and isinstance(targets, torch.Tensor)
            and outputs.dim() == 2
            and targets.dim() == 1
            and not targets.is_floating_point()
        ):
            correct += int((outputs.argmax(1) == targets).sum())
        else:
            classification = False
        progress()
        if max_batches is not None and batches >= max_batches:
            break
    return total_loss / count, (correct / count if classification else None)
