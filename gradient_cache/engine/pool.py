"""The host pool: one pinned slab, cut once into a fixed slot per parameter.

Every parameter's payload has a largest size known before training starts (the dense
gradient, or ``keep_count`` values and indices: the CUDA backend selects exactly), so
the slab is laid out at construction and never grows: a backward hook never allocates
host memory, and a full pool cannot happen. A slot is rewritten by the next
device-to-host copy of its parameter; see docs/ARCHITECTURE.md for what orders that copy
after the slot's last restore.

The caching host allocator rounds each pinned request up to a power of two, so one slab
wastes nothing where many small pinned tensors would waste up to half.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compression import index_dtype, keep_count

ALIGN = 64  # bytes: every slot starts on a 64-byte boundary, fast copies for any dtype


@dataclass
class Slot:
    """One parameter's host memory: its payload, and its error-feedback residual if kept here."""

    values: torch.Tensor  # dense: numel of the gradient's dtype; compressed: keep_count of it
    indices: torch.Tensor | None  # compressed only: keep_count indices
    residual: torch.Tensor | None  # fp32 numel, when the residual lives on the host


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class SlotSpec:
    """What one parameter's slot holds: its payload and, optionally, its residual."""

    numel: int
    dtype: torch.dtype
    kept: int | None  # entries of a compressed payload; None: the payload is dense
    host_residual: bool

    def shapes(self) -> list[tuple[int, torch.dtype]]:
        """(numel, dtype) of values, then indices if compressed, then the residual if kept."""
        shapes = [(self.numel if self.kept is None else self.kept, self.dtype)]
        if self.kept is not None:
            shapes.append((self.kept, index_dtype(self.numel)))
        if self.host_residual:
            shapes.append((self.numel, torch.float32))
        return shapes

    @property
    def nbytes(self) -> int:
        return sum(_aligned(n * _element_size(d)) for n, d in self.shapes())


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def slot_spec(
    param: torch.nn.Parameter, *, ratio: float, min_compress_numel: int, host_residual: bool
) -> SlotSpec:
    """The slot ``param`` needs: dense below ``min_compress_numel`` or at ratio 1."""
    numel = param.numel()
    kept = None if ratio <= 1 or numel < min_compress_numel else keep_count(numel, ratio)
    return SlotSpec(numel, param.dtype, kept, host_residual and kept is not None)


class HostPool:
    """The slab and its per-parameter slots, laid out by ``layout``.

    ``allocate_pinned(nbytes)`` gives a pinned slab; where it raises (a CPU-only torch,
    or an OS that refuses to lock pages) the pool warns once and uses pageable memory,
    whose copies block. Host residual slots start at zero, as a new residual does.
    """

    def __init__(
        self,
        layout: dict[torch.nn.Parameter, SlotSpec],
        *,
        allocate_pinned: Callable[[int], torch.Tensor] | None,
    ) -> None:
        nbytes = max(ALIGN, sum(spec.nbytes for spec in layout.values()))
        self.pinned = allocate_pinned is not None
        self._slab = self._allocate(nbytes, allocate_pinned)
        self.slots: dict[torch.nn.Parameter, Slot] = {}
        offset = 0
        for param, spec in layout.items():
            views = []
            for numel, dtype in spec.shapes():
                nbytes = numel * _element_size(dtype)
                views.append(self._slab[offset : offset + nbytes].view(dtype))
                offset += _aligned(nbytes)
            indices = views[1] if spec.kept is not None else None
            residual = views[-1].zero_() if spec.host_residual else None
            self.slots[param] = Slot(views[0], indices, residual)

    def _allocate(
        self, nbytes: int, allocate_pinned: Callable[[int], torch.Tensor] | None
    ) -> torch.Tensor:
        if allocate_pinned is not None:
            try:
                return allocate_pinned(nbytes)
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

    @property
    def capacity_bytes(self) -> int:
        return self._slab.numel()
