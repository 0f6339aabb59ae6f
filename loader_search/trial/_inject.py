"""The trial hook inside a command workload: the trial's loader settings go into the user's own
training DataLoader, and its loop is measured where it runs.

`install` (called by ``_hook/sitecustomize.py`` at interpreter start) imports nothing heavy:
it waits for ``torch.utils.data.dataloader`` to be imported (a `sys.meta_path` finder), then
patches ``DataLoader.__init__`` and ``DataLoader.__iter__`` on the class itself, so
``from torch.utils.data import DataLoader`` and every subclass are covered.

Which loader is the training loader, in each process (each rank):

* ``train_loader = N`` in the trial's settings: the N-th DataLoader built in the process
  (1-based).
* otherwise the first DataLoader built with a shuffling sampler: ``shuffle=True``, a
  ``RandomSampler``, ``SubsetRandomSampler`` or ``WeightedRandomSampler``, a
  ``DistributedSampler`` whose ``shuffle`` is true, or a ``batch_sampler`` whose ``.sampler``
  is one of those;
* if no loader was built with one by the time the first loader built is first iterated, the
  first loader built: it is initialised again then, with the trial's settings;
* and a shuffling loader built later over the training loader's own data set: the same
  loader re-created (Lightning re-creates it with a ``DistributedSampler``), which keeps the
  trial's settings.

Without ``train_loader``, the shuffle rule is only the first guess: the first optimizer step
after a batch settles it (`loader_search.trial._hookpick`). A step after another loader's
batch makes that loader the training loader (`_retarget`): the trial's settings go into it
from its next batch, and the guessed one goes back to the script's own settings at its next
iterator, no longer measured nor cut.

The training loader gets the settings the trial injects (those the command line does not pass
itself); a setting that cannot apply is recorded with its reason, never dropped silently. Its
iterator is measured with `StepMeter` (the time between two batches is the user's whole step
plus the data wait) and stops once this rank's share of the trial's ``train_samples`` has been
delivered: a batch cannot be cut, so the iteration ends at the first batch that reaches or
passes the share (at most one batch over), and every later iteration (a later epoch) is empty,
so an epoch loop reaches its validation and the script ends on its own. Batches of every other
loader count as ``ticks`` (evaluation progress).

Only the main process of each rank acts: a loader worker (``get_worker_info()`` set) or a
process forked from the one that installed the hook passes everything through. Every wrapper
catches its own errors, writes them to ``hook-error-<pid>.txt`` and falls back to the
original behaviour: the hook never raises into the user's program.
"""

from __future__ import annotations

import os
import sys
from types import FrameType, ModuleType
from typing import Any

from loader_search.trial import _hookpick, _hookstate, _hookworker
from loader_search.trial._hookloop import TickIter, TrainIter, TrainRun
from loader_search.trial._hookstate import HookSettings, ProcessState

TARGET = "torch.utils.data.dataloader"
_PATCHED = "_loader_search_patched"
_INFO = "_loader_search_info"
_BATCH_SAMPLER_FIXES = "a batch_sampler fixes the batch size"
_UNBATCHED = "batch_size=None: the loader does not batch (its dataset yields whole batches)"


def install() -> None:
    """Patch the DataLoader now if torch's loader module is loaded, else once it is."""
    from loader_search.trial._frameworks import FRAMEWORKS

    state = _hookstate.install_state()
    state.hooked = True
    _hookstate.watch_uncaught(state)
    patchers = {TARGET: patch, _hookpick.TARGET: _watch_steps, **FRAMEWORKS}
    for name, patcher in patchers.items():
        module = sys.modules.get(name)
        if module is not None:
            _patched(patcher, module)
        else:
            _PENDING[name] = patcher
    if _PENDING and not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


# Modules not imported yet, and what patches each once it is: the DataLoader, and the
# trainers of frameworks that log a validation loss (loader_search.trial._frameworks).
_PENDING: dict[str, Any] = {}


def _patched(patcher: Any, module: ModuleType) -> None:
    try:
        patcher(module)
    except Exception as exc:
        state = _hookstate.current()
        if state is not None:
            state.record_error(f"patching {module.__name__}", exc)


