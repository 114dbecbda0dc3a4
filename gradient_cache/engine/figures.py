"""What the engine reports: a step's figures per layer, and the tensors it has now."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerFigures:
    """What one parameter's gradient cost in the last completed step."""

    numel: int
    dense_bytes: int
    stored_bytes: int
    kept: int
    compressed: bool
    codec: str  # the name of the codec that encoded it


@dataclass
class StepFigures:
    """Each cached layer's figures in one step, by parameter name."""

    layers: dict[str, LayerFigures] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheTensors:
    """The tensors the cache has at one moment, for memory accounting.

    ``host``: in host memory: the cached payloads, the error-feedback residuals kept on the
    host (``residual_location="host"``), the random states kept to undo the pending step and
    the optimizer state's host copies (``offload_optimizer_state``).
    ``scratch``: on the device: the codecs' reusable buffers (kept within a backward) and
    their fixed tables. ``waiting``: on the device: gradients waiting in the open bucket.
    """

    host: tuple[torch.Tensor, ...] = ()
    scratch: tuple[torch.Tensor, ...] = ()
    waiting: tuple[torch.Tensor, ...] = ()
