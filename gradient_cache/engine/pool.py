"""The host pool: a few pinned slabs, cut once into a fixed slot per parameter.

Each payload's largest size is known from its route before training, so the slabs are laid
out at construction and never grow: a hook never allocates host memory. The warm-up's end
cuts the smaller steady slots from the same slabs (`HostPool.relaid`). PyTorch's caching
host allocator rounds each pinned request up to a power of two (5 GiB pins 8), so the slabs
are powers of two already (`pack_slabs`). A slab the OS refuses to pin is pageable alone.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .users_line import outside_the_package

ALIGN = 64  # bytes: every region starts on a 64-byte boundary, fast copies for any dtype
# Below this many bytes left to place, one power-of-two slab takes them all.
SMALL_SLAB = 2**20
# What a layout is keyed by: the engine's parameters (tests use other keys).
K = TypeVar("K", bound=Hashable)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def power_of_two_at_least(nbytes: int) -> int:
    return 1 << max(0, nbytes - 1).bit_length()


def pack_slabs(sizes: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Place regions of ``sizes`` (bytes, multiples of `ALIGN`) in power-of-two slabs:
    each slab's size and its (region index, byte offset) pairs. At each slab, whichever
    reserves less in the end: one slab for all that is left, or the largest power of two
    within it, filled first fit from the largest region down. Never more than one slab of
    the whole; regions are not split, so the largest region's size can go unused."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    return _pack(order, sizes)


def _pack(left: list[int], sizes: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    if not left:
        return []
    remaining = sum(sizes[i] for i in left)
    whole = power_of_two_at_least(max(remaining, ALIGN))
    offsets = itertools.accumulate((sizes[i] for i in left), initial=0)
    in_one = [(whole, list(zip(left, offsets, strict=False)))]
    part = max(whole // 2, power_of_two_at_least(sizes[left[0]]))
    if remaining <= SMALL_SLAB or part >= whole:
        return in_one
    placed, rest, offset = [], [], 0
    for index in left:
        if offset + sizes[index] <= part:
            placed.append((index, offset))
            offset += sizes[index]
        else:
            rest.append(index)
    in_parts = [(part, placed), *_pack(rest, sizes)]
    return min(in_parts, in_one, key=lambda slabs: sum(size for size, _ in slabs))


def reserved_bytes(layout: Mapping[Any, SlotSpec]) -> int:
    """The pinned bytes a `HostPool` of ``layout`` reserves: its slabs' sizes."""
    return sum(size for size, _ in pack_slabs(_region_sizes(layout)))


def _region_sizes(layout: Mapping[Any, SlotSpec]) -> list[int]:
    """Aligned bytes of every region of ``layout``, in `SlotSpec.parts` order."""
    return [aligned(nbytes) for spec in layout.values() for nbytes in spec.parts()]


@dataclass(frozen=True)
class SlotSpec:
    """One parameter's slot: ``regions``, bytes per payload tensor (`Payload.tensors`
    order, for the route's largest payload); ``residual``, the host residual's stored
    (numel, dtype) or None; ``spare_residual``, a second one for a pending step's."""

    regions: tuple[int, ...]
    residual: tuple[int, torch.dtype] | None = None
    spare_residual: bool = True

    def parts(self) -> list[int]:
        """Bytes of each region the slot takes: payload regions, residual, its spare."""
        residual = []
        if self.residual is not None:
            numel, dtype = self.residual
            residual = [numel * dtype.itemsize] * (2 if self.spare_residual else 1)
        return [*self.regions, *residual]

    @property
    def nbytes(self) -> int:
        """Bytes the slot needs (regions aligned); `reserved_bytes` is what a pool pins."""
        return sum(map(aligned, self.parts()))


@dataclass
class Slot:
    """One parameter's host memory: its payload's byte regions, its residual where kept on
    the host, and with ``spare_residual`` a spare for a pending step's new one (they swap
    when it completes: `HostSlotResiduals`)."""

    regions: list[torch.Tensor]  # uint8
    residual: torch.Tensor | None  # stored form, when kept on the host
    spare_residual: torch.Tensor | None

    def region_for(self, index: int, tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Region ``index`` from byte ``offset``, viewed as ``tensor``'s dtype and numel."""
        nbytes = tensor.numel() * tensor.element_size()
        return self.regions[index][offset : offset + nbytes].view(tensor.dtype)


def _fits(spec: SlotSpec, room: Slot) -> bool:
    """Whether ``spec``'s slot fits in ``room`` (uint8 views), part by part."""
    views = [*room.regions, room.residual, room.spare_residual]  # as `SlotSpec.parts` orders
    return len(spec.regions) == len(room.regions) and all(
        view is not None and nbytes <= view.numel()
        for nbytes, view in zip(spec.parts(), views, strict=False)
    )


class HostSlabs:
    """Host slabs from ``allocate_pinned(nbytes)`` (None: pinning off). A slab whose
    pinning fails is pageable (one warning) and only its copies block."""

    def __init__(self, allocate_pinned: Callable[[int], torch.Tensor] | None) -> None:
        self.pinning = allocate_pinned is not None
        self._allocate_pinned = allocate_pinned
        self._warned = False
        # The pageable slabs given while pinning is on, by storage address (their weak
        # references tell a freed slab's address, reused by a later slab, from its own).
        self._pageable: dict[int, StorageWeakRef] = {}

    def __call__(self, nbytes: int) -> torch.Tensor:
        """A slab (uint8) of ``nbytes``: pinned, unless pinning is off or this one failed."""
        if self._allocate_pinned is not None:
            try:
                return self._allocate_pinned(nbytes)
            except RuntimeError as error:
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"gradient-cache could not pin host memory ({error}); using pageable "
                        "memory for what could not be pinned, so every copy between the device "
                        "and it blocks the host: the gradients' and the optimizer state's, and "
                        "with offload_parameters=True each block's weights, twice a "
                        "micro-batch. Free pinned memory (other processes' pinned buffers, a "
                        "DataLoader's pin_memory=True), or set pin_memory=False to silence this.",
                        RuntimeWarning,
                        stacklevel=outside_the_package(),
                    )
        slab = torch.empty(nbytes, dtype=torch.uint8)
        storage = slab.untyped_storage()
        self._pageable[storage.data_ptr()] = StorageWeakRef(storage)
        return slab

    def is_pinned(self, view: torch.Tensor) -> bool:
        """Whether ``view`` (of a slab from here) is pinned: its copies may be non-blocking."""
        if not self.pinning:
            return False
        ref = self._pageable.get(view.untyped_storage().data_ptr())
        return ref is None or ref.expired()