class _Finder:
    """Finds nothing itself: hands a pending module's own spec on with a loader that patches
    the module once it has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, _PENDING.pop(fullname))
        return spec


class _PatchingLoader:
    def __init__(self, loader: Any, patcher: Any) -> None:
        self._loader = loader
        self._patcher = patcher

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Tools that read source through the module's loader (inspect, linecache) see the
        # original one again.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if not _PENDING:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        _patched(self._patcher, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _LoaderInfo:
    """What the hook keeps on one DataLoader it saw built."""

    def __init__(self, record: dict[str, Any], arguments: dict[str, Any]) -> None:
        self.record = record
        self.arguments = arguments  # the user's own arguments, kept for a re-initialisation
        self.run: TrainRun | None = None
        # Set by `_retarget`: the trial's settings go in before its next batch, or the
        # script's own come back at its next iterator.
        self.take_over = False
        self.restore = False


def patch(module: ModuleType) -> None:
    """Patch ``module.DataLoader`` in place (once)."""
    import inspect

    cls = module.DataLoader
    if cls.__dict__.get(_PATCHED):
        return
    _hookworker.patch_worker_info([module, sys.modules.get("torch.utils.data")])
    original_init = cls.__init__
    original_iter = cls.__iter__
    signature = inspect.signature(original_init)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        state = _acting_state()
        if state is None:
            original_init(self, *args, **kwargs)
            return
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            original_init(self, *args, **kwargs)  # the user's own mistake: torch says it
            return
        try:
            info, injected = _plan(state, self, dict(bound.arguments), signature)
        except Exception as exc:
            state.record_error("DataLoader.__init__", exc)
            original_init(self, *args, **kwargs)
            return
        _init_with(original_init, self, state, info, injected, args, kwargs)

    def __iter__(self: Any) -> Any:
        state = _acting_state()
        info = self.__dict__.get(_INFO)
        if state is None or not isinstance(info, _LoaderInfo):
            return original_iter(self)
        try:
            if info.restore:
                info.restore = False
                _reinit(original_init, self, info, info.arguments)
            if (
                not state.train_decided
                and state.settings.train_loader is None
                and info.record["index"] == 1
            ):
                _fall_back_to_first(original_init, self, state, info)
            if info.take_over:
                _take_over(original_init, self, state, info)
            if info.record["train"]:
                return _train_iter(self, info, state, original_iter)
        except Exception as exc:
            state.record_error("DataLoader.__iter__", exc)
            return original_iter(self)

        def switch() -> Any:
            # The optimizer steps made this loader the training loader mid-epoch.
            if not info.take_over:
                return None
            _take_over(original_init, self, state, info)
            return _train_iter(self, info, state, original_iter)

        return TickIter(original_iter(self), state, info, switch)

    __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
    __iter__.__wrapped__ = original_iter  # type: ignore[attr-defined]
    __init__.__doc__, __iter__.__doc__ = original_init.__doc__, original_iter.__doc__
    cls.__init__ = __init__
    cls.__iter__ = __iter__
    setattr(cls, _PATCHED, True)


def _acting_state() -> ProcessState | None:
    """This process's state where the hook acts: a trial's main process of a rank, not a
    loader worker nor a process forked from it."""
    state = _hookstate.current()
    if state is None:
        return None
    return state if _hookworker.worker_info() is None else None


def _plan(
    state: ProcessState, loader: Any, arguments: dict[str, Any], signature: Any
) -> tuple[_LoaderInfo, dict[str, Any] | None]:
    """Record a DataLoader being built; for the training loader, its arguments with the
    trial's settings in (None: build it as the user asked)."""
    import torch.utils.data as data

    arguments.pop("self", None)
    state.built += 1
    state.touch()
    shuffles = _hookpick.shuffles(arguments)
    record: dict[str, Any] = {
        "index": state.built,
        "site": _site(loader),
        "shuffle": shuffles,
        "train": False,
        "iterable": isinstance(arguments.get("dataset"), data.IterableDataset),
        "applied": {},
        "not_applied": {},
    }
    state.loaders.append(record)
    # Written at once: a command that built its loader and then waits before the first batch
    # is told from one that builds none (`loader_search.trial._command_read.Seen.no_loader`).
    state.write()
    wanted = state.settings.train_loader
    dataset = arguments.get("dataset")
    recreated = shuffles and dataset is not None and dataset is state.train_dataset
    training = recreated or (
        state.built == wanted if wanted is not None else shuffles and not state.train_decided
    )
    # Every loader's own arguments are kept: the first one becomes the training loader if
    # no shuffling one is built before it is first iterated, any one if the optimizer steps
    # follow its batches, and a wrong guess goes back to them.
    info = _LoaderInfo(record, arguments)
    loader.__dict__[_INFO] = info
    if not training:
        return info, None
    if not recreated or state.train_rule is None:
        state.train_rule = "train_loader" if wanted is not None else "guess"
    state.train_decided = True
    state.train_dataset = dataset
    state.train_info = info
    record["train"] = True
    return info, _injected(arguments, state.settings, record, signature)


