"""Gradient readers that restore the cache first, while `gradient_cache.optimize` runs.

Between ``backward()`` and ``optimizer.step()`` the cache holds the gradients, so code that
reads ``.grad`` there would see none: ``clip_grad_norm_`` would clip nothing and return 0,
and a GradScaler would find no inf checks. Hugging Face's ``Trainer`` and ``accelerate``
clip there by default. While a decorated function runs, these readers are replaced by
wrappers that first put every cached gradient back (the decorator's restore, the same as
before ``optimizer.step()``), then call the original:

* ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_`` and ``clip_grads_with_norm_``
  (looked up as attributes of ``torch.nn.utils`` or of ``torch.nn.utils.clip_grad`` at
  call time, as ``accelerate`` and ``Trainer`` do);
* ``torch.amp.GradScaler.unscale_`` (a method: found through the class at every call);
* ``accelerate.Accelerator``'s ``clip_grad_norm_``, ``clip_grad_value_`` and
  ``unscale_gradients``, where ``accelerate`` is imported when the decorated function
  starts (``Trainer`` imports it). Since accelerate 1.16, ``Accelerator.clip_grad_norm_``
  picks the parameters whose ``.grad`` is set before it calls any torch function, so
  wrapping torch's functions alone restores too late.

A name bound before the decorator ran (``from torch.nn.utils import clip_grad_norm_``)
keeps the original function: it is not covered. Nor is ``get_total_norm``: it takes the
gradients themselves, which its caller reads (``[p.grad for p in ...]``, all None) before
it runs; call ``apply_gradients()`` on ``manager_of(model)`` first. The originals come
back when the decorated function returns or raises.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.utils.clip_grad as clip_grad

CLIPPING_FUNCTIONS = (
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
)
ACCELERATOR_READERS = ("clip_grad_norm_", "clip_grad_value_", "unscale_gradients")


@contextlib.contextmanager
def restore_before_gradient_reads(restore: Callable[[], None]) -> Iterator[None]:
    """Within the block, the readers above call ``restore()`` before they read ``.grad``."""
    patched: list[tuple[object, str, Any]] = []
    try:
        for module in (torch.nn.utils, clip_grad):
            for name in CLIPPING_FUNCTIONS:
                original = getattr(module, name, None)
                if original is not None:  # clip_grads_with_norm_ arrived in torch 2.6
                    patched.append((module, name, original))
                    setattr(module, name, _restoring(original, restore))
        methods: list[tuple[type, str]] = [(torch.amp.GradScaler, "unscale_")]
        accelerate = sys.modules.get("accelerate")
        if accelerate is not None and hasattr(accelerate, "Accelerator"):
            methods += [(accelerate.Accelerator, name) for name in ACCELERATOR_READERS]
        for owner, name in methods:
            original = owner.__dict__.get(name)
            if original is not None:
                patched.append((owner, name, original))
                setattr(owner, name, _restoring(original, restore))
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def _restoring(function: Callable[..., Any], restore: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(function)
    def restore_then_call(*args: Any, **kwargs: Any) -> Any:
        restore()
        return function(*args, **kwargs)

    return restore_then_call
