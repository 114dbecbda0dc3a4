"""The compression summary (a typed object; `as_dict()` gives the dict of the original API's
``get_compression_summary()``) and the memory readings it carries."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import psutil

from .engine.hostmem import available_host_bytes
from .engine.pipeline import Pipeline
from .engine.units import MIB


def process_rss_mb() -> float:
    """Resident memory of this process (psutil), in MiB."""
    return psutil.Process().memory_info().rss / MIB


@dataclass(frozen=True)
class LayerSummary:
    """One parameter's gradient in the step described."""

    numel: int
    dense_bytes: int  # the gradient in its own dtype
    stored_bytes: int  # its payload, indices and scales included
    kept_fraction: float  # entries kept
    compressed: bool  # whether its payload differs from the gradient
    codec: str  # the codec that encoded it ("lossless", "int8", "q4", "topk", ...)


@dataclass(frozen=True)
class PoolSummary:
    """The CUDA backend's pinned pool: one slot per parameter, allocated once."""

    capacity_mb: float
    pinned: bool


@dataclass(frozen=True)
class CompressionSummary:
    """Figures of the gradients cached now (``step_pending``) or of the last restored step.

    ``device``: where the gradients were made (on ``cpu`` host RAM: the offload moves
    gradients within the same memory). ``dense_gradient_mb``: dense gradient MiB taken off
    the device (``memory_saved_mb``, the original API's name, in `as_dict`); ``stored_gradient_mb``:
    what holds them, indices and scales included; ``overall_compression_ratio``: the two's
    ratio; ``stored_fraction``: its inverse. ``kept_fraction``: entries kept of the
    compressed tensors (1/100 at ratio 100). ``residual_mb``: error-feedback residuals held
    now, as stored (a pending step's new ones too); ``host_held_mb``: stored gradients plus
    residuals. ``process_rss_mb`` (psutil) and ``host_available_mb`` (psutil, capped by the
    cgroup). ``host_pool``: the CUDA backend's pool, None elsewhere.
    ``optimizer_state_host_mb``: host memory held for the optimizer's state
    (``offload_optimizer_state``); ``optimizer_state_moved_mb``: the state bytes the last
    step moved, to the device and back: its fused steps, every optimizer's.
    ``parameters_host_mb``: host memory held for the weights' masters and, with a
    ``compute_dtype``, their wires (``offload_parameters``); ``parameters_moved_mb``: the
    weight bytes the last step moved, to the device and back: its forward and backward
    passes (every micro-batch's) and its fused steps, every optimizer's. ``steps``: steps
    restored so far (a step delivered by several optimizers counts once), less those a
    GradScaler skipped (a skip is learnt when the next step begins). ``memory_budget``:
    with one, what it decided after its measured steps (or that there is nothing to budget).
    """

    compression_ratio: float
    device: str
    overall_compression_ratio: float
    dense_gradient_mb: float
    stored_gradient_mb: float
    kept_fraction: float
    stored_fraction: float
    residual_mb: float
    host_held_mb: float
    process_rss_mb: float
    host_available_mb: float
    host_pool: PoolSummary | None
    optimizer_state_host_mb: float
    optimizer_state_moved_mb: float
    parameters_host_mb: float
    parameters_moved_mb: float
    steps: int
    step_pending: bool
    num_offloaded_parameters: int
    num_excluded_parameters: int
    layers: dict[str, LayerSummary]
    memory_budget: str = ""  # the budget's decision (`budget.BudgetWatch.note`); "": none

    def as_dict(self) -> dict[str, Any]:
        """The original API's summary dict: these fields, plus ``memory_saved_mb``."""
        figures = dataclasses.asdict(self)
        figures["memory_saved_mb"] = self.dense_gradient_mb
        return figures


def compression_summary(
    pipeline: Pipeline, *, num_excluded: int, memory_budget: str = ""
) -> CompressionSummary:
    """See `CompressionSummary`."""
    # Pending from the first gradient a backward hands over: one waiting in the last,
    # partial bucket is not cached yet (still on the device, in no figure) but the step is.
    pending = pipeline.step_pending
    layers = (
        pipeline.store.figures(pipeline.records, pipeline.store) if pending else pipeline.last_step
    ).layers
    dense = sum(layer.dense_bytes for layer in layers.values())
    stored = sum(layer.stored_bytes for layer in layers.values())
    compressed = [layer for layer in layers.values() if layer.compressed]
    compressed_numel = sum(layer.numel for layer in compressed)
    residual = pipeline.backend.residuals.nbytes()
    pool = pipeline.backend.host_pool()
    states, weights = pipeline.optimizer_state, pipeline.weights
    return CompressionSummary(
        compression_ratio=pipeline.ratio,
        device=str(pipeline.backend.device),
        overall_compression_ratio=dense / stored if stored else 1.0,
        dense_gradient_mb=dense / MIB,
        stored_gradient_mb=stored / MIB,
        kept_fraction=(
            sum(layer.kept for layer in compressed) / compressed_numel if compressed_numel else 1.0
        ),
        stored_fraction=stored / dense if dense else 1.0,
        residual_mb=residual / MIB,
        host_held_mb=(stored + residual) / MIB,
        process_rss_mb=process_rss_mb(),
        host_available_mb=available_host_bytes() / MIB,
        host_pool=None if pool is None else PoolSummary(pool.capacity_bytes / MIB, pool.pinned),
        optimizer_state_host_mb=0.0 if states is None else states.host_bytes / MIB,
        optimizer_state_moved_mb=0.0 if states is None else states.moved_last_step / MIB,
        parameters_host_mb=0.0 if weights is None else weights.host_bytes / MIB,
        parameters_moved_mb=0.0 if weights is None else weights.moved_last_step / MIB,
        steps=pipeline.steps,
        step_pending=pending,
        num_offloaded_parameters=len(pipeline.records),
        num_excluded_parameters=num_excluded,
        layers={
            name: LayerSummary(
                numel=layer.numel,
                dense_bytes=layer.dense_bytes,
                stored_bytes=layer.stored_bytes,
                kept_fraction=layer.kept / layer.numel,
                compressed=layer.compressed,
                codec=layer.codec,
            )
            for name, layer in layers.items()
        },
        memory_budget=memory_budget,
    )
