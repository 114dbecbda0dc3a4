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

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compression import ResidualCodec, index_dtype, int8_blocks_bytes, keep_count
from .sharding import local_numel

ALIGN = 64  # bytes: every slot starts on a 64-byte boundary, fast copies for any dtype


@dataclass
class Slot:
    """One parameter's host memory: its payload, and its error-feedback residual if kept here.

    With ``keep_previous_residual`` the residual has two slots: the current one, and a
    spare that receives a pending step's new residual; they swap when that step
    completes, and a discarded step leaves the current one untouched. Without it the
    spare is None and the new residual overwrites the current one.
    """

    values: torch.Tensor  # dense: numel of the gradient's dtype; compressed: keep_count of it
    indices: torch.Tensor | None  # compressed only: keep_count indices
    residual: torch.Tensor | None  # stored form (`ResidualCodec`), when kept on the host
    spare_residual: torch.Tensor | None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class SlotSpec:
    """What one parameter's slot holds: its payload and, optionally, its residual."""

    numel: int
    dtype: torch.dtype
    kept: int | None  # entries of a compressed payload; None: the payload is dense
    residual: tuple[int, torch.dtype] | None  # the host residual's stored (numel, dtype)
    spare_residual: bool = True  # a second residual slot, for a pending step's new one
    dense_first: bool = False  # compressed, but warm-up steps store it dense first
    quantized: bool = False  # values stored as int8 blocks (`int8_blocks_encode`)

    def shapes(self) -> list[tuple[int, torch.dtype]]:
        """(numel, dtype) of values, indices if compressed, then the residual (and spare)."""
        count = self.numel if self.kept is None else self.kept
        if self.dense_first or (self.kept is None and not self.quantized):
            values = (self.numel, self.dtype)  # room for a dense, exact payload
        elif self.quantized:
            values = (int8_blocks_bytes(count), torch.uint8)
        else:
            values = (count, self.dtype)
        shapes = [values]
        if self.kept is not None:
            shapes.append((self.kept, index_dtype(self.numel)))
        if self.residual is not None:
            shapes += [self.residual] * (2 if self.spare_residual else 1)
        return shapes

    @property
    def nbytes(self) -> int:
        return sum(_aligned(n * _element_size(d)) for n, d in self.shapes())


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def slot_spec(
    param: torch.nn.Parameter,
    *,
    ratio: float,
    min_compress_numel: int,
    residual_codec: ResidualCodec | None,
    spare_residual: bool = True,
    warmup: bool = False,
    quantized: bool = False,
) -> SlotSpec:
    """The slot ``param`` needs: exact and dense below ``min_compress_numel``.

    ``residual_codec``: the host residual's format, None where it is not kept on the host;
    ``spare_residual``: a second residual slot (``keep_previous_residual``);
    ``warmup``: dense warm-up steps come first, so a compressed slot holds a dense payload;
    ``quantized``: values are stored as int8 blocks.
    """
    numel = local_numel(param)  # this rank's shard under FSDP2
    encoded = numel >= min_compress_numel and (ratio > 1 or quantized)
    kept = keep_count(numel, ratio) if encoded and ratio > 1 else None
    residual = None
    if residual_codec is not None and kept is not None:
        residual = residual_codec.stored_shape(numel)
    return SlotSpec(
        numel,
        param.dtype,
        kept,
        residual,
        spare_residual=spare_residual,
        dense_first=warmup and encoded,
        quantized=quantized and encoded,
    )


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
        self.layout = layout
        self._allocate_pinned = allocate_pinned
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
            residual = spare = None
            if spec.residual is not None and spec.spare_residual:
                residual, spare = views[-2].zero_(), views[-1]
            elif spec.residual is not None:
                residual = views[-1].zero_()
            self.slots[param] = Slot(views[0], indices, residual, spare)

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
    def warmup_sized(self) -> bool:
        """Whether compressed slots still have room for a warm-up step's dense payload."""
        return any(spec.dense_first for spec in self.layout.values())

    def without_warmup_room(self) -> HostPool:
        """A new pool of the same slots, sized for compressed payloads only."""
        layout = {p: dataclasses.replace(s, dense_first=False) for p, s in self.layout.items()}
        return HostPool(layout, allocate_pinned=self._allocate_pinned)

    @property
    def capacity_bytes(self) -> int:
        return self._slab.numel()
