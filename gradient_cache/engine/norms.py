"""Gradient norms as ``torch.nn.utils.clip_grad_norm_`` computes them, on the device.

Once a clip has named a norm type, the encodes compute per-parameter norms while backward
goes on (`Capture._encode`), so the step reduces a few device scalars instead of reading
every payload on the host.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

Param = torch.nn.Parameter


def gradient_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``grad``'s norm in its dtype by ``clip_grad_norm_``'s kernel on its device
    (``_foreach_norm`` where foreach runs, else ``vector_norm``): foreach reduces each
    tensor alone, so one tensor gets the bits it gets in the list."""
    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], norm_type)[0]
    return torch.linalg.vector_norm(grad, norm_type)


class StepNorms:
    """One step's per-gradient norms of ``norm_type`` in device buffers (one per dtype, a
    slot per parameter), allocated in the step's first hook on the stream current there
    (compute, or FSDP2's post-reduce). The encode stream writes a slot after waiting on
    that stream; the step reads them on the compute stream after the drain's host wait
    (which the writes precede). The allocating stream next uses the blocks in the next
    backward, after that backward's compute work (FSDP2 orders post-reduce after it), so
    after the step's reads."""

    def __init__(
        self,
        slots: Mapping[Param, tuple[torch.dtype, int]],
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
        self._written: set[Param] = set()

    def write(self, param: Param, grad: torch.Tensor) -> None:
        """``grad``'s norm in ``param``'s slot (replacing an earlier micro-batch's)."""
        self.put(param, gradient_norm(grad, self.norm_type))

    def put(self, param: Param, norm: torch.Tensor) -> None:
        """``norm`` in ``param``'s slot, as an encode wrote it (a checkpoint's)."""
        dtype, index = self._slots[param]
        self._buffers[dtype][index].copy_(norm)
        self._written.add(param)

    def written(self) -> dict[Param, torch.Tensor]:
        return {param: norm for param in self._written if (norm := self.get(param)) is not None}

    def get(self, param: Param) -> torch.Tensor | None:
        if param not in self._written:
            return None
        dtype, index = self._slots[param]
        return self._buffers[dtype][index]


def norm_slots(params: Iterable[Param]) -> dict[Param, tuple[torch.dtype, int]]:
    """Each parameter's (buffer dtype, index) in a `StepNorms`: its gradient's dtype."""
    counts: Counter[torch.dtype] = Counter()
    slots = {}
    for param in params:
        slots[param] = (param.dtype, counts[param.dtype])
        counts[param.dtype] += 1
    return slots


def clip_factor(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """``clip_grads_with_norm_``'s factor, in its bits: ``max_norm / (total + 1e-6)``, at
    most 1; computed only here (the fused step's clip, a clip answered from the cache)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def clip_order(model_order: Mapping[Param, int], stepped: Iterable[Param]) -> Mapping[Param, int]:
    """The order the clip sums norms in: the cached model's; where the optimizer also steps
    parameters the cache does not hold (a cache over a submodule), the optimizer's, which
    is ``clip_grad_norm_(model.parameters())``'s where it was built from them."""
    stepped = list(stepped)
    if all(param in model_order for param in stepped):
        return model_order
    return {param: index for index, param in enumerate(stepped)}


def clip_grad_norm_order(
    norms: dict[Param, torch.Tensor], model_order: Mapping[Param, int]
) -> list[tuple[Param, torch.Tensor]]:
    """``norms`` in the order ``clip_grad_norm_(model.parameters())`` sums them (any other
    changes the last bit): grouped by the gradient's device and dtype (not the parameter's:
    a weight at rest may be on the host) as torch groups them, [fp32, bf16] giving bf16
    first, each group in the model's order, parameters it does not list last. The same in
    every process, so FSDP2's ranks sum alike."""
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