def _injected(
    arguments: dict[str, Any], settings: HookSettings, record: dict[str, Any], signature: Any
) -> dict[str, Any]:
    """``arguments`` with the trial's settings in, each recorded as applied or not."""
    known = signature.parameters
    merged = {
        name: param.default
        for name, param in known.items()
        if name != "self" and param.default is not param.empty
    }
    merged.update(arguments)
    applied, skipped = record["applied"], record["not_applied"]
    for name in settings.inject:
        if name not in _hookstate.INJECTABLE:
            skipped[name] = "not a DataLoader setting the hook knows"
        elif name not in known:
            skipped[name] = "this torch's DataLoader has no such argument"
        elif name == "batch_size" and merged.get("batch_sampler") is not None:
            skipped[name] = _BATCH_SAMPLER_FIXES
        elif name == "batch_size" and merged.get("batch_size") is None:
            skipped[name] = _UNBATCHED
        else:
            merged[name] = applied[name] = settings.value(name)
    # Without workers torch refuses a prefetch factor, persistent workers and a
    # multiprocessing context, whoever set them: the trial's 0 workers must not turn the
    # user's own values into an error (nor a {prefetch_factor} flag, which renders as 2 in a
    # trial without workers). The script's own context is recorded (the first look says so).
    context = merged.get("multiprocessing_context")
    if context is not None:
        record["multiprocessing_context"] = (
            context if isinstance(context, str) else getattr(context, "_name", None) or "?"
        )
    trial_has_none = settings.value("num_workers") == 0
    if not merged.get("num_workers"):
        for name, idle in (("prefetch_factor", None), ("persistent_workers", False)):
            ours = "num_workers" in applied or name in applied
            if name in known and (ours or (trial_has_none and merged.get(name) != idle)):
                merged[name] = applied[name] = idle
        if context is not None:  # it only says how workers start: none start
            merged["multiprocessing_context"] = applied["multiprocessing_context"] = None
    _time_collate(merged)
    return merged


def _time_collate(merged: dict[str, Any]) -> None:
    """The training loader's collate, timed (`_hookworker.HookCollate`): the user's own, or
    the one torch would pick. A loader that does not batch (``batch_size=None``, no
    ``batch_sampler``) collates sample by sample: its costs are not a batch's, left alone."""
    from torch.utils.data import default_collate

    collate = merged.get("collate_fn")
    batches = merged.get("batch_size") is not None or merged.get("batch_sampler") is not None
    if isinstance(collate, _hookworker.HookCollate) or not batches:
        return  # a re-created loader keeps the one it was given
    merged["collate_fn"] = _hookworker.HookCollate(collate or default_collate)


