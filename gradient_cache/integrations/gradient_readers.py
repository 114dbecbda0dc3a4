"""Gradient readers routed to the cache, while an integration runs (`routing.StepRouting`).

Between ``backward()`` and ``optimizer.step()`` the cache holds the gradients, so code that
reads ``.grad`` there would see none: ``clip_grad_norm_`` would clip nothing and return 0,
and a GradScaler would find no inf checks. Hugging Face's ``Trainer``, ``accelerate`` and
Lightning clip there. While an integration runs, these readers are replaced:

* answered from the cache, nothing restored, where one manager holds the cached gradients
  of the parameters asked about (`CacheReads.cache_for`): ``torch.nn.utils``'s
  ``clip_grad_norm_`` and ``clip_grads_with_norm_``, and ``accelerate.Accelerator``'s
  ``clip_grad_norm_`` without a GradScaler on one process. The norm has the bits it has
  without the cache (at ``compression_ratio=1``), and the clip is applied as the fused step
  restores each bucket;
* restored first (every cached gradient back in ``.grad``, then the original runs):
  ``clip_grad_value_``, ``GradScaler.unscale_``, ``Accelerator.clip_grad_value_`` and
  ``unscale_gradients``, and the calls above where the cache cannot answer. (Since
  accelerate 1.16, ``Accelerator.clip_grad_norm_`` picks the parameters whose ``.grad`` is
  set before it calls any torch function, so wrapping torch's functions alone is too late.)

The functions are looked up as attributes of ``torch.nn.utils`` or of
``torch.nn.utils.clip_grad`` at call time, as ``accelerate``, ``Trainer`` and Lightning do;
methods through their class; accelerate's only where it is imported when the integration
starts (``Trainer`` imports it). A name bound before (``from torch.nn.utils import
clip_grad_norm_``) keeps the original function: it is not covered. Nor is
``get_total_norm``: it takes the gradients themselves, which its caller reads
(``[p.grad for p in ...]``, all None) before it runs; use the manager's ``gradient_norm``.
The originals come back when the integration ends.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.utils.clip_grad as clip_grad

from ..manager import GradientCacheHookManager


class CacheReads(Protocol):
    """What the readers ask of the integration that routes them."""

    def restore(self, reader: str) -> None:
        """Put every cached gradient back before ``reader`` reads them."""

    def cache_for(self, parameters: list[torch.Tensor]) -> GradientCacheHookManager | None:
        """The manager that answers a norm or clip over ``parameters`` without restoring,
        or None (then the gradients are restored and the original runs)."""


@contextlib.contextmanager
def route_gradient_reads(reads: CacheReads) -> Iterator[None]:
    """Within the block, the readers above are routed to ``reads``."""
    patched: list[tuple[object, str, Any]] = []

    def patch(owner: object, name: str, replacement: Callable[[Any], Any]) -> None:
        original = (
            owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        )
        if original is not None:  # clip_grads_with_norm_ arrived in torch 2.6
            patched.append((owner, name, original))
            setattr(owner, name, replacement(original))

    try:
        for module in (torch.nn.utils, clip_grad):
            patch(module, "clip_grad_norm_", lambda f: _clip_grad_norm(f, reads))
            patch(module, "clip_grads_with_norm_", lambda f: _clip_grads_with_norm(f, reads))
            patch(module, "clip_grad_value_", lambda f: _restoring(f, reads))
        patch(torch.amp.GradScaler, "unscale_", lambda f: _restoring(f, reads))
        accelerate = sys.modules.get("accelerate")
        if accelerate is not None and hasattr(accelerate, "Accelerator"):
            owner = accelerate.Accelerator
            patch(owner, "clip_grad_norm_", lambda f: _accelerator_clip(f, reads))
            for name in ("clip_grad_value_", "unscale_gradients"):
                patch(owner, name, lambda f: _restoring(f, reads))
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def _restoring(function: Callable[..., Any], reads: CacheReads) -> Callable[..., Any]:
    @functools.wraps(function)
    def restore_then_call(*args: Any, **kwargs: Any) -> Any:
        reads.restore(function.__qualname__)
        return function(*args, **kwargs)

    return restore_then_call


def _clip_grad_norm(function: Callable[..., Any], reads: CacheReads) -> Callable[..., Any]:
    @functools.wraps(function)
    def clip_grad_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        params = _as_list(parameters)
        manager = reads.cache_for(params)
        if manager is None:
            reads.restore(function.__qualname__)
            return function(params, max_norm, norm_type, error_if_nonfinite, foreach)
        with torch.no_grad():
            total = manager.gradient_norm(params, norm_type=norm_type)
            if error_if_nonfinite and not bool(torch.isfinite(total)):
                raise RuntimeError(
                    f"The total norm of order {norm_type} for gradients from `parameters` is "
                    "non-finite, so it cannot be clipped. To disable this error and scale the "
                    "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
                )
            manager.clip_grads_with_norm_(params, max_norm, total)
        return total

    return clip_grad_norm_


def _clip_grads_with_norm(function: Callable[..., Any], reads: CacheReads) -> Callable[..., Any]:
    @functools.wraps(function)
    def clip_grads_with_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        total_norm: torch.Tensor,
        foreach: bool | None = None,
    ) -> None:
        params = _as_list(parameters)
        manager = reads.cache_for(params)
        if manager is None:
            reads.restore(function.__qualname__)
            function(params, max_norm, total_norm, foreach)
            return
        with torch.no_grad():
            manager.clip_grads_with_norm_(params, max_norm, total_norm)

    return clip_grads_with_norm_


def _accelerator_clip(function: Callable[..., Any], reads: CacheReads) -> Callable[..., Any]:
    """``Accelerator.clip_grad_norm_``: answered from the cache on one process without a
    GradScaler, as accelerate computes it there (one norm per device mesh, then their norm;
    one mesh here), else restored first."""

    @functools.wraps(function)
    def clip_grad_norm_(
        accelerator: Any,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2,
    ) -> Any:
        params = _as_list(parameters)
        kind = accelerator.distributed_type
        one_process = getattr(kind, "value", kind) == "NO"
        answered = one_process and accelerator.scaler is None and norm_type != 0
        manager = reads.cache_for(params) if answered else None
        if manager is None:
            reads.restore(function.__qualname__)
            return function(accelerator, params, max_norm, norm_type)
        if not hasattr(type(accelerator), "_clip_grad_norm_dtensor_aware"):
            # Before accelerate 1.16 it called its unscale_gradients (routed: it restores
            # first), then torch's clip_grad_norm_: correct, without the fused path.
            return function(accelerator, params, max_norm, norm_type)
        with torch.no_grad():
            norm = manager.gradient_norm(params, norm_type=norm_type)
            total = torch.linalg.vector_norm(torch.stack([norm]), norm_type)
            if max_norm != float("inf"):
                manager.clip_grads_with_norm_(params, max_norm, total)
        return total

    return clip_grad_norm_


def _as_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
