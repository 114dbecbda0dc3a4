"""A gradient's memory layout: a restored gradient takes the strides plain PyTorch gives it.

Fused and foreach optimizers walk gradients and parameters in memory order, so a gradient in
another layout trains differently (fused AdamW) or slowly (foreach).
"""

from __future__ import annotations

import torch


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def gradient_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides autograd gives ``tensor``'s gradient: ``tensor``'s own where it is dense
    and non-overlapping, else contiguous ones (the layout contract of ``AccumulateGrad``)."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    expected = 1
    for dim in reversed(memory_order(strides)):
        if shape[dim] != 1 and strides[dim] != expected:
            return contiguous_strides(shape)
        expected *= shape[dim]
    return strides


def memory_order(strides: tuple[int, ...]) -> tuple[int, ...]:
    """The dimensions from the outermost in memory to the innermost (stride 1)."""
    return tuple(sorted(range(len(strides)), key=lambda dim: -strides[dim]))
