"""The validation loss a training framework logs, read for a command's trial without a line
in the script: the start-up hook (`loader_search.trial._inject`) patches a framework's trainer
when the script imports it, so that every trainer built gets a callback that reports the loss
it logs (`loader_search.trial._report.report_val_loss`) after each validation.

- **Lightning** (``lightning.pytorch`` or ``pytorch_lightning``): after each validation (not
  the sanity check), the first of `LOSS_KEYS` in ``trainer.callback_metrics``. Lightning runs
  no validation in an epoch whose loader ended early, as the budget ends it: ``fit`` is
  followed by one ``validate`` where none reported a loss after the budget.
- **Hugging Face** ``transformers.Trainer``: ``eval_loss`` of each evaluation, on the main
  process.

Nothing here imports a framework: each patch receives the framework's module once the script
has imported it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from loader_search.trial import _hookstate
from loader_search.trial._report import report_val_loss

# The names a Lightning module logs its validation loss under, first found wins.
LOSS_KEYS = ("val_loss", "val/loss", "validation_loss", "valid_loss", "eval_loss")
_PATCHED = "_loader_search_reports"
_VALIDATES = "_loader_search_validates"


def patch_lightning(module: ModuleType) -> None:
    """Give every ``Trainer`` of this Lightning package (``<package>.trainer.trainer``) the
    reporting callback."""
    package = module.__name__.removesuffix(".trainer.trainer")
    callbacks = importlib.import_module(f"{package}.callbacks")

    class ReportValLoss(callbacks.Callback):  # type: ignore[misc, name-defined]
        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if getattr(trainer, "sanity_checking", False):
                return
            metrics = getattr(trainer, "callback_metrics", {}) or {}
            for key in LOSS_KEYS:
                if key in metrics:
                    report_val_loss(metrics[key])
                    return

    _after_init(module.Trainer, lambda trainer: trainer.callbacks.append(ReportValLoss()))
    _validate_after_fit(module.Trainer)


def _validate_after_fit(cls: Any) -> None:
    """Lightning runs no validation in an epoch its training loader ended early, as the
    trial's budget ends it: after ``fit``, a process whose budget ended without a loss
    reported since validates once (the reporting callback then reads it)."""
    if cls.__dict__.get(_VALIDATES):
        return
    original_fit = cls.fit

    def fit(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_fit(self, model, *args, **kwargs)
        state = _hookstate.current()
        if state is not None:  # fit is over: so is the budget's last step, if still open
            try:
                state.budget_step_over()
            except Exception as exc:  # never into the user's program
                state.record_error("measuring the training loop", exc)
        if state is None or not state.budget_reached or _reported_since(state):
            return result
        try:
            val = kwargs.get("val_dataloaders", args[1] if len(args) > 1 else None)
            datamodule = kwargs.get("datamodule", args[2] if len(args) > 2 else None)
            self.validate(model, dataloaders=val, datamodule=datamodule, verbose=False)
        except Exception as exc:  # never into the user's program: the trial says it
            state.record_error("validating after Trainer.fit", exc)
        return result

    fit.__wrapped__ = original_fit  # type: ignore[attr-defined]
    cls.fit = fit
    setattr(cls, _VALIDATES, True)


def _reported_since(state: Any) -> bool:
    """Whether a validation loss was reported after the budget ended."""
    at = state.budget_reached_at or 0.0
    return any(when >= at for when, _ in state.val_losses)


def patch_transformers(module: ModuleType) -> None:
    """Give every ``transformers.Trainer`` the reporting callback."""
    callback_module = importlib.import_module("transformers.trainer_callback")

    class ReportEvalLoss(callback_module.TrainerCallback):  # type: ignore[misc, name-defined]
        def on_evaluate(
            self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
        ) -> None:
            if metrics and "eval_loss" in metrics and state.is_world_process_zero:
                report_val_loss(metrics["eval_loss"])

    _after_init(module.Trainer, lambda trainer: trainer.add_callback(ReportEvalLoss))


def _after_init(cls: type, extend: Any) -> None:
    """Run ``extend(instance)`` after ``cls.__init__`` (once per class)."""
    if cls.__dict__.get(_PATCHED):
        return
    original = cls.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            extend(self)
        except Exception as exc:  # never into the user's program: the trial says it
            state = _hookstate.current()
            if state is not None:
                state.record_error(f"adding loader-search's callback to {cls.__name__}", exc)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
    setattr(cls, _PATCHED, True)


# Module -> what patches it, once the script imports it.
FRAMEWORKS = {
    "lightning.pytorch.trainer.trainer": patch_lightning,
    "pytorch_lightning.trainer.trainer": patch_lightning,
    "transformers.trainer": patch_transformers,
}
