"""The largest batch whose measured device peak fits a budget, in few probes.

A probe is one measured training step (expensive at large batches), so the search guesses
before it probes: a step's peak is the largest of its moments' bytes, each about affine in
the batch, so the peak is convex in the batch. Extending the slope between the last two
fitting probes then overestimates how far the budget reaches, and the chord between a
fitting and a failing probe underestimates it; the search alternates the two and ends only
with both ``b`` (fits) and ``b + 1`` (does not) measured, so the answer rests on probes, not
on the model of them. It assumes only that a larger batch never needs less memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BatchSearch:
    """``largest``: the largest batch that fit (0: not even 1); ``capped``: it reached
    ``limit`` and larger batches were not tried; ``probes``: batch -> measured peak bytes."""

    largest: int
    capped: bool
    probes: dict[int, int]


def largest_batch(peak_of: Callable[[int], int], *, budget: int, limit: int) -> BatchSearch:
    """The largest batch in [1, ``limit``] with ``peak_of(batch) <= budget``."""
    if limit < 1:
        raise ValueError(f"Invalid limit: {limit!r}; expected a batch of at least 1.")
    probes: dict[int, int] = {}

    def fits(batch: int) -> bool:
        if batch not in probes:
            probes[batch] = peak_of(batch)
        return probes[batch] <= budget

    if not fits(1):
        return BatchSearch(largest=0, capped=False, probes=probes)
    fitting = [1]  # probed batches that fit, ascending
    failing: int | None = None  # the smallest probed batch that did not
    last_fit, bisect = True, False
    while fitting[-1] < limit and (failing is None or failing - fitting[-1] > 1):
        low = fitting[-1]
        if bisect:
            guess = (low + failing) // 2
        elif failing is None or last_fit:
            guess = _extend(fitting, probes, budget)
        else:
            guess = _chord(low, failing, probes, budget)
        upper = limit if failing is None else failing - 1
        guess = min(max(guess, low + 1), upper)
        width = None if failing is None else failing - low
        last_fit = fits(guess)
        if last_fit:
            fitting.append(guess)
        else:
            failing = guess
        # A guess that did not halve the bracket (a flat stretch of the peak misleads the
        # slopes) is followed by a plain bisection.
        bisect = width is not None and failing - fitting[-1] > width / 2
    return BatchSearch(
        largest=fitting[-1], capped=fitting[-1] == limit and failing is None, probes=probes
    )


def _extend(fitting: list[int], probes: dict[int, int], budget: int) -> int:
    """Where the slope of the last two fitting probes meets the budget (past it, by
    convexity), but at most twice the last batch: a slope taken where the peak is still
    flat overshoots far, and a probe costs in proportion to its batch."""
    low = fitting[-1]
    if len(fitting) < 2:
        return 2 * low
    before = fitting[-2]
    slope = (probes[low] - probes[before]) / (low - before)
    if slope <= 0:
        return 2 * low
    return min(2 * low, low + int((budget - probes[low]) // slope))


def _chord(low: int, high: int, probes: dict[int, int], budget: int) -> int:
    """Where the line from a fitting to a failing probe meets the budget (short of it, by
    convexity)."""
    rise = probes[high] - probes[low]
    return low + int((budget - probes[low]) * (high - low) // rise)
