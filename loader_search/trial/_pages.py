"""A forked trial's copy-on-write pages, paid before its window instead of inside it.

A trial is forked from its worker (`loader_search.trial._supervisor`), so it shares the
worker's memory pages until it writes to them; the first write to each page copies it (a
copy-on-write fault). Reading a sample writes to it: Python counts references in the object
itself, so ``dataset.images[i]`` writes the page that holds that bytes object's header. A
training process that loads its own batches (``num_workers=0``, or the thread backend) then
takes one such fault per page of samples during its first epoch, inside the measured window.
A user's training script, a fresh process, never does; its loader workers do (they are
forked from it), and so do the trial's, alike. Measured here (benchmarks/RESULTS.md):
a forked ``num_workers=0`` trial of the quickstart read 9% below the same trial in a fresh
process (12 paired rounds, 95% CI +-5%), and 0.2% below it once its data set's objects had
been written to before training.

`own_pages` is that write: it visits the objects a data set holds and takes a reference to
each, so their pages are copied now, before the loader starts. It costs a pass over the data
set's objects (~1 us each, plus the faults themselves, which the window would otherwise pay)
and nothing in a process that was not forked (its pages are already its own).
"""

from __future__ import annotations

import gc
import time
import types
from typing import Any

# Not data: a class, a module, a function reaches the whole program, not the samples.
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
)
MAX_OBJECTS = 20_000_000  # a bound on the walk for a data set of many small objects
MAX_SECONDS = 30.0


def own_pages(*roots: Any, max_objects: int = MAX_OBJECTS, max_s: float = MAX_SECONDS) -> int:
    """Write to (take a reference to) every object reachable from ``roots`` through
    containers and instance attributes, classes, modules and functions excluded, so that
    their copy-on-write pages are copied now. Returns the objects visited; stops after
    ``max_objects`` or ``max_s`` seconds (the rest then faults during training, as before)."""
    seen: set[int] = set()
    stack = list(roots)
    deadline = time.perf_counter() + max_s
    while stack and len(seen) < max_objects:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        # Taking the references writes each referent's count: the write that copies its page.
        stack.extend(gc.get_referents(obj))
        if len(seen) % 65_536 == 0 and time.perf_counter() > deadline:
            break
    return len(seen)
