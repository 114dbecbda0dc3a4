"""Gradient norms as ``torch.nn.utils.clip_grad_norm_`` computes them, on the device.

The fused step's clip norm is summed from per-parameter norms. The encodes compute them
on the encode stream while backward goes on (`Capture._encode`, once a clipped fused
step asked for a norm type), so the step reduces a handful of device scalars instead of
reading every payload on the host while the device idles.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TypeVar

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support


def gradient_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``grad``'s norm in its dtype, by the kernel ``clip_grad_norm_`` uses on its device:
    ``torch._foreach_norm`` where foreach runs (CUDA), else ``linalg.vector_norm``. Each
    tensor's foreach norm is reduced alone, so one tensor gives the bits it gets in the
    list ``clip_grad_norm_`` passes."""
    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], norm_type)[0]
    return torch.linalg.vector_norm(grad, norm_type)


class StepNorms:
    """One step's per-gradient norms of ``norm_type``, in device buffers (one per dtype,
    a slot per parameter) allocated as the step begins, in the step's first hook, on the
    stream current there: the compute stream, or under FSDP2 its post-reduce stream. The
    encode stream writes a slot after its wait on that stream; the fused step reads them
    on its own stream after the drain's host wait (which the writes precede), and drops
    them as the step finishes. The allocating stream's next use of the blocks comes in the
    next backward, after that backward's compute-stream work (FSDP2 orders its post-reduce
    stream after it), and so after the step's reads, queued before on that stream."""

    def __init__(
        self,
        slots: Mapping[torch.nn.Parameter, tuple[torch.dtype, int]],
        norm_type: float,
        device: torch.device,
    ) -> None:
        self.norm_type = norm_type
        self._slots = slots
        sizes = Counter(dtype for dtype, _ in slots.values())
        self._buffers = {
            # A norm is real: a complex gradient's is in its real dtype, as torch gives it.
            dtype: torch.empty(size, dtype=dtype.to_real(), device=device)
            for dtype, size in sizes.items()
        }
        self._written: set[torch.nn.Parameter] = set()

    def write(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """``grad``'s norm in ``param``'s slot (replacing an earlier micro-batch's)."""
        dtype, index = self._slots[param]
        self._buffers[dtype][index].copy_(gradient_norm(grad, self.norm_type))
        self._written.add(param)

    def put(self, param: torch.nn.Parameter, norm: torch.Tensor) -> None:
        """``norm`` in ``param``'s slot, as an encode wrote it (a checkpoint's)."""
        dtype, index = self._slots[param]
        self._buffers[dtype][index].copy_(norm)
        self._written.add(param)

    def written(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        return {param: norm for param in self._written if (norm := self.get(param)) is not None}

    def get(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s norm, None if no encode wrote it."""
        if param not in self._written:
            return None
        dtype, index = self._slots[param]
        return self._buffers[dtype][index]


def norm_slots(
    params: Iterable[torch.nn.Parameter],
) -> dict[torch.nn.Parameter, tuple[torch.dtype, int]]:
    """Each parameter's (buffer dtype, index) in a `StepNorms`: its gradient's dtype."""
    counts: Counter[torch.dtype] = Counter()
    slots = {}
    for param in params:
        slots[param] = (param.dtype, counts[param.dtype])
        counts[param.dtype] += 1
    return slots


def clip_factor(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """``clip_grads_with_norm_``'s factor, in its bits: ``max_norm / (total + 1e-6)``, at
    most 1. The one place the clip factor is computed (the fused step's clip, a clip
    answered from the cache)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


Norm = TypeVar("Norm", bound=torch.Tensor)


def clip_order(
    model_order: Mapping[torch.nn.Parameter, int], stepped: Iterable[torch.nn.Parameter]
) -> Mapping[torch.nn.Parameter, int]:
    """The order the clip sums its norms in: the cached model's, as
    ``clip_grad_norm_(model.parameters())``; where the optimizer also steps parameters the
    cache does not hold (a cache over a submodule), the optimizer's, which is that call's
    order where the optimizer was built from the whole model's ``parameters()``."""
    stepped = list(stepped)
    if all(param in model_order for param in stepped):
        return model_order
    return {param: index for index, param in enumerate(stepped)}


def clip_grad_norm_order(
    norms: dict[torch.nn.Parameter, Norm], model_order: Mapping[torch.nn.Parameter, int]
) -> list[tuple[torch.nn.Parameter, Norm]]:
    """``norms`` in the order ``clip_grad_norm_(model.parameters())`` sums them: grouped by
    device and dtype as torch groups them there (`_group_tensors_by_device_and_dtype`, whose
    groups do not come in order of first appearance: [fp32, bf16] gives bf16 first), each
    group in the model's order. A norm has its gradient's dtype and device (where it was
    taken), not the parameter's: with the weights on the host a parameter at rest is a host
    master, or (a block a memory budget keeps) a device tensor, while every gradient is on
    the device, as plain PyTorch's.

    A sum of floats depends on its order, so any other (the optimizer's: nanoGPT's decay
    and no-decay groups) gives another norm in the last bit, and the weights drift. The
    order is the same in every process, so under FSDP2 every rank sums alike. Parameters
    the model does not list (another module's, in the same optimizer) go last.
    """
    if not norms:
        return []  # no gradient at all (a dropped batch): plain's norm is 0 then
    last = len(model_order)
    ordered = sorted(norms, key=lambda param: model_order.get(param, last))
    # Grouped by the gradient's dtype: a complex one's norm is real but its group its own.
    keys: list[torch.Tensor | None] = [
        norms[p].to(p.dtype) if p.is_complex() else norms[p] for p in ordered
    ]
    groups = _group_tensors_by_device_and_dtype([keys], with_indices=True)
    return [(ordered[i], norms[ordered[i]]) for _, indices in groups.values() for i in indices]
