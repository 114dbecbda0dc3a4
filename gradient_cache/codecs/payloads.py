"""Payloads: what a codec makes of one flat gradient, and everything one knows how to do.

The engine never asks which kind a payload is: it asks the payload for its tensors (what a
copy moves and memory accounting counts), its bytes, its kept values (the clip norm), to
add itself into a dense gradient (accumulation), to decode into a dense tensor (restore),
and for its checkpoint state. A new kind of payload is a new subclass here.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from . import block_kernels
from .int8_kernels import int8_blocks_decode

Move = Callable[[torch.Tensor], torch.Tensor]


class Payload(ABC):
    """One flat gradient of ``numel`` entries, encoded."""

    kind: ClassVar[str]  # its name in a checkpoint
    numel: int
    # Every payload is a dataclass (`state` reads its fields).
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors it is made of, in a fixed order (`with_tensors` takes the same)."""

    @abstractmethod
    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> Payload:
        """The same payload held in ``tensors`` (moved, or copied into a host slot)."""

    @property
    @abstractmethod
    def kept(self) -> int:
        """Entries it keeps of the gradient."""

    @abstractmethod
    def kept_values(self) -> torch.Tensor:
        """The kept values in the gradient's dtype (decoded if quantized), in index order."""

    def kept_indices(self) -> torch.Tensor | None:
        """Where the kept values go in the flat gradient; None: every entry, in order."""
        return None

    def placement(self) -> list[tuple[int, int]]:
        """Where each of `tensors` goes in a host slot: (region index, byte offset)."""
        return [(index, 0) for index in range(len(self.tensors()))]

    def followed_by(self, later: torch.Tensor) -> Payload | None:
        """This payload with ``later``, a later micro-batch's gradient in a narrower dtype
        (`NARROW_FLOATS`), kept beside it and added only where the sum is read; None where
        it cannot be (only a lone narrow `DensePayload` can: the two fill an fp32 slot)."""
        return None

    def as_gradient(self) -> torch.Tensor | None:
        """The flat gradient itself where this payload stores it whole, unencoded."""
        return None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def moved(self, move: Move) -> Payload:
        """This payload with ``move`` applied to each of its tensors."""
        return self.with_tensors([move(t) for t in self.tensors()])

    def add_to(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat + payload`` (``payload`` on ``flat``'s device): in place if dense, else new.

        Gradient accumulation adds the cached payload into the next micro-batch's gradient.
        ``new + old`` gives the bits of plain PyTorch's ``old + new``: float addition commutes.
        """
        values = self.kept_values().to(flat.dtype)
        indices = self.kept_indices()
        if indices is None:
            return flat + values
        return flat.index_add(0, indices.long(), values)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """Overwrite the flat tensor ``out`` (on this payload's device) with the gradient."""
        values = self.kept_values().to(out.dtype)
        indices = self.kept_indices()
        if indices is None:
            return out.copy_(values)
        # Indices are unique, so a copy does: 3x faster than index_add_ on a CPU.
        return out.zero_().index_copy_(0, indices.long(), values)

    def restore_into(self, out: torch.Tensor, to_device: Move) -> torch.Tensor:
        """Overwrite ``out`` with the gradient from a host payload, moving what it needs."""
        return self.moved(to_device).decode_into(out)

    def state(self) -> dict[str, Any]:
        """Plain CPU tensors and numbers for a checkpoint (`payload_from_state` reads it)."""
        fields = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                value = value.detach().to("cpu", copy=True)  # never a view of the pool's slab
            elif isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            fields[field.name] = value
        return {"kind": self.kind, **fields}


#: The dtypes a dense payload of an fp32 gradient may hold: a compute dtype's gradient,
#: carried as it came, widened exactly where it is added to or restored.
NARROW_FLOATS = (torch.bfloat16, torch.float16)


@dataclass
class DensePayload(Payload):
    """A whole gradient, kept as it is (in a narrower dtype, `NARROW_FLOATS`, where it came
    so). ``earlier``: an earlier micro-batch's part in that dtype (`followed_by`), where
    it is (its host slot's first half); the gradient is then ``earlier + tensor`` in fp32,
    ``(a + b) + c`` when a third joins, plain PyTorch's order of accumulation."""

    kind: ClassVar[str] = "dense"
    tensor: torch.Tensor  # flat, the gradient's dtype
    earlier: torch.Tensor | None = None

    @property
    def numel(self) -> int:  # type: ignore[override]  # a property here, other payloads a field
        return self.tensor.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [self.tensor] if self.earlier is None else [self.earlier, self.tensor]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> DensePayload:
        *earlier, tensor = tensors
        return DensePayload(tensor, earlier[0] if earlier else None)

    def placement(self) -> list[tuple[int, int]]:
        if self.earlier is None:
            return [(0, 0)]
        return [(0, 0), (0, self.earlier.numel() * self.earlier.element_size())]

    def followed_by(self, later: torch.Tensor) -> DensePayload | None:
        alone = self.earlier is None and self.tensor.dtype in NARROW_FLOATS
        if alone and later.dtype == self.tensor.dtype and later.numel() == self.tensor.numel():
            return DensePayload(later, self.tensor)
        return None

    @property
    def kept(self) -> int:
        return self.tensor.numel()

    def kept_values(self) -> torch.Tensor:
        return self.tensor if self.earlier is None else self._sum()

    def as_gradient(self) -> torch.Tensor | None:
        return self.tensor if self.earlier is None else None

    def _sum(self) -> torch.Tensor:
        """``earlier + tensor``, widened to fp32 first (each widening exact)."""
        assert self.earlier is not None
        return self.earlier.to(torch.float32).add_(self.tensor)

    def add_to(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.add_(self.tensor if self.earlier is None else self._sum())

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        if self.earlier is not None:
            return out.copy_(self.earlier).add_(self.tensor)
        return out.copy_(self.tensor, non_blocking=True)

    def restore_into(self, out: torch.Tensor, to_device: Move) -> torch.Tensor:
        if self.earlier is not None:  # both parts cross as they are, summed on the device
            return out.copy_(to_device(self.earlier)).add_(to_device(self.tensor))
        if self.tensor.dtype != out.dtype:  # a compute dtype's gradient: its own bytes
            return out.copy_(to_device(self.tensor))  # cross, widened on the device
        return out.copy_(self.tensor, non_blocking=True)  # the copy is the move


@dataclass
class SparsePayload(Payload):
    """Selected entries of a flat gradient: ``dense[indices] = values``, zero elsewhere."""

    kind: ClassVar[str] = "sparse"
    values: torch.Tensor  # [k], the gradient's dtype
    indices: torch.Tensor  # [k], int32 where the tensor allows, else int64; unique
    numel: int

    def tensors(self) -> list[torch.Tensor]:
        return [self.values, self.indices]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> SparsePayload:
        values, indices = tensors
        return SparsePayload(values, indices, self.numel)

    @property
    def kept(self) -> int:
        return self.values.numel()

    def kept_values(self) -> torch.Tensor:
        return self.values

    def kept_indices(self) -> torch.Tensor:
        return self.indices


@dataclass
class QuantizedPayload(Payload):
    """Kept entries stored as int8 codes with a per-block scale (`int8_kernels.int8_blocks_encode`).

    ``indices`` None: every entry, in order (a dense gradient); else as `SparsePayload`.
    """

    kind: ClassVar[str] = "quantized"
    packed: torch.Tensor  # uint8: `int8_blocks_encode` of the kept values
    indices: torch.Tensor | None
    numel: int
    count: int  # values packed
    dtype: torch.dtype  # the gradient's

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed] + ([] if self.indices is None else [self.indices])

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> QuantizedPayload:
        packed, *indices = tensors
        return dataclasses.replace(self, packed=packed, indices=indices[0] if indices else None)

    @property
    def kept(self) -> int:
        return self.count

    def kept_values(self) -> torch.Tensor:
        return int8_blocks_decode(self.packed, self.count).to(self.dtype)

    def kept_indices(self) -> torch.Tensor | None:
        return self.indices

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        if self.indices is None and _fp32_gradient(self.dtype, out):
            # Straight into ``out``: no full-size temporary, no second pass to copy it.
            return int8_blocks_decode(self.packed, self.count, out=out.view(-1))
        return super().decode_into(out)


@dataclass
class BlockCodesPayload(Payload):
    """Every entry as a low-bit code with a scale per block (`block_kernels`)."""

    kind: ClassVar[str] = "block_codes"
    packed: torch.Tensor  # uint8: `block_kernels.encode`'s codes, then its fp32 scales
    numel: int
    dtype: torch.dtype  # the gradient's
    bits: int
    rotated: bool

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> BlockCodesPayload:
        (packed,) = tensors
        return dataclasses.replace(self, packed=packed)

    @property
    def kept(self) -> int:
        return self.numel

    def kept_values(self) -> torch.Tensor:
        decoded = block_kernels.decode(self.packed, self.numel, bits=self.bits, rotate=self.rotated)
        return decoded.to(self.dtype)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        if _fp32_gradient(self.dtype, out):  # straight into ``out``, as for int8
            flat = out.view(-1)
            return block_kernels.decode(
                self.packed, self.numel, bits=self.bits, rotate=self.rotated, out=flat
            )
        return super().decode_into(out)


def _fp32_gradient(dtype: torch.dtype, out: torch.Tensor) -> bool:
    """Whether a payload of a ``dtype`` gradient may decode straight into ``out``: fp32
    both (a bf16 gradient's values round to bf16 first), ``out`` contiguous."""
    return dtype == out.dtype == torch.float32 and out.is_contiguous()


PAYLOAD_KINDS: dict[str, type[Payload]] = {
    kind.kind: kind for kind in (DensePayload, SparsePayload, QuantizedPayload, BlockCodesPayload)
}


def payload_from_state(state: dict[str, Any]) -> Payload:
    """The payload `Payload.state` described."""
    fields = dict(state)
    kind = PAYLOAD_KINDS[fields.pop("kind")]
    if "dtype" in fields:
        fields["dtype"] = getattr(torch, fields["dtype"])
    return kind(**fields)