def _init_with(
    original_init: Any,
    loader: Any,
    state: ProcessState,
    info: _LoaderInfo,
    injected: dict[str, Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Build ``loader`` with the injected arguments, or as the user asked where torch refuses
    them (recorded as not applied, with torch's reason)."""
    if injected is None:
        original_init(loader, *args, **kwargs)
    else:
        try:
            original_init(loader, **injected)
        except Exception as exc:
            _refused(state, info, exc)
            _reset(loader)
            original_init(loader, *args, **kwargs)
    _note_effective(loader, info)


def _refused(state: ProcessState, info: _LoaderInfo, exc: Exception) -> None:
    state.record_error("injecting the trial's settings", exc)
    reason = f"the DataLoader refused it: {_hookstate.one_line(exc)}"
    record = info.record
    record["not_applied"].update(dict.fromkeys(record["applied"], reason))
    record["applied"] = {}


def _reset(loader: Any) -> None:
    # DataLoader.__setattr__ refuses to change batch_size, sampler... once this flag is set;
    # cleared, the original __init__ may run again on the same object.
    loader._DataLoader__initialized = False


def _note_effective(loader: Any, info: _LoaderInfo) -> None:
    # What the loader really uses, whoever chose it: the service compares it with the trial.
    record = info.record
    record["num_workers"] = getattr(loader, "num_workers", None)
    record["batch_size"] = getattr(loader, "batch_size", None)
    if record["batch_size"] is None:  # a batch_sampler's own, where it says
        record["batch_size"] = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)


def _fall_back_to_first(
    original_init: Any, loader: Any, state: ProcessState, info: _LoaderInfo
) -> None:
    """No shuffling loader was built before the first one is iterated: the first one is the
    training loader (a guess), initialised again with the trial's settings."""
    state.train_decided = True
    state.train_rule = "guess"
    state.train_info = info
    info.record["train"] = True
    _take_over(original_init, loader, state, info)


def _take_over(original_init: Any, loader: Any, state: ProcessState, info: _LoaderInfo) -> None:
    """``loader`` becomes the training loader: initialised again with the trial's settings,
    or with its own where torch refuses them (recorded as not applied)."""
    import inspect

    info.take_over = False
    arguments = info.arguments
    injected = _injected(arguments, state.settings, info.record, inspect.signature(original_init))
    try:
        _reinit(original_init, loader, info, injected)
    except Exception as exc:
        _refused(state, info, exc)
        _reinit(original_init, loader, info, arguments)


def _reinit(original_init: Any, loader: Any, info: _LoaderInfo, arguments: dict[str, Any]) -> None:
    # A live iterator keeps what it took from the loader; the next one takes these.
    _reset(loader)
    original_init(loader, **arguments)
    _note_effective(loader, info)


def _retarget(state: ProcessState, info: _LoaderInfo) -> None:
    """An optimizer step followed a batch of ``info``'s loader before any of the guessed
    training loader's (`_hookpick.stepped`): ``info``'s loader trains. The counts so far were
    the guess's: they start again."""
    old = state.train_info
    if isinstance(old, _LoaderInfo):
        old.record["train"] = False
        old.record["applied"], old.record["not_applied"] = {}, {}
        old.restore = True
        if old.run is not None:
            old.run.retired = True
            old.run = None
    state.restart_training()
    state.train_decided = True
    state.train_rule = "optimizer_steps"
    state.train_info = info
    state.train_dataset = info.arguments.get("dataset")
    info.record["train"] = True
    info.take_over = True
    state.write()


def _watch_steps(module: ModuleType) -> None:
    _hookpick.watch(module, _retarget)


def _outside(filename: str) -> bool:
    return not any(
        filename.startswith(root) for root in _library_roots() if root
    ) and not filename.startswith("<frozen")


_ROOTS: list[str] = []


def _library_roots() -> list[str]:
    if not _ROOTS:
        import loader_search

        for module in (sys.modules.get("torch"), loader_search):
            file = getattr(module, "__file__", None)
            if file:
                _ROOTS.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return _ROOTS


def _site(loader: Any) -> str | None:
    """``file:line`` where the user built ``loader``: the first frame outside torch and this
    package, past a DataLoader subclass's own ``__init__``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if _outside(os.path.abspath(code.co_filename)) and not (
            code.co_name == "__init__" and frame.f_locals.get("self") is loader
        ):
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


# --- iteration ------------------------------------------------------------------------


def _train_iter(loader: Any, info: _LoaderInfo, state: ProcessState, original_iter: Any) -> Any:
    run = info.run
    if run is None:
        run = info.run = TrainRun(loader, state, info)
    if run.done():
        run.before_next()  # the budget fell on an epoch's last batch: reached now
        return iter(())
    run.new_iterator()
    return TrainIter(original_iter(loader), run)
