"""Host memory for the optimizer state's host copies: one layout for the whole state.

The state is created a bucket at a time (and all at once by a load), so its size is known
only as it grows. Each request's regions are cut one after another from slabs (a bump
allocator): at the end of the first slab with room, in a new slab only when none has room.
A region is never split across slabs.

Where the allocator rounds each slab up to a power of two (PyTorch's caching host allocator
for pinned memory: docs/ARCHITECTURE.md, the pool), slabs per request would waste up to half
of each (GPT-2 124M's 0.93 GiB of AdamW state took 1.54 GiB); the slabs are then powers of
two already, and large: sized from the parameters the state belongs to (`slab_bytes`), so
their unused ends are a few percent of a large state, and a small state takes a few pages.
Elsewhere (``round_up=False``: the CPU backend's ordinary memory) a new slab is exactly what
the request's regions need beyond the room left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .hostmem import check_host_budget
from .pool import aligned

# The smallest slab (a page): a tiny model's state takes a few.
MIN_SLAB = 2**12
# The largest slab a request needs no more for: about 1/50 of a state of 50 GiB.
MAX_SLAB = 2**30


def _power_of_two_at_least(nbytes: int) -> int:
    return 1 << max(0, nbytes - 1).bit_length()


def slab_bytes(*, largest: int, total: int) -> int:
    """The size of a new slab for a state whose parameters' largest tensor takes
    ``largest`` bytes and all of them ``total``.

    Twice the largest region, so that a slab holds the largest state tensor (a region is
    never split) with room to spare, and a slab given up because a large region does not
    fit at its end is mostly full; at least 1/16 of the parameters' bytes (Adam's state is
    twice them: about 32 slabs); at most `MAX_SLAB`, at least `MIN_SLAB`; a power of two.
    """
    wanted = max(2 * largest, total // 16)
    return _power_of_two_at_least(min(MAX_SLAB, max(MIN_SLAB, wanted)))


@dataclass
class _Slab:
    memory: torch.Tensor  # uint8
    used: int = 0  # bytes from the start, aligned

    def room(self) -> int:
        return self.memory.numel() - self.used


class StateSlabs:
    """Regions for host copies, cut from slabs that ``allocate(nbytes)`` gives (the
    backend's `Backend.host_slab`: pinned on CUDA) after the host budget check.

    ``fraction``: ``host_memory_fraction``, for the check. ``round_up``: ``allocate``
    rounds a slab up to a power of two (see the module docstring); `expect` then tells
    it the parameters whose state it will hold, which sizes its slabs. ``what``: what the
    slabs hold, named by the budget check's error.
    """

    def __init__(
        self,
        allocate: Callable[[int], torch.Tensor],
        *,
        fraction: float,
        round_up: bool,
        what: str = "the optimizer's state",
    ) -> None:
        self._allocate = allocate
        self._what = what
        self._fraction = fraction
        self._round_up = round_up
        self._slabs: list[_Slab] = []
        self._largest = 0
        self._total = 0

    def expect(self, params: Iterable[torch.Tensor]) -> None:
        """The state will belong to ``params`` (among others): slabs from now on are sized
        for the largest of what it was told."""
        sizes = [p.numel() * p.element_size() for p in params]
        self._largest = max([self._largest, *sizes])
        self._total = max(self._total, sum(sizes))

    @property
    def reserved_bytes(self) -> int:
        """What the slabs take (on CUDA: what they pin)."""
        return sum(slab.memory.numel() for slab in self._slabs)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of one of the slabs."""
        address = tensor.untyped_storage().data_ptr()
        return any(slab.memory.untyped_storage().data_ptr() == address for slab in self._slabs)

    def take(self, sizes: list[int]) -> list[torch.Tensor]:
        """A region (uint8) of each of ``sizes`` bytes, starting on an `aligned` boundary.

        The new slabs the regions need are checked against the host budget, together,
        before any is allocated: if that raises, nothing changed.
        """
        where, new = self._place(sizes)
        if new:
            check_host_budget(sum(new), fraction=self._fraction, what=self._what)
        self._slabs += [_Slab(self._allocate(nbytes)) for nbytes in new]
        regions = []
        for size, (index, offset) in zip(sizes, where, strict=True):
            if not size:  # an empty tensor's copy takes no room
                regions.append(torch.empty(0, dtype=torch.uint8))
                continue
            slab = self._slabs[index]
            regions.append(slab.memory[offset : offset + size])
            slab.used = max(slab.used, offset + aligned(size))
        return regions

    def _place(self, sizes: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
        """Where each region goes, without allocating: its (slab index, byte offset), and
        the sizes of the new slabs (indices from ``len(self._slabs)`` on). Largest regions
        first, each at the end of the first slab with room; without ``round_up``, what
        fits nowhere goes into one new slab of exactly their bytes."""
        rooms = [[slab.used, slab.memory.numel()] for slab in self._slabs]
        existing = len(rooms)
        where = [(0, 0)] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            need = aligned(sizes[i])
            if not need:
                continue
            index = next((k for k, (used, end) in enumerate(rooms) if end - used >= need), None)
            if index is None:
                if self._round_up:
                    size = slab_bytes(largest=self._largest, total=self._total)
                    rooms.append([0, max(size, _power_of_two_at_least(need))])
                elif len(rooms) == existing:
                    rooms.append([0, 0])
                index = len(rooms) - 1
                if not self._round_up:
                    rooms[index][1] += need  # the exact slab grows by this region
            where[i] = (index, rooms[index][0])
            rooms[index][0] += need
        return where, [end for _, end in rooms[existing:]]
