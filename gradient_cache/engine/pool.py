"""The host pool: a few pinned slabs, cut once into a fixed slot per parameter.

Every parameter's payload has a largest size known before training starts (its route:
the dense gradient, or ``keep_count`` values and indices, since the CUDA backend selects
exactly), so the slabs are laid out at construction and never grow: a backward hook never
allocates host memory, and a full pool cannot happen. The warm-up's end cuts the smaller
steady slots from the same slabs (`HostPool.relaid`). A slot is rewritten by the next
device-to-host copy of its parameter; see docs/ARCHITECTURE.md for what orders that copy
after the slot's last restore.

PyTorch's caching host allocator rounds each pinned request up to a power of two, and a
library cannot change that for its user: one slab of exactly the bytes needed would pin
up to twice them (5 GiB pins 8). So the regions are packed (`pack_slabs`) into slabs
whose sizes are powers of two already, and the reserve is what the slots need plus the
slabs' unfilled ends (within 2% on the models tested).

Pinning is decided slab by slab (`HostSlabs`): where the OS refuses to pin one slab, that
slab is pageable and its copies block, while every other slab stays pinned.
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

ALIGN = 64  # bytes: every region starts on a 64-byte boundary, fast copies for any dtype
# Below this many bytes left to place, one power-of-two slab takes them all.
SMALL_SLAB = 2**20
# What a layout is keyed by: the engine's parameters (tests use other keys).
K = TypeVar("K", bound=Hashable)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _power_of_two_at_least(nbytes: int) -> int:
    return 1 << max(0, nbytes - 1).bit_length()


def pack_slabs(sizes: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Place regions of ``sizes`` (bytes, multiples of `ALIGN`) in power-of-two slabs.

    Returns each slab's size and its (region index, byte offset) pairs. Two ways to go on
    at each slab, and the one that reserves fewer bytes in the end is taken: one slab for
    everything left (the smallest power of two that holds it), or the largest power of two
    within the bytes left (at least the largest region left), filled first fit from the
    largest region down, then the rest the same way. It never reserves more than one slab
    of the whole would; on real models (tests/test_engine.py: the demo's GPTs and the
    planner's 1.3B GPT) it reserves at most 2% (or `SMALL_SLAB`) more than they need. A
    few regions each just above a power of two can still leave up to about the largest
    region unused: regions are not split across slabs.
    """
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    return _pack(order, sizes)


def _pack(left: list[int], sizes: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    if not left:
        return []
    remaining = sum(sizes[i] for i in left)
    whole = _power_of_two_at_least(max(remaining, ALIGN))
    offsets = itertools.accumulate((sizes[i] for i in left), initial=0)
    in_one = [(whole, list(zip(left, offsets, strict=False)))]
    part = max(whole // 2, _power_of_two_at_least(sizes[left[0]]))
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
    """What one parameter's slot holds: a region per payload tensor, and its residual.

    ``regions``: bytes of each region, in `Payload.tensors` order, sized for the largest
    payload the parameter's route can make. ``residual``: the host residual's stored
    (numel, dtype), None where the residual is not kept on the host; with
    ``spare_residual`` it has a second slot for a pending step's new residual.
    """

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
    """One parameter's host memory: byte regions for its payload, and its residual.

    With ``keep_previous_residual`` the residual has two slots: the current one, and a
    spare that receives a pending step's new residual; they swap when that step
    completes (`residuals.HostSlotResiduals`).
    """

    regions: list[torch.Tensor]  # uint8
    residual: torch.Tensor | None  # stored form, when kept on the host
    spare_residual: torch.Tensor | None

    def region_for(self, index: int, tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Region ``index`` from byte ``offset`` on, viewed as a tensor of ``tensor``'s
        dtype and numel."""
        nbytes = tensor.numel() * tensor.element_size()
        return self.regions[index][offset : offset + nbytes].view(tensor.dtype)


def _fits(spec: SlotSpec, room: Slot) -> bool:
    """Whether ``spec``'s slot fits in ``room`` (uint8 views), part by part."""
    if len(spec.regions) != len(room.regions):
        return False
    if any(nbytes > view.numel() for nbytes, view in zip(spec.regions, room.regions, strict=True)):
        return False
    if spec.residual is None:
        return True
    numel, dtype = spec.residual
    nbytes = numel * dtype.itemsize
    if room.residual is None or room.residual.numel() < nbytes:
        return False
    spare = room.spare_residual
    return not spec.spare_residual or (spare is not None and spare.numel() >= nbytes)


class HostSlabs:
    """Host slabs, pinned where the OS lets it: a slab whose pinning fails is pageable (one
    warning), and only its copies block; later slabs are pinned again where they can be.

    ``allocate_pinned(nbytes)`` gives a pinned slab (None: pinning is off, every slab is
    pageable). `is_pinned` answers for any view of a slab it gave.
    """

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
                self._warn_once(error)
        slab = torch.empty(nbytes, dtype=torch.uint8)
        storage = slab.untyped_storage()
        self._pageable[storage.data_ptr()] = StorageWeakRef(storage)
        return slab

    def is_pinned(self, view: torch.Tensor) -> bool:
        """Whether ``view`` (of a slab from here) lies in pinned memory: a copy to or from
        it may be non-blocking."""
        if not self.pinning:
            return False
        storage = view.untyped_storage()
        ref = self._pageable.get(storage.data_ptr())
        return ref is None or ref.expired()

    def _warn_once(self, error: RuntimeError) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"gradient-cache could not pin host memory ({error}); using pageable memory for "
            "what could not be pinned, so every copy between the device and it blocks the "
            "host: the gradients' and the optimizer state's, and with offload_parameters=True "
            "each block's weights, twice a micro-batch. Free pinned memory (other processes' "
            "pinned buffers, a DataLoader's pin_memory=True), or set pin_memory=False to "
            "silence this.",
            RuntimeWarning,
            stacklevel=5,
        )


class HostPool(Generic[K]):
    """The slabs and their per-parameter slots, laid out by ``layout`` (`pack_slabs`).

    ``allocate_pinned(nbytes)`` gives a pinned slab; where it raises (a CPU-only torch,
    or an OS that refuses to lock pages) that slab is pageable, with one warning
    (`HostSlabs`), and copies into it block. ``slabs``: allocate from these instead (a
    relaid pool keeps its predecessor's, which know every slab given so far). Host
    residual slots start at zero, as a new residual does.
    """

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
        # Each parameter's bytes in the slabs (uint8, aligned sizes), as ``layout`` cut
        # them: `relaid` cuts a later layout's slots from these, so the slabs are never
        # allocated twice.
        self._rooms: dict[K, Slot] = {}
        taken = iter(views)
        for key, spec in layout.items():
            regions = [next(taken) for _ in spec.regions]
            residual = spare = None
            if spec.residual is not None:
                residual = next(taken)
                if spec.spare_residual:
                    spare = next(taken)
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
        """A pool for ``layout`` (the warm-up's room dropped), in this pool's slabs.

        Where every slot of ``layout`` fits in the room its parameter had when the slabs
        were cut (the pool is built for the first step's layout, which holds every later
        one), the new pool cuts its slots from the same bytes, at the same offsets, and
        allocates nothing. New slabs would pin more than the host check approved:
        PyTorch's caching host allocator keeps a freed pinned block for later requests of
        its size rather than giving it back, and smaller slabs cannot reuse it. Otherwise
        it allocates a new pool.

        The caller orders the reuse: nothing in flight may still write these bytes, nor
        read the residual slots (zeroed here, by the host), and a later copy into a
        payload region must follow any restore still reading it.
        """
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
