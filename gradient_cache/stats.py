"""The compression summary and the memory readings it carries."""

from __future__ import annotations

from typing import Any

import psutil

from .engine.hostmem import available_host_bytes
from .engine.pipeline import Pipeline
from .engine.pool import HostPool

MIB = 2**20


def process_rss_mb() -> float:
    """Resident memory of this process (psutil), in MiB."""
    return psutil.Process().memory_info().rss / MIB


def compression_summary(pipeline: Pipeline, *, num_excluded: int) -> dict[str, Any]:
    """Figures of the pending or last step; see GradientCacheHookManager.get_compression_summary."""
    pending = bool(pipeline.cached)
    layers = (pipeline.describe(pipeline.cached) if pending else pipeline.last_step).layers
    dense = sum(layer.dense_bytes for layer in layers.values())
    stored = sum(layer.stored_bytes for layer in layers.values())
    compressed = [layer for layer in layers.values() if layer.compressed]
    compressed_numel = sum(layer.numel for layer in compressed)
    return {
        "compression_ratio": pipeline.ratio,
        "device": str(pipeline.backend.device),
        "overall_compression_ratio": dense / stored if stored else 1.0,
        "memory_saved_mb": dense / MIB,
        "dense_gradient_mb": dense / MIB,
        "stored_gradient_mb": stored / MIB,
        "kept_fraction": (
            sum(layer.kept for layer in compressed) / compressed_numel if compressed_numel else 1.0
        ),
        "stored_fraction": stored / dense if dense else 1.0,
        "residual_mb": pipeline.residual_bytes() / MIB,
        "host_held_mb": (stored + pipeline.residual_bytes()) / MIB,
        "process_rss_mb": process_rss_mb(),
        "host_available_mb": available_host_bytes() / MIB,
        "host_pool": _pool_figures(getattr(pipeline.backend, "pool", None)),
        "steps": pipeline.steps,
        "step_pending": pending,
        "num_offloaded_parameters": len(pipeline.names),
        "num_excluded_parameters": num_excluded,
        "layers": {
            name: {
                "numel": layer.numel,
                "dense_bytes": layer.dense_bytes,
                "stored_bytes": layer.stored_bytes,
                "kept_fraction": layer.kept / layer.numel,
                "compressed": layer.compressed,
            }
            for name, layer in layers.items()
        },
    }


def _pool_figures(pool: HostPool | None) -> dict[str, Any] | None:
    """The CUDA backend's pinned pool, or None where the backend has none."""
    if pool is None:
        return None
    return {
        "capacity_mb": pool.capacity_bytes / MIB,  # a fixed slot per parameter; never grows
        "pinned": pool.pinned,
    }
