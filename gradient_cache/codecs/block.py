"""Low-bit codecs: every entry kept as a 1-4 bit code with an fp32 scale per block.

They hand the optimizer a dense, unbiased (or, for sign, scaled) gradient every step and
keep no residual, so Adam's moment estimates see every coordinate every step: the reason
they train closer to plain PyTorch than top-k at far fewer bytes (perf/RESULTS.md).
"""

from __future__ import annotations

import torch

from . import block_kernels
from .base import Codec, Shapes
from .dither import Dither
from .generators import RandomSource
from .payloads import BlockCodesPayload
from .rotation import built_constants, rotation


class BlockQuantized(Codec):
    """``bits``-bit codes per entry after an optional block rotation (`block_kernels`)."""

    def __init__(self, *, name: str, bits: int, rotate: bool, rounding: str, seed: int = 0) -> None:
        if rounding == "sign" and bits != 1:
            raise ValueError(f"Invalid bits for sign rounding: {bits}; expected 1.")
        self.name = name
        self.bits = bits
        self.rotate = rotate
        self.rounding = rounding
        self.dither = Dither(seed)

    def encode(
        self,
        flat: torch.Tensor,
        residual: torch.Tensor | None,
        *,
        loss_scale: torch.Tensor | None,
    ) -> tuple[BlockCodesPayload, None]:
        packed = block_kernels.encode(
            flat, bits=self.bits, rotate=self.rotate, rounding=self.rounding, dither=self.dither
        )
        return BlockCodesPayload(packed, flat.numel(), flat.dtype, self.bits, self.rotate), None

    def rotation_matrix(self, device: torch.device) -> torch.Tensor:
        """The block rotation ``R`` (a block ``x`` is encoded as ``x @ R``)."""
        return rotation(device)

    def payload_shapes(self, numel: int, dtype: torch.dtype) -> Shapes:
        return [(block_kernels.encoded_bytes(numel, self.bits), torch.uint8)]

    def generators(self) -> dict[str, RandomSource]:
        return {} if self.rounding == "sign" else {"dither": self.dither}

    def scratch_tensors(self) -> list[torch.Tensor]:
        """The dither tables (dropped after each backward) and the rotation's constants
        (under 1 KiB per device, kept for the process)."""
        return self.dither.tables() + built_constants()

    def release_scratch(self) -> None:
        self.dither.release()
