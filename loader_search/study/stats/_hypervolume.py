"""The hypervolume of a two-objective front (the report's history of the search)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def hypervolume_2d(points: Iterable[Sequence[float]], reference: Iterable[float]) -> float:
    """The area that ``points`` dominate up to ``reference``, both objectives minimised: the
    union of the rectangles ``[x, rx] x [y, ry]``. Exact, O(n log n); Optuna has no public
    hypervolume function (``optuna._hypervolume`` is private).

    Sorted by the first objective, a point adds area only below the lowest second objective
    seen so far (a point that does not is dominated), and what it adds is the strip between
    the two, as wide as from its first objective to the reference. As in Optuna, a point
    beyond the reference (or NaN) is an error, not ignored.
    """
    rx, ry = (float(v) for v in reference)
    pairs = [(float(x), float(y)) for x, y in points]
    if not all(x <= rx and y <= ry for x, y in pairs):
        raise ValueError(f"every point must be at or below the reference {(rx, ry)}: {pairs}")
    area, lowest = 0.0, ry
    for x, y in sorted(pairs):
        if y < lowest:
            area += (rx - x) * (lowest - y)
            lowest = y
    return area
