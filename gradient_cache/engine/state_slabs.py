"""Host memory for the optimizer state's host copies: one layout for the whole state.

The state grows a bucket at a time, so each request's regions are cut one after another
from slabs (a bump allocator): at the end of the first slab with room, in a new slab only
when none has room; a region is never split. Where the allocator rounds a slab up to a
power of two (CUDA's pinned host allocator), slabs per request would waste up to half of
each: slabs are then powers of two, sized from the parameters (`slab_bytes`). Elsewhere a
new slab is exactly what the request needs beyond the room left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .hostmem import check_host_budget
from .pool import aligned, power_of_two_at_least

# The smallest slab (a page): a tiny model's state takes a few.
MIN_SLAB = 2**12
# The largest slab a request needs no more for: about 1/50 of a state of 50 GiB.
MAX_SLAB = 2**30


def slab_bytes(*, largest: int, total: int) -> int:
    """A new slab's size for a state whose parameters' largest tensor takes ``largest``
    bytes and all ``total``: twice the largest (it fits, and a slab given up for it is
    mostly full), at least ``total`` / 16 (Adam's state: about 32 slabs), within
    `MIN_SLAB` and `MAX_SLAB`, a power of two."""
    wanted = max(2 * largest, total // 16)
    return power_of_two_at_least(min(MAX_SLAB, max(MIN_SLAB, wanted)))


@dataclass
class _Slab:
    memory: torch.Tensor  # uint8
    used: int = 0  # bytes from the start, aligned


class StateSlabs:
    """Regions for host copies, cut from slabs ``allocate(nbytes)`` gives (pinned on CUDA)
    after the host budget check (``fraction``, ``what`` it names). ``round_up``: the
    allocator rounds slabs up to a power of two; `expect` then sizes them."""

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
        """The state will belong to ``params`` too: later slabs are sized for the largest tensor,
        and the largest set, it was told of."""
        sizes = [p.numel() * p.element_size() for p in params]
        self._largest = max([self._largest, *sizes])
        self._total = max(self._total, sum(sizes))

    @property
    def reserved_bytes(self) -> int:
        """What the slabs take (on CUDA: what they pin)."""
        return sum(slab.memory.numel() for slab in self._slabs)

    def holds(self, tensor: torch.Tensor) -> bool:
        address = tensor.untyped_storage().data_ptr()
        return any(slab.memory.untyped_storage().data_ptr() == address for slab in self._slabs)

    def take(self, sizes: list[int]) -> list[torch.Tensor]:
        """A region (uint8) of each of ``sizes`` bytes, `aligned`; new slabs are checked
        against the host budget together first: if that raises, nothing changed."""
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
        """Where each region goes, largest first, without allocating: (slab index, offset),
        and the new slabs' sizes."""
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
                    rooms.append([0, max(size, power_of_two_at_least(need))])
                else:  # the one exact new slab, grown by this region
                    if len(rooms) == existing:
                        rooms.append([0, 0])
                    rooms[-1][1] += need
                index = len(rooms) - 1
            where[i] = (index, rooms[index][0])
            rooms[index][0] += need
        return where, [end for _, end in rooms[existing:]]
