"""The host pool: one pinned slab, cut once into a fixed slot per parameter.

Every parameter's payload has a largest size known before training starts (its route:
the dense gradient, or ``keep_count`` values and indices, since the CUDA backend selects
exactly), so the slab is laid out at construction and never grows: a backward hook never
allocates host memory, and a full pool cannot happen. A slot is rewritten by the next
device-to-host copy of its parameter; see docs/ARCHITECTURE.md for what orders that copy
after the slot's last restore.

The caching host allocator rounds each pinned request up to a power of two, so one slab
wastes nothing where many small pinned tensors would waste up to half.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes: every region starts on a 64-byte boundary, fast copies for any dtype


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


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

    @property
    def nbytes(self) -> int:
        residual = 0
        if self.residual is not None:
            numel, dtype = self.residual
            residual = aligned(numel * dtype.itemsize) * (2 if self.spare_residual else 1)
        return sum(map(aligned, self.regions)) + residual


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

    def region_for(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Region ``index`` viewed as a tensor of ``tensor``'s dtype and numel."""
        nbytes = tensor.numel() * tensor.element_size()
        return self.regions[index][:nbytes].view(tensor.dtype)


class HostPool:
    """The slab and its per-parameter slots, laid out by ``layout``.

    ``allocate_pinned(nbytes)`` gives a pinned slab; where it raises (a CPU-only torch,
    or an OS that refuses to lock pages) the pool warns once and uses pageable memory,
    whose copies block. Host residual slots start at zero, as a new residual does.
    """

    def __init__(
        self,
        layout: Mapping[Hashable, SlotSpec],
        *,
        allocate_pinned: Callable[[int], torch.Tensor] | None,
    ) -> None:
        self.layout = dict(layout)
        self.pinned = allocate_pinned is not None
        self._allocate_pinned = allocate_pinned
        self._slab = self._allocate(max(ALIGN, sum(s.nbytes for s in self.layout.values())))
        self.slots: dict[Hashable, Slot] = {}
        offset = 0

        def take(nbytes: int) -> torch.Tensor:
            nonlocal offset
            view = self._slab[offset : offset + nbytes]
            offset += aligned(nbytes)
            return view

        for key, spec in self.layout.items():
            regions = [take(nbytes) for nbytes in spec.regions]
            residual = spare = None
            if spec.residual is not None:
                numel, dtype = spec.residual
                residual = take(numel * dtype.itemsize).view(dtype).zero_()
                if spec.spare_residual:
                    spare = take(numel * dtype.itemsize).view(dtype)
            self.slots[key] = Slot(regions, residual, spare)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self._allocate_pinned is not None:
            try:
                return self._allocate_pinned(nbytes)
            except RuntimeError as error:
                warnings.warn(
                    f"gradient-cache could not pin host memory ({error}); using pageable "
                    "memory, so device-to-host copies will block. Set pin_memory=False to "
                    "silence this.",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.pinned = False
        return torch.empty(nbytes, dtype=torch.uint8)

    def relaid(self, layout: Mapping[Hashable, SlotSpec]) -> HostPool:
        """A new pool with the same allocator for ``layout`` (the warm-up's room dropped)."""
        return HostPool(layout, allocate_pinned=self._allocate_pinned)

    @property
    def capacity_bytes(self) -> int:
        return self._slab.numel()
