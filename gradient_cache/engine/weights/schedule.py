"""The order a model's forward runs its blocks in, which the one-process stream brings
ahead by (docs/ARCHITECTURE.md, "The life of a weight"). Module order until a forward with
gradients that runs each block once teaches it (a block run twice keeps its weights to the
end of backward anyway); a block the forward skipped has no neighbours: nothing is brought
on its account.
"""

from __future__ import annotations


class Schedule:
    """The learned order of ``count`` blocks, by index (see the module docstring)."""

    def __init__(self, count: int) -> None:
        self._order = list(range(count))
        self._running: list[int] = []  # the blocks this forward ran, in order

    def ran(self, index: int) -> None:
        """Block ``index``'s forward began (one with gradients, outside backward)."""
        self._running.append(index)

    def learn(self) -> None:
        """A forward ended (or a backward, for a framework that never calls the model's
        own forward): what ran since, each block once, is the order from now on."""
        ran, self._running = self._running, []
        if ran and len(set(ran)) == len(ran):
            self._order = ran

    def first(self) -> int | None:
        return self._order[0] if self._order else None

    def last(self) -> int | None:
        return self._order[-1] if self._order else None

    def after(self, index: int) -> int | None:
        """The block forward runs after block ``index`` (None: none, or not in the order)."""
        return self._neighbour(index, 1)

    def before(self, index: int) -> int | None:
        """The block forward ran before block ``index``: backward's next."""
        return self._neighbour(index, -1)

    def _neighbour(self, index: int, step: int) -> int | None:
        if index not in self._order:
            return None
        place = self._order.index(index) + step
        return self._order[place] if 0 <= place < len(self._order) else None
