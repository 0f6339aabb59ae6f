"""Which DataLoader is the training loader: the one the script trains with, the loader whose
batches its optimizer steps follow.

`loader_search.trial._inject` guesses the training loader when loaders are built (the shuffle
rule, or the first loader built), before any step can say. A script may shuffle its validation
loader and not its training one: the guess would then tune, measure and cut the validation
loader, and the study would rank settings on numbers that are not training's. So the hook
follows the optimizer steps, through torch's global step hook (every optimizer, the user's own
included, with no reference to it): the first step after a batch settles the choice. A step
after a batch of the guessed loader confirms it; a step after another loader's batch moves the
training role to that loader (``retarget``, `loader_search.trial._inject`), and the state says
``train_rule: "optimizer_steps"``. ``[workload] train_loader = N`` is the user's own word: the
steps never overrule it. A torch without global step hooks keeps the guess.

The guess's own rule, whether a loader shuffles (`shuffles`), is here too.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from loader_search.trial import _hookstate, _hookworker
from loader_search.trial._hookstate import ProcessState

TARGET = "torch.optim.optimizer"


def watch(module: ModuleType, retarget: Callable[[ProcessState, Any], None]) -> None:
    """Follow every optimizer step of this process (``module`` is ``torch.optim.optimizer``);
    ``retarget(state, info)`` makes the loader of ``info`` the training loader."""
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is None:
        return  # a torch older than global step hooks: the first guess stands

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        state = _hookstate.current()
        if state is None or state.steps_settled:
            return  # settled: one attribute read per step from then on
        try:
            if _hookworker.worker_info() is None:
                stepped(state, retarget)
        except Exception as exc:  # never into the user's optimizer.step()
            state.record_error("following the optimizer steps", exc)

    register(after_step)


def stepped(state: ProcessState, retarget: Callable[[ProcessState, Any], None]) -> None:
    """An optimizer step ran: the loader whose batch came last trains."""
    source = state.last_batch_from
    if source is None:
        return  # a step before any batch (the script's own warm-up) says nothing
    state.steps_settled = True
    if source is state.train_info or state.settings.train_loader is not None:
        return
    retarget(state, source)


def shuffles(arguments: dict[str, Any]) -> bool:
    """Whether a DataLoader built with ``arguments`` shuffles: the first guess's rule."""
    if arguments.get("shuffle"):
        return True
    if _shuffling_sampler(arguments.get("sampler")):
        return True
    batch_sampler = arguments.get("batch_sampler")
    return batch_sampler is not None and _shuffling_sampler(
        getattr(batch_sampler, "sampler", None)
    )


def _shuffling_sampler(sampler: object) -> bool:
    import torch.utils.data as data
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(sampler, DistributedSampler):
        return bool(getattr(sampler, "shuffle", False))
    random = (data.RandomSampler, data.SubsetRandomSampler, data.WeightedRandomSampler)
    return isinstance(sampler, random)
