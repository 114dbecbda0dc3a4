"""The lossless codec: the gradient as it is."""

from __future__ import annotations

import torch

from .base import Codec, Shapes
from .payloads import DensePayload


class Lossless(Codec):
    """Every entry in the gradient's dtype; restoring gives back the same bits."""

    name = "lossless"
    lossy = False

    def encode(
        self,
        flat: torch.Tensor,
        residual: torch.Tensor | None,
        *,
        loss_scale: torch.Tensor | None,
    ) -> tuple[DensePayload, None]:
        return DensePayload(flat), None

    def payload_shapes(self, numel: int, dtype: torch.dtype) -> Shapes:
        return [(numel, dtype)]
