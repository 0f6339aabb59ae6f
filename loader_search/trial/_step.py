"""The user's training step, built once per trial: what every loop of a trial calls.

A `Step` holds the model as the user trains it (``channels_last``, ``torch.compile``) and
runs one micro-batch the user's way: autocast to ``precision`` around the forward and the
loss, the workload's own ``train_step`` (or ``loss_fn(model(inputs), targets)`` on an
``(inputs, targets)`` pair), backward through a `torch.amp.GradScaler` for fp16, and the
optimizer step (a step the scaler skips, for an inf or NaN gradient, is counted). The
training loop, the ceiling reading, the evaluation, gradient accumulation and the
out-of-memory retry all call the same `Step`, so no loop knows about autocast or compile
(see ``../shared/DESIGN.md``).

Batches of any structure (tensors, dicts, lists, tuples, named tuples, dataclasses, objects
with ``.to()``) are moved to the device by one tree map (`move`), ``non_blocking`` when the
loader pins memory; their size is the workload's ``batch_size_of``, or the first dimension
of the first tensor found (`first_tensor`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import reprlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from loader_search.errors import UserError
from loader_search.params import TrainingSettings
from loader_search.trial._ranks import check_ranks
from loader_search.workloads import Workload

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def move(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it on ``device`` (its structure kept)."""
    return tree_map(batch, lambda t: t.to(device, non_blocking=non_blocking), device)


