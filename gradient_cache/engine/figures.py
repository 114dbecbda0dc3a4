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

    ``host``: the cached payloads, host residuals (``residual_location="host"``), the random
    states kept to undo the pending step, the optimizer state's host copies and the weights'
    masters. On the device: ``scratch``, the codecs' reusable buffers (kept within a backward)
    and fixed tables; ``waiting``, the open bucket's gradients; ``weights``, the weights'
    device tensors, resized in place: count their storages' sizes now (0 while on the host).
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
        scratch=tuple(pipeline.codecs.scratch_tensors()),
        waiting=tuple(pipeline.assembler.waiting()),
        weights=() if weights is None else weights.device_tensors(),
    )


def host_tensors(pipeline: Pipeline) -> tuple[torch.Tensor, ...]:
    """`CacheTensors.host` alone: the demo's CPU tracker reads it before every operator,
    where gathering the device-side tensors too took a fifth of a tracked step's time."""
    states, weights = pipeline.optimizer_state, pipeline.weights
    on_host = pipeline.config.residual_options.residual_location == "host"
    return (
        *pipeline.store.tensors(),
        *((pipeline.pending and pipeline.pending.random_state) or {}).values(),
        *(pipeline.backend.residuals.held() if on_host else ()),
        *(() if states is None else states.host_tensors()),
        *(() if weights is None else weights.host_tensors()),
    )