class HostPool(Generic[K]):
    """The slabs and their per-parameter slots, laid out by ``layout`` (`pack_slabs`).
    ``allocate_pinned``: as `HostSlabs`'; ``slabs``: allocate from these instead (a relaid
    pool keeps its predecessor's). Host residual slots start at zero, as a new residual."""

    def __init__(
        self,
        layout: Mapping[K, SlotSpec],
        *,
        allocate_pinned: Callable[[int], torch.Tensor] | None = None,
        slabs: HostSlabs | None = None,
    ) -> None:
        self.host_slabs = HostSlabs(allocate_pinned) if slabs is None else slabs
        sizes = _region_sizes(layout)
        views: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * len(sizes)
        self._slabs = []
        for size, placed in pack_slabs(sizes):
            slab = self.allocate_slab(size)
            self._slabs.append(slab)
            for index, offset in placed:
                views[index] = slab[offset : offset + sizes[index]]
        # Each parameter's bytes as ``layout`` cut them: `relaid` cuts later slots from these.
        self._rooms: dict[K, Slot] = {}
        taken = iter(views)
        for key, spec in layout.items():
            regions = [next(taken) for _ in spec.regions]
            residual = None if spec.residual is None else next(taken)
            spare = next(taken) if residual is not None and spec.spare_residual else None
            self._rooms[key] = Slot(regions, residual, spare)
        self._lay(layout)

    def _lay(self, layout: Mapping[K, SlotSpec]) -> None:
        """Cut each slot of ``layout`` from the front of its parameter's room (it fits)."""
        self.layout = dict(layout)
        self.slots: dict[K, Slot] = {}
        for key, spec in self.layout.items():
            room = self._rooms[key]
            regions = [
                view[:nbytes] for view, nbytes in zip(room.regions, spec.regions, strict=True)
            ]
            residual = spare = None
            if spec.residual is not None:
                assert room.residual is not None  # `_fits` checked it
                numel, dtype = spec.residual
                nbytes = numel * dtype.itemsize
                residual = room.residual[:nbytes].view(dtype).zero_()
                if spec.spare_residual:
                    assert room.spare_residual is not None
                    spare = room.spare_residual[:nbytes].view(dtype)
            self.slots[key] = Slot(regions, residual, spare)

    def allocate_slab(self, nbytes: int) -> torch.Tensor:
        """A slab (uint8) of ``nbytes``, pinned where it can be (`HostSlabs`)."""
        return self.host_slabs(nbytes)

    @property
    def pinned(self) -> bool:
        """Whether pinning is on and every slab of the pool is pinned."""
        return self.host_slabs.pinning and all(map(self.is_pinned, self._slabs))

    def is_pinned(self, view: torch.Tensor) -> bool:
        """Whether ``view`` (of a slab the pool allocated) lies in pinned memory."""
        return self.host_slabs.is_pinned(view)

    def relaid(self, layout: Mapping[K, SlotSpec]) -> HostPool[K]:
        """A pool for ``layout`` cut from this pool's bytes where each slot fits its room
        (else a new pool): new slabs would pin more than the host check approved, since the
        caching host allocator keeps a freed pinned block for requests of its size only.
        The caller orders the reuse: nothing in flight writes these bytes or reads the
        residual slots (zeroed here), and later copies follow any restore reading them."""
        rooms = self._rooms
        if all(key in rooms and _fits(spec, rooms[key]) for key, spec in layout.items()):
            pool = copy.copy(self)  # the same slabs, rooms and allocator
            pool._lay(layout)
            return pool
        return HostPool(layout, slabs=self.host_slabs)

    @property
    def needed_bytes(self) -> int:
        """What the slots take (regions aligned)."""
        return sum(spec.nbytes for spec in self.layout.values())

    @property
    def capacity_bytes(self) -> int:
        """What the slabs reserve: powers of two, so the pinned allocator adds nothing."""
        return sum(slab.numel() for slab in self._slabs)
