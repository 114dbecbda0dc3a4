"""`GradientCompressor`: top-k compression of one tensor, for use without the engine.

The engine's codecs live in `gradient_cache.codecs`.
"""

from __future__ import annotations

import math

import torch

from .codecs.topk import TopKSelector, keep_count


class GradientCompressor:
    """Top-k compression of a single tensor, for use without the engine.

    ``GradientCompressor(sparsity=0.99)`` keeps the largest-magnitude 1% of entries.
    ``compress(grad)`` returns ``(values, indices)`` with int64 indices into the
    flattened tensor; ``decompress(values, indices, shape)`` rebuilds the dense tensor.
    """

    def __init__(self, sparsity: float = 0.99, *, selection: str = "exact") -> None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
            raise TypeError(f"sparsity must be a number in [0, 1), got {sparsity!r}.")
        if not 0 <= sparsity < 1:
            raise ValueError(
                f"Invalid sparsity: {sparsity!r}; expected 0 <= sparsity < 1 "
                "(0.99 keeps the largest 1% of entries)."
            )
        self.sparsity = float(sparsity)
        self._selector = TopKSelector(method=selection)

    def compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = grad.detach().reshape(-1)
        k = keep_count(flat.numel(), 1 / (1 - self.sparsity))
        indices = self._selector.select(flat, k)
        if not bool(torch.isfinite(flat[indices]).all()):
            # Non-finite entries: keep everything, so none is hidden from the caller.
            indices = torch.arange(flat.numel(), device=flat.device)
        return flat[indices], indices

    def decompress(
        self, values: torch.Tensor, indices: torch.Tensor, shape: torch.Size | tuple[int, ...]
    ) -> torch.Tensor:
        dense = torch.zeros(math.prod(shape), dtype=values.dtype, device=values.device)
        return dense.index_add_(0, indices.to(values.device), values).reshape(shape)
