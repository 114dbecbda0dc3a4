"""A weight at rest on the host, guarded (`GuardedAtRest`, its class swapped from a forward's
end to its backward's begin, and from a backward's end to the next forward or step): a use
autograd records gets a pre-hook on its node
that raises by name, on whichever thread reaches it first. ``backward(inputs=)`` and
``autograd.grad`` naming a guarded weight get the nodes its uses recorded (`USES`):
moving ``P.data`` made autograd start a new one. Why: docs/ARCHITECTURE.md, "Traps".

A weight at rest whose forward reads a cast of its master (a *wire*, ``compute_dtype``), or
whose model computes on a device, is watched (`WatchedAtRest`) while not guarded: each
``P.data`` it hands out is counted (`DATA_READS`), since a write through it moves no version
counter and the wire would stay the old cast (diffusers' ``EMAModel.copy_to`` writes
``param.data.copy_(...)``); a copy of it is made on the model's device (`COPIES_ON`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.utils import _pytree as pytree

Param = torch.nn.Parameter

#: Each dressed weight's name, by ``id`` (a tensor's ``==`` is elementwise), for the refusals.
NAMES: dict[int, str] = {}
#: Each guarded weight's uses' nodes since the last backward (`OwnTensors.record_uses`).
USES: dict[int, list[GradientEdge]] = {}
#: How many times each watched or guarded weight at rest handed out ``P.data``, by ``id``.
DATA_READS: dict[int, int] = {}
#: Where a copy (``copy.deepcopy``, ``AveragedModel``) of each dressed weight at rest is made:
#: its model's device, where plain PyTorch's copy of the model would be, beside its buffers.
COPIES_ON: dict[int, torch.device] = {}

_DATA_GET = vars(torch._C.TensorBase)["data"].__get__  # what `P.data` dispatches
#: A dressed weight's fields and operators without its ``__torch_function__``: the
#: subclasses' own calls, and the engine's reads of its weights (a Python call each
#: otherwise).
undispatched = torch._C.DisableTorchFunctionSubclass


class WatchedAtRest(torch.nn.Parameter):
    """A plain ``Parameter`` whose ``P.data`` reads are counted (module docstring)."""

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        _count_data_read(func, args)
        with undispatched():
            try:
                return func(*args, **(kwargs or {}))
            except RuntimeError as error:
                _refuse_if_met_elsewhere(error, args, kwargs)
                raise

    def __deepcopy__(self, memo: dict[int, Any]) -> Param:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad(), undispatched():  # no read counted
            data = self.data.to(COPIES_ON.get(id(self), self.device), copy=True)
            result = Param(data, self.requires_grad)
        result.__dict__ = copy.deepcopy(self.__dict__, memo)
        memo[id(self)] = result
        return result


class GuardedAtRest(WatchedAtRest):
    """A watched ``Parameter`` whose recorded uses refuse their backward (module docstring)."""

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.autograd.backward or func is torch.autograd.grad:
            return _through_recorded_uses(func, args, kwargs)
        result = super().__torch_function__(func, types, args, kwargs)
        if torch.is_grad_enabled():
            nodes = {
                id(t.grad_fn): t.grad_fn
                for t in pytree.tree_leaves(result)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None
            }
            if nodes:
                leaves = pytree.tree_leaves((args, kwargs))
                used = [NAMES.get(id(a), "?") for a in leaves if isinstance(a, cls)]
                for node in nodes.values():
                    node.register_prehook(_refusal(used))
        return result


def _count_data_read(func: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if func == _DATA_GET:
        DATA_READS[id(args[0])] = DATA_READS.get(id(args[0]), 0) + 1


def _refuse_if_met_elsewhere(
    error: RuntimeError, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> None:
    """torch's device-mismatch ``error`` of an operator given a weight at rest on the host and
    device tensors, or of a gradient assigned to it, raised again naming the weights and the
    likely cause."""
    leaves = pytree.tree_leaves((args, kwargs))
    names = [NAMES.get(id(a), "?") for a in leaves if isinstance(a, WatchedAtRest)]
    if re.search("assign a gradient with (device type|dtype)", str(error)):  # not a shape
        raise RuntimeError(
            f"{' '.join(map(repr, names))}.grad = ...: the weight is at rest on the host "
            "(offload_parameters=True), and a gradient autograd computed for it "
            "(torch.autograd.grad) is its compute tensor's, on the device or in the "
            "compute_dtype. Let the cache take the gradients: loss.backward() or "
            "torch.autograd.backward(loss, inputs=[...]), then hook_manager.step(optimizer)."
        ) from error
    if "Expected all tensors to be on the same device" not in str(error):
        return
    raise RuntimeError(
        f"Parameter(s) {', '.join(map(repr, names))} at rest on the host "
        "(offload_parameters=True) met tensors on the device: a block called as "
        "block.forward(x), which skips the hooks that bring its weights, or a weight used "
        "outside its module's forward. Call the blocks as modules (block(x)), and use a "
        "weight inside its module's forward."
    ) from error


def dress(param: Param, *, guarded: bool = False, watched: bool = False) -> None:
    """``param`` as a `GuardedAtRest` where ``guarded``, else a `WatchedAtRest` where
    ``watched``, else a plain ``Parameter`` again; a parameter of another class (a library's
    subclass) is left as it is."""
    wanted = GuardedAtRest if guarded else WatchedAtRest if watched else Param
    if type(param) in (Param, WatchedAtRest, GuardedAtRest) and type(param) is not wanted:
        param.__class__ = wanted


def forget(param: Param) -> None:
    """``param`` a plain ``Parameter`` the weights no longer hold (settled, or closed)."""
    dress(param)
    NAMES.pop(id(param), None)
    DATA_READS.pop(id(param), None)
    COPIES_ON.pop(id(param), None)


def _through_recorded_uses(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``autograd.backward`` or ``grad`` with each input `USES` keeps replaced by its
    nodes; ``grad`` answers one gradient per input given (the sum over a weight's nodes)."""
    grad = func is torch.autograd.grad
    inputs = args[1] if grad else kwargs.get("inputs")
    if inputs is None:  # a whole backward: it reaches the nodes the forward used
        with undispatched():
            return func(*args, **kwargs)
    groups = [USES.get(id(x), [x]) if isinstance(x, torch.Tensor) else [x] for x in inputs]
    flat = [edge for group in groups for edge in group]
    # A weight's node another forward recorded (two forwards, each with its own grad) is not
    # in this graph: asked as unused, refused below only where none of its nodes is (unless
    # the caller gave allow_unused by position, grad's seventh argument: then as given).
    unused = {"allow_unused": True, "materialize_grads": False} if len(args) <= 6 else {}
    with undispatched():
        if not grad:
            return func(*args, **{**kwargs, "inputs": flat})
        results = iter(func(args[0], flat, *args[2:], **{**kwargs, **unused}))
    answers = []
    for x, group in zip(inputs, groups, strict=True):
        parts = [part for part in (next(results) for _ in group) if part is not None]
        if parts:
            answers.append(sum(parts[1:], parts[0]))
        elif kwargs.get("materialize_grads"):
            answers.append(torch.zeros_like(x))
        elif kwargs.get("allow_unused") or not unused:
            answers.append(None)
        else:  # torch's own refusal
            raise RuntimeError(
                "One of the differentiated Tensors appears to not have been used in the "
                "graph. Set allow_unused=True if this is the desired behavior."
            )
    return tuple(answers)


def _refusal(names: list[str]) -> Callable[[Any], None]:
    def refuse(grad_outputs: Any) -> None:
        raise RuntimeError(
            f"Parameter(s) {', '.join(map(repr, names))} were used outside their module's "
            "forward, where their weights are on the host (offload_parameters=True): "
            "a regularizer over model.parameters(), or block.forward(x) instead of block(x). "
            "Its backward would compute on the host beside the block's own on the device. "
            "Put a regularizer into the optimizer (weight_decay) or compute it inside the "
            "block's forward, and call the blocks as modules."
        )

    return refuse
