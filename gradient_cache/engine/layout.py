"""A gradient's memory layout: a restored gradient takes its parameter's strides.

Plain PyTorch gives ``param.grad`` the parameter's strides where the parameter is dense and
non-overlapping (a channels_last convolution weight, a transposed view), contiguous ones
elsewhere. Fused and foreach optimizers walk gradients and parameters in memory order, so a
gradient restored in another layout trains differently (fused AdamW) or slowly (foreach).
The cache therefore moves a gradient as its entries in memory order, a flat view where the
gradient has its parameter's layout, and restores it into the same strides.
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
