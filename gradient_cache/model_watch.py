"""Refuses a forward pass once the model's parameters no longer match the cache's.

The cache hooks the parameters it was created with. A parameter added, replaced or
unfrozen later would keep its gradient on the device unseen, a model moved to another
device would meet a backend built for the old one, and one cast to another dtype would
meet routes planned for the old one. Raising in a forward pre-hook stops
the step before backward, where an error would leave ``.grad`` half updated.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from .engine.compiled import outside_graphs
from .engine.module_hooks import ModuleHook
from .engine.sharding import is_dtensor
from .engine.step_state import ADVICE, INTERRUPTED, StepStateError


class ParameterWatch:
    """Checks, before each forward of ``model``, that its cached parameters are unchanged.

    Holds weak references only: a replaced parameter is not kept alive by the check.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cached: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        excluded: Sequence[str],
        device: torch.device,
        in_place: Callable[[torch.nn.Parameter], bool] | None = None,
        retry_pending: Callable[[], bool] | None = None,
        at_forward: Callable[[], None] | None = None,
    ) -> None:
        """``in_place``: with the weights on the host (``offload_parameters``), whether a
        parameter is where the cache put it (its host master or its device copy, in the
        compute dtype or its own), which then stands for the dtype and device checks.
        ``retry_pending``: whether a fused step that raised waits for its retry.
        ``at_forward``: called as a forward with gradients begins."""
        self._cached = {name: weakref.ref(param) for name, param in cached}
        # The routes, slots and restores are planned for these dtypes.
        self._dtypes = {name: param.dtype for name, param in cached}
        self._excluded = tuple(excluded)
        self._device = device
        self._in_place = in_place
        self._retry_pending = retry_pending or _never
        self._at_forward = at_forward or _nothing
        self._model = weakref.ref(model)
        # Whether a forward ran under float16 autocast: then a GradScaler is all but sure,
        # and the manager warns if it was not given one (`grad_scaler=`).
        self.saw_fp16_autocast = False
        # prepend: a refusal comes before FSDP2's pre-hook gathers (and leaves the root's
        # parameters unsharded, which a new cache would refuse).
        self._handle = model.register_forward_pre_hook(ModuleHook(self._check), prepend=True)

    def remove(self) -> None:
        self._handle.remove()
        self._retry_pending = _never  # the pipeline is let go with the cache
        self._at_forward = _nothing

    def check_before_step(self) -> None:
        """The forward's check, at the fused step: a change between a backward and its step
        (``p.data = t``, ``model.to(dtype)``) is refused before the step would undo it or
        fail on it."""
        model = self._model()
        if model is not None:
            self._check_parameters(model)

    @outside_graphs
    def _check(self, model: torch.nn.Module, args: object) -> None:
        kind = self._device.type
        if (
            torch.amp.is_autocast_available(kind)  # not on "meta"
            and torch.is_autocast_enabled(kind)
            and torch.get_autocast_dtype(kind) == torch.float16
        ):
            self.saw_fp16_autocast = True
        if torch.is_grad_enabled():
            self._at_forward()
        if torch.is_grad_enabled() and self._retry_pending():
            # Before anything of this forward's backward reaches .grad or the cache, whose
            # capture refuses it too (the engine's step states).
            raise StepStateError(
                "The gradient cache cannot begin a forward with gradients while its step is "
                f"{INTERRUPTED.value}: {ADVICE[INTERRUPTED]} (evaluate under torch.no_grad())."
            )
        self._check_parameters(model)

    def _swapped_for_a_call(self, name: str) -> None:
        """A plain tensor in a parameter's place: ``torch.func.functional_call`` (or
        ``torch.nn.utils.stateless``) for one call. Its gradient goes where the tensor came
        from, as without the cache; with the weights on the host, a tensor computed from a
        weight at rest is a host tensor, refused."""
        if self._in_place is None:
            return
        raise RuntimeError(
            f"{name!r} is a plain tensor in place of its parameter in this forward "
            "(torch.func.functional_call or torch.nn.utils.stateless), while "
            "offload_parameters=True keeps the weights on the host and brings each block's "
            "own parameters to the device: a tensor made from a weight at rest is a host "
            "tensor. Call the model without the override, or call remove_hooks() before "
            "the functional call and create a new cache after."
        )

    def _check_parameters(self, model: torch.nn.Module) -> None:
        changes = []
        to_device = False  # a model.to(device) of weights the cache keeps on the host
        rebound = False  # a P.data = t or a cast of weights the cache keeps on the host
        reparametrized = False  # module.weight = value through torch's parametrize
        present = dict(model.named_parameters())
        for name, ref in self._cached.items():
            param = present.get(name)
            if param is None:
                changes.append(f"{name!r} removed (or tied to another parameter)")
            elif not isinstance(param, torch.nn.Parameter):
                self._swapped_for_a_call(name)  # the parameter is back after the call
            elif param is not ref() and not _unsharded_of(param, ref()):
                changes.append(f"{name!r} replaced by a new Parameter")
            elif self._in_place is not None and (cached := ref()) is not None:
                if not self._in_place(cached):  # the sharded one, not FSDP2's unsharded one
                    moved = cached.device == self._device and self._device.type != "cpu"
                    to_device |= moved
                    rebound |= not moved
                    reparametrized |= not moved and ".parametrizations." in name
                    change = f"moved to {self._device}" if moved else "moved or cast"
                    changes.append(f"{name!r} {change} off the host master it was given")
            elif (cast := _cast_of(ref(), self._dtypes[name])) is not None:
                changes.append(f"{name!r} {cast}")
            elif param.device != self._device:
                changes.append(f"{name!r} moved from {self._device} to {param.device}")
        for name, param in present.items():
            if (
                name not in self._cached
                and param.requires_grad
                and not any(pattern in name for pattern in self._excluded)
            ):
                changes.append(f"{name!r} added or unfrozen")
        if changes:
            shown = "; ".join(changes[:5]) + ("; ..." if len(changes) > 5 else "")
            advice = ""
            if to_device:
                advice = (
                    " With offload_parameters=True the cache keeps the weights on the host and "
                    "brings each block to the device itself: leave model.to(device) out (only "
                    "the batches go to the device)."
                )
            elif rebound:
                advice = (
                    " With offload_parameters=True new values go into a weight in place "
                    "(with torch.no_grad(): param.copy_(new)), not by rebinding param.data "
                    "(or torch.nn.utils.vector_to_parameters); a dtype is chosen before the "
                    "cache is created."
                )
            if reparametrized:
                advice += (
                    " Assigning a parametrized weight (module.weight = value) rebinds its "
                    "original (torch's parametrize calls set_): copy "
                    "module.parametrizations.weight[0].right_inverse(value) (with several "
                    "parametrizations, each one's in turn, the last first) into "
                    "module.parametrizations.weight.original under torch.no_grad() instead."
                )
            raise RuntimeError(
                f"The model's parameters changed after the gradient cache was created "
                f"({shown}).{advice} The cache only takes the gradients of the parameters it was "
                "created with, on their device then. Call remove_hooks() on the manager "
                "and create a new one after changing the model (after casting it with "
                "model.to(dtype) too; freezing a parameter needs no new cache)."
            )


def _never() -> bool:
    """No fused step waits for its retry (a removed cache's watch)."""
    return False


def _nothing() -> None:
    return None


def _cast_of(cached: torch.nn.Parameter | None, dtype: torch.dtype) -> str | None:
    """How ``cached`` was cast since creation (``model.to(torch.bfloat16)`` casts in place),
    or None. The cached parameter itself is read: FSDP2's unsharded stand-in may have
    another dtype by design (its mixed-precision policy)."""
    if cached is None or cached.dtype == dtype:
        return None
    return f"cast from {dtype} to {cached.dtype}"


def _unsharded_of(present: torch.nn.Parameter, cached: torch.nn.Parameter | None) -> bool:
    """Whether ``present`` is FSDP2's unsharded stand-in for the sharded ``cached``.

    FSDP2 registers the unsharded parameter from its pre-forward hook (which runs after
    this check) until after backward, or until the next backward where it does not
    reshard after forward (the root): the forward after an evaluation forward finds it
    here. The hooks stay on the sharded one, which FSDP2 puts back.
    """
    return is_dtensor(cached) and not is_dtensor(present) and present.shape == cached.shape