def tree_map(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor], device: Any = None) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it: in mappings, lists, tuples,
    named tuples and dataclasses; an object of another kind with a ``.to()`` method is moved
    with it when ``device`` is given; anything else is kept as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: tree_map(v, fn, device) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(tree_map(v, fn, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(tree_map(v, fn, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: tree_map(getattr(batch, f.name), fn, device)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    if device is not None and callable(getattr(batch, "to", None)):
        return batch.to(device)  # e.g. a Hugging Face BatchEncoding
    return batch


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor in ``batch``, depth first (in `tree_map`'s order), or None."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        if not found:
            found.append(t)
        return t

    tree_map(batch, keep)
    if not found and hasattr(batch, "data") and isinstance(batch.data, Mapping):
        return first_tensor(dict(batch.data))  # an object holding a mapping (BatchEncoding)
    return found[0] if found else None


def default_batch_size(batch: Any) -> int:
    """The first dimension of the first tensor found in ``batch``."""
    tensor = first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        raise TypeError(
            f"cannot tell the size of a batch of type {type(batch).__name__}: it holds no"
            " tensor with a batch dimension; give the workload a batch_size_of function"
        )
    return int(tensor.shape[0])


def checked_batch_size(value: object, most: int | None) -> int:
    """``value``, what the workload's ``batch_size_of`` returned, as a sample count: a whole
    number from 1 to ``most`` (the loader's batch size, when known), else ``ValueError``
    naming the function and the value.

    The count is what advances the trial's budget: 0 or less never did, so the trial
    trained for ever, and a count above the batch (or a fraction, truncated) ended it with
    a message about something else.
    """
    count: int | None = None
    if isinstance(value, float) and value.is_integer():
        count = int(value)
    elif not isinstance(value, (bool, float)):
        with contextlib.suppress(TypeError):
            count = operator.index(value)  # type: ignore[arg-type]
    if count is None or count < 1 or (most is not None and count > most):
        limit = f" (the loader's batch_size is {most})" if most is not None else ""
        raise ValueError(
            f"the workload's batch_size_of returned {reprlib.repr(value)}: it must return"
            f" the number of samples in the batch, a whole number from 1 to the batch"
            f" size{limit}"
        )
    return count


def check_step_settings(settings: TrainingSettings, device: torch.device) -> None:
    """Refuse, in one line, a precision, compilation or number of ranks the device, torch or
    the machine cannot run."""
    check_ranks(settings.ranks, device)
    if settings.precision == "fp16" and device.type == "cpu":
        raise UserError(
            'training.precision = "fp16": fp16 autocast with gradient scaling needs a CUDA'
            ' device; on a CPU use "bf16" or "fp32"'
        )
    if (
        settings.precision == "bf16"
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported()
    ):
        raise UserError(
            f'training.precision = "bf16": {torch.cuda.get_device_name(device)} cannot run'
            ' bfloat16; use "fp16" or "fp32"'
        )
    if settings.compile_mode is not None and not hasattr(torch, "compile"):
        raise UserError(
            f"training.compile = {settings.compile!r}: this torch ({torch.__version__}) has no"
            " torch.compile; set compile = false or install torch 2.0 or newer"
        )


def compiled_graphs() -> int | None:
    """Graphs ``torch.compile`` compiled in this process so far (None where torch does not
    say): a count that grows during the measured window is a recompilation in it."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    return int(counters["stats"]["unique_graphs"])


def channels_last_input(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() == 4 and tensor.is_floating_point():
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor


class Step:
    """One trial's training step (see the module docstring). Built once per trial."""

    def __init__(
        self,
        workload: Workload,
        settings: TrainingSettings,
        model: nn.Module,
        device: torch.device,
        *,
        pin_memory: bool = False,
    ) -> None:
        self.workload = workload
        self.settings = settings
        self.device = device
        self.pin_memory = pin_memory
        if settings.matmul_precision is not None:
            torch.set_float32_matmul_precision(settings.matmul_precision)
        if settings.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.module = model  # the parameters the optimizer steps
        self.model: nn.Module = model
        mode = settings.compile_mode
        if mode is not None:
            compiled = torch.compile(model, mode=None if mode == "default" else mode)
            self.model = compiled  # type: ignore[assignment]
        self.compiled = mode is not None
        self._dtype = _AUTOCAST_DTYPES.get(settings.precision)
        self.scaler: torch.amp.GradScaler | None = None
        if settings.precision == "fp16":
            self.scaler = torch.amp.GradScaler(device.type)
        self.skipped_steps = 0  # optimizer steps the fp16 scaler skipped (inf/NaN gradients)

    # --- batches ----------------------------------------------------------------------

    def prepare(self, batch: Any) -> Any:
        """``batch`` on the device (``non_blocking`` when pinned), 4-D inputs in
        ``channels_last`` when asked."""
        batch = move(batch, self.device, self.pin_memory)
        if self.settings.channels_last:
            batch = tree_map(batch, channels_last_input)
        return batch

    def size(self, batch: Any, most: int | None = None) -> int:
        """How many samples ``batch`` holds; a loader's batch of at most ``most`` samples
        (its batch size) when given, which the workload's ``batch_size_of`` is held to
        (`checked_batch_size`)."""
        if self.workload.batch_size_of is not None:
            return checked_batch_size(self.workload.batch_size_of(batch), most)
        return default_batch_size(batch)

    def take(self, batch: Any, n: int) -> Any:
        """The first ``n`` samples of ``batch`` (every tensor whose first dimension is the
        batch's size is cut)."""
        size = self.size(batch)
        if n >= size:
            return batch
        return tree_map(batch, lambda t: t[:n] if t.dim() and t.shape[0] == size else t)

    def split(self, batch: Any, n: int) -> tuple[Any, Any]:
        """``batch`` cut after its first ``n`` samples: the first ``n`` and the rest (every
        tensor whose first dimension is the batch's size is cut; others go to both)."""
        size = self.size(batch)
        head = tree_map(batch, lambda t: t[:n] if t.dim() and t.shape[0] == size else t)
        tail = tree_map(batch, lambda t: t[n:] if t.dim() and t.shape[0] == size else t)
        return head, tail

    # --- training ---------------------------------------------------------------------

    def _autocast(self) -> Any:
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._dtype)

    def loss(self, batch: Any) -> torch.Tensor:
        """The batch's mean loss (a scalar tensor), the forward under autocast."""
        with self._autocast():
            if self.workload.train_step is not None:
                loss = self.workload.train_step(self.model, batch)
            else:
                inputs, targets = batch
                loss = self.workload.loss_fn(self.model(inputs), targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(
                "the training step must return the batch's mean loss as a scalar tensor, got"
                f" {type(loss).__name__}{tuple(loss.shape) if hasattr(loss, 'shape') else ''}"
            )
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()  # type: ignore[no-untyped-call]

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < before:  # the scaler found inf/NaN and skipped it
            self.skipped_steps += 1

    def no_sync(self, accumulating: bool) -> Any:
        """With DDP, while ``accumulating`` (a micro-batch the optimizer does not step on):
        the module's ``no_sync()``, so gradients are all-reduced once per batch."""
        no_sync = getattr(self.module, "no_sync", None)
        if accumulating and callable(no_sync):
            return no_sync()
        return contextlib.nullcontext()

    # --- evaluation -------------------------------------------------------------------

    def eval_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's mean loss without gradients, and the model's outputs when the step is
        the default one (for accuracy), else None."""
        with torch.no_grad(), self._autocast():
            if self.workload.eval_step is not None:
                return self.workload.eval_step(self.model, batch), None
            if self.workload.train_step is not None:
                return self.workload.train_step(self.model, batch), None
            inputs, targets = batch
            outputs = self.model(inputs)
            return self.workload.loss_fn(outputs, targets), outputs


class FirstStepClock:
    """The first training step's time with ``torch.compile`` on: what compiling cost (the
    compiled code's first run included), stored as ``compile_time_s``."""

    def __init__(self, step: Step) -> None:
        self._on = step.compiled
        self._started: float | None = None
        self.seconds: float | None = None

    def begin(self) -> None:
        if self._on and self.seconds is None:
            self._started = time.perf_counter()

    def end(self) -> None:
        if self._started is not None and self.seconds is None:
            self.seconds = time.perf_counter() - self._started
