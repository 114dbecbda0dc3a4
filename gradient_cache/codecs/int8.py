"""Int8 values: every entry kept, as an int8 code with an fp32 scale per block of 64."""

from __future__ import annotations

import torch

from .base import Codec, Shapes
from .dither import Dither
from .generators import RandomSource
from .int8_kernels import int8_blocks_bytes, int8_blocks_encode
from .payloads import DensePayload, Payload, QuantizedPayload


class Int8Quantizer:
    """Stores a payload's kept values as `int8_blocks_encode` codes: about a quarter of fp32.

    Rounding is stochastic (unbiased), its noise from the quantizer's own seeded
    `dither.Dither`: no random number drawn per entry.
    """

    def __init__(self, *, seed: int = 0) -> None:
        self.dither = Dither(seed)

    def quantize(self, payload: Payload) -> QuantizedPayload:
        values, indices = payload.kept_values(), payload.kept_indices()
        packed = int8_blocks_encode(values, self.dither)
        return QuantizedPayload(packed, indices, payload.numel, values.numel(), values.dtype)


class Int8Values(Codec):
    """The ``int8`` codec: every entry kept as an int8 code, with an fp32 scale per 64
    entries (about 3.8x fewer bytes than fp32), no residual. The ladder's first rung:
    ``codec=None`` picks it wherever its bytes fit the budget; ``codec="int8"`` alone."""

    name = "int8"

    def __init__(self, *, seed: int = 0) -> None:
        self.quantizer = Int8Quantizer(seed=seed)

    def encode(
        self,
        flat: torch.Tensor,
        residual: torch.Tensor | None,
        *,
        loss_scale: torch.Tensor | None,
    ) -> tuple[QuantizedPayload, None]:
        return self.quantizer.quantize(DensePayload(flat)), None

    def payload_shapes(self, numel: int, dtype: torch.dtype) -> Shapes:
        return [(int8_blocks_bytes(numel), torch.uint8)]

    def generators(self) -> dict[str, RandomSource]:
        return {"values": self.quantizer.dither}

    def scratch_tensors(self) -> list[torch.Tensor]:
        """The dither tables (dropped after each backward)."""
        return self.quantizer.dither.tables()

    def release_scratch(self) -> None:
        self.quantizer.dither.release()
