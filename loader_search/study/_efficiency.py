"""How a loader efficiency reads wherever a person reads it (the live progress line, the plain
progress lines, the summary table, the recommendation, the report): one rule, here.

A trial's loader efficiency is its throughput over the ceiling, the same model fed pre-decoded
batches already on the device (`loader_search.study.work._plan`). Imports nothing heavy: the
console draws it before any study is open.
"""

from __future__ import annotations


def above_ceiling(efficiency: float) -> bool:
    """Whether a loader efficiency rests on a low ceiling reading: above 100% the trial beat
    the same model fed pre-decoded data already on the device, which no loader can, so the
    ceiling read for its batch size and threads was low (under load, or noise; see
    `loader_search.study.work._plan`)."""
    return efficiency > 1


def efficiency_text(efficiency: float) -> str:
    """A loader efficiency as every place a person reads it shows it: ``87%``; a value from a
    low ceiling reading (`above_ceiling`) marked ``108%!``, never shown plain."""
    return f"{efficiency:.0%}" + ("!" if above_ceiling(efficiency) else "")
