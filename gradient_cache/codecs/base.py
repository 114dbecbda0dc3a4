"""What a codec is: it encodes a flat gradient into a payload and says what that costs.

The engine picks one codec per parameter (`engine.route`) and calls nothing else of it. A
new codec is a module with a `Codec` subclass and one entry in `registry.CODECS` (its
builder, whether ``codec=None`` may choose it, its options class if it has knobs); no
pipeline code changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .generators import RandomSource
from .payloads import Payload
from .residual import ResidualCodec

Shapes = list[tuple[int, torch.dtype]]


class Codec(ABC):
    """Encodes flat gradients; one instance serves every parameter it is chosen for."""

    #: Its registry name: set on the class, or per instance (the block codecs).
    name: str
    #: Whether its payloads differ from the gradient (the summary's ``compressed``).
    lossy: ClassVar[bool] = True
    #: The stored form of its error-feedback residual; None: it keeps no residual.
    residual: ResidualCodec | None = None

    @abstractmethod
    def encode(
        self,
        flat: torch.Tensor,
        residual: torch.Tensor | None,
        *,
        loss_scale: torch.Tensor | None,
    ) -> tuple[Payload, torch.Tensor | None]:
        """``flat``'s payload and the new residual (stored form), on ``flat``'s device.

        ``residual`` (stored form, read, never written) is the last one, None if there is
        none yet. ``loss_scale``: a GradScaler's scale (0-dim tensor) ``flat`` carries.
        """

    @abstractmethod
    def payload_shapes(self, numel: int, dtype: torch.dtype) -> Shapes:
        """(numel, dtype) of each of the largest payload's tensors, in `Payload.tensors` order."""

    def generators(self) -> dict[str, RandomSource]:
        """Its random generators by name (checkpointed, rewound by a discarded step)."""
        return {}

    def scratch_tensors(self) -> list[torch.Tensor]:
        """Reusable buffers it holds between calls (memory accounting counts them)."""
        return []

    def release_scratch(self) -> None:  # noqa: B027 - only a codec with scratch overrides it
        """Drop those buffers (after each backward's last bucket)."""


def shapes_bytes(shapes: Shapes) -> int:
    return sum(numel * dtype.itemsize for numel, dtype in shapes)
