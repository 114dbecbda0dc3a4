"""What the engine reports: a step's figures per layer, and the tensors it has now."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .pipeline import Pipeline

Param = torch.nn.Parameter


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
    the optimizer state's host copies (``offload_optimizer_state``) and the weights'
    masters (``offload_parameters``).
    ``scratch``: on the device: the codecs' reusable buffers (kept within a backward) and
    their fixed tables. ``waiting``: on the device: gradients waiting in the open bucket.
    ``weights``: on the device (``offload_parameters``): the weights' device tensors, whose
    storages are resized in place, so the bytes they hold now are their storages' sizes
    now (0 while a weight is on the host), not those they had when first seen.
    """

    host: tuple[torch.Tensor, ...] = ()
    scratch: tuple[torch.Tensor, ...] = ()
    waiting: tuple[torch.Tensor, ...] = ()
    weights: tuple[torch.Tensor, ...] = ()


def cache_tensors(pipeline: Pipeline) -> CacheTensors:
    """What ``pipeline``'s cache has now (a read-only view; see `CacheTensors`)."""
    weights = pipeline.weights
    return CacheTensors(
        host=host_tensors(pipeline),
        scratch=tuple(t for codec in pipeline.codecs.all() for t in codec.scratch_tensors()),
        waiting=tuple(pipeline.assembler.waiting()),
        weights=() if weights is None else weights.device_tensors(),
    )


def host_tensors(pipeline: Pipeline) -> tuple[torch.Tensor, ...]:
    """`CacheTensors.host` alone: the demo's CPU tracker reads it before every operator,
    where gathering the device-side tensors too took a fifth of a tracked step's time."""
    states, weights = pipeline.optimizer_state, pipeline.weights
    residuals = pipeline.backend.residuals
    on_host = pipeline.config.residual_options.residual_location == "host"
    return (
        *pipeline.store.tensors(),
        *((pipeline.pending and pipeline.pending.random_state) or {}).values(),
        *(residuals.held() if on_host else ()),
        *(() if states is None else states.host_tensors()),
        *(() if weights is None else weights.host_tensors()),
    )
