"""How the integrations route a training loop's calls to the cache: `StepRouting`.

While a `StepRouting` is in place (the decorator's function call, a Lightning fit):

* ``optimizer.step()`` of an optimizer whose parameters a manager caches is that manager's
  fused step, ``step(optimizer)``: restored and stepped a bucket at a time, the optimizer
  state brought along where ``offload_optimizer_state=True``. An optimizer pre-hook runs
  it (after the closure, where there is one: Lightning's, whose closure runs the backward
  and the clipping); the device gradients it stepped are hidden from the call's own step,
  which then steps nothing, and put back after it, clipped, as plain PyTorch leaves them.
* ``clip_grad_norm_`` and ``clip_grads_with_norm_`` (torch's and accelerate's) are
  answered from the cache (`GradientCacheHookManager.gradient_norm` and
  ``clip_grads_with_norm_``): nothing is restored, and the clip is applied bucket by bucket
  as the fused step restores.
* What reads every gradient at once (``clip_grad_value_``, an enabled
  ``GradScaler.unscale_``, an LBFGS step) restores every gradient first
  (`gradient_cache.gradient_readers`; this routing takes precedence over the attached
  managers' while it is in place), and the step that follows is plain PyTorch's.

With ``fused_step=False`` every step and every reader restores first, as before the fused
step existed: for optimizers whose update of a parameter reads other parameters' gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..engine.step import OptimizerStep
from ..engine.step_hooks import OWN_HOOKS, after_the_closure
from ..gradient_readers import route_gradient_reads
from ..manager import GradientCacheHookManager, ManagerReads, warn_of_a_partial_zero_grad

Managers = Callable[[], Iterable[GradientCacheHookManager]]


class StepRouting:
    """Routes steps and gradient readers to the managers ``managers()`` returns (see the
    module's docstring); a context manager that puts its hooks in place and takes them away.
    """

    def __init__(self, managers: Managers, *, fused: bool) -> None:
        self._managers = managers
        self.fused = fused
        self._reads = ManagerReads(
            managers,
            fix="Only clip_grad_norm_ over one model's parameters is answered from the cache; "
            "this call reads every gradient at once (clip_grad_value_, GradScaler.unscale_, "
            "or a clip over two models' caches). Drop the call, or the state offload. A "
            "GradScaler's scaler.step() calls unscale_ itself: with the state on the host "
            "the loss scale is the cache's to apply (grad_scaler= to create_gradient_cache "
            "and hook_manager.step(optimizer)), which an integration cannot be given; or "
            "compute in bf16, which needs no scaler.",
        )
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StepRouting:
        with contextlib.ExitStack() as stack:
            stack.callback(register_optimizer_step_pre_hook(self._before_step).remove)
            # Not the user's: a cache's own fused step (manager_of(model).step inside the
            # decorated function) fires the step's pre-hooks without it, or it would route
            # that step again as a fused step inside it.
            OWN_HOOKS.add(self._before_step)
            stack.callback(OWN_HOOKS.discard, self._before_step)
            stack.callback(register_optimizer_step_post_hook(self._after_step).remove)
            stack.enter_context(route_gradient_reads(self))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    # --- readers (`gradient_readers.CacheReads`) ------------------------------------

    def restore(self, reader: str, parameters: list[torch.Tensor] | None) -> None:
        """The cached gradients of ``parameters`` back in ``param.grad``, before ``reader``
        reads them."""
        self._reads.restore(reader, parameters)

    def zeroed(self, parameters: Callable[[], list[torch.Tensor]]) -> None:
        """``zero_grad()`` over ``parameters`` (`ManagerReads.zeroed`)."""
        self._reads.zeroed(parameters)

    def cache_for(self, parameters: list[torch.Tensor]) -> OptimizerStep | None:
        """The one cache answering a norm or clip over ``parameters`` from the cache
        (`ManagerReads.cache_for`); None without the fused step."""
        return self._reads.cache_for(parameters) if self.fused else None

    # --- the optimizer hooks ------------------------------------------------------

    def _before_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The fused step in place of this step; with a closure, once the closure ran."""
        return after_the_closure(args, kwargs, lambda: self._route(optimizer))

    def _route(self, optimizer: torch.optim.Optimizer) -> None:
        steps = [m.optimizer_step for m in self._managers() if m.optimizer_step is not None]
        if self.fused:
            for step in steps:
                warn_of_a_partial_zero_grad(step.pipeline, optimizer)
                step.step_in_call(optimizer)  # hidden what it stepped until `_after_step`
        # Every model's gradients that are left, not only this optimizer's: a backward
        # through two models (a GAN's generator loss through its discriminator) leaves
        # gradients on both, and plain PyTorch shows them in .grad until the other
        # optimizer's zero_grad().
        for step in steps:
            step.restore_all()

    def _after_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        for manager in self._managers():
            if manager.optimizer_step is not None:
                manager.optimizer_step.show_held(optimizer)
