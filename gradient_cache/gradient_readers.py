"""Gradient readers routed to the cache, while any cache is attached.

Between ``backward()`` and the restore the cache holds the gradients, so code that reads
``.grad`` there would see none: ``clip_grad_norm_`` would clip nothing and return 0, and a
GradScaler would find no inf checks. A training loop of one's own clips there (nanoGPT:
``scaler.unscale_``, ``clip_grad_norm_``, the step), and so do Hugging Face's ``Trainer``,
``accelerate`` and Lightning. While any manager is attached (or an integration runs), these
readers are replaced:

* answered from the cache, nothing restored, where one manager holds the cached gradients
  of the parameters asked about, with a step pending (`CacheReads.cache_for`):
  ``torch.nn.utils``'s ``clip_grad_norm_`` and ``clip_grads_with_norm_``, and
  ``accelerate.Accelerator``'s ``clip_grad_norm_`` without a GradScaler on one process. The
  norm has the bits it has without the cache (at ``compression_ratio=1``), and the clip is
  applied as the cached gradients are restored (``step(optimizer)`` or
  ``apply_gradients()``);
* restored first (the cached gradients of the parameters read back in ``.grad``, then the
  original runs): ``clip_grad_value_``, an enabled ``GradScaler.unscale_``,
  ``Accelerator.clip_grad_value_`` and ``unscale_gradients``, and the calls above where the
  cache cannot answer. With the optimizer state on the host (``offload_optimizer_state``)
  that would bring the whole state to the device at the step: refused instead, with the fix.
  (Since accelerate 1.16, ``Accelerator.clip_grad_norm_`` picks the parameters whose
  ``.grad`` is set before it calls any torch function, so wrapping torch's functions alone
  is too late.)

* ``torch.optim.Optimizer.zero_grad`` and ``torch.nn.Module.zero_grad``: where a manager's
  pending gradients are all among the parameters zeroed, it drops them
  (``discard_gradients``), as ``zero_grad()`` drops ``.grad`` (a skipped batch, a GAN's
  critic after the generator's step), the calls since its last backward counted together;
  one holding others' too keeps them.

Who answers: the innermost integration running (its `route_gradient_reads`), else the
attached managers (`fall_back_to`, from the manager module). One swap serves both: it is in
place while either exists, and the originals come back when neither does (the last manager
detached, by ``remove_hooks()`` or garbage collection, and no integration running).

The functions are looked up as attributes of ``torch.nn.utils`` or of
``torch.nn.utils.clip_grad`` at call time, as ``accelerate``, ``Trainer``, Lightning and
nanoGPT do; methods through their class; accelerate's where it is imported when a manager
is created or an integration starts (``Trainer`` imports it). A name bound before the swap
(``from torch.nn.utils import clip_grad_norm_`` before the cache was created) keeps the
original function: it is not covered. Nor is ``get_total_norm``: it takes the gradients
themselves, which its caller reads (``[p.grad for p in ...]``, all None) before it runs; use
the manager's ``gradient_norm``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.utils.clip_grad as clip_grad


class ClipAnswers(Protocol):
    """What answers a norm or a clip from the cache (a cache's `OptimizerStep`)."""

    def norm(self, params: Iterable[Any], norm_type: float) -> torch.Tensor: ...

    def clip(self, params: Iterable[Any], max_norm: float, total: torch.Tensor) -> None: ...


class CacheReads(Protocol):
    """What the readers ask of whoever routes them."""

    def restore(self, reader: str, parameters: list[torch.Tensor] | None) -> None:
        """Put the cached gradients of ``parameters`` (None: every one) back before
        ``reader`` reads them, or raise where that cannot be done."""

    def cache_for(self, parameters: list[torch.Tensor]) -> ClipAnswers | None:
        """What answers a norm or clip over ``parameters`` without restoring, or None (then
        the gradients are restored and the original runs)."""

    def zeroed(self, parameters: Callable[[], list[torch.Tensor]]) -> None:
        """``zero_grad()`` over ``parameters()`` (a list built only where a step is pending:
        the usual ``zero_grad()`` after a step builds none): drop the cached gradients it
        reaches; after a step, settle what it left open (a GradScaler's skip)."""


# The integrations' routings, innermost last; the attached managers' reads, or None.
_routings: list[CacheReads] = []
_fallback: CacheReads | None = None
# (owner, name, original) of every function swapped now, in the order swapped.
_patched: list[tuple[object, str, Any]] = []


@contextlib.contextmanager
def route_gradient_reads(reads: CacheReads) -> Iterator[None]:
    """Within the block, the readers ask ``reads`` (before the attached managers)."""
    _routings.append(reads)
    _follow()
    try:
        yield
    finally:
        _routings.remove(reads)
        _follow()


def fall_back_to(reads: CacheReads | None) -> None:
    """The readers ask ``reads`` where no integration routes them: the attached managers'
    reads while any manager is attached, None once none is (the originals then come back,
    unless an integration runs)."""
    global _fallback
    _fallback = reads
    _follow()


def current_reads() -> CacheReads | None:
    """Whom a reader called now asks: the innermost integration's, else the fallback."""
    return _routings[-1] if _routings else _fallback


def routed() -> bool:
    """Whether an integration routes the readers and steps now (`route_gradient_reads`)."""
    return bool(_routings)


def _follow() -> None:
    """The swap in place while anyone answers, the originals otherwise."""
    if current_reads() is None:
        _unswap()
    else:
        _swap()


def _swap() -> None:
    """Swap in every reader not swapped yet (accelerate's once it is imported)."""
    for module in (torch.nn.utils, clip_grad):
        _patch(module, "clip_grad_norm_", _clip_grad_norm)
        _patch(module, "clip_grads_with_norm_", _clip_grads_with_norm)
        _patch(module, "clip_grad_value_", _clip_grad_value)
    _patch(torch.amp.GradScaler, "unscale_", _unscale)
    _patch(torch.optim.Optimizer, "zero_grad", _optimizer_zero_grad)
    _patch(torch.nn.Module, "zero_grad", _module_zero_grad)
    accelerate = sys.modules.get("accelerate")
    if accelerate is not None and hasattr(accelerate, "Accelerator"):
        owner = accelerate.Accelerator
        _patch(owner, "clip_grad_norm_", _accelerator_clip)
        _patch(owner, "clip_grad_value_", _accelerator_clip_value)
        _patch(owner, "unscale_gradients", _accelerator_unscale)


def _unswap() -> None:
    while _patched:
        owner, name, original = _patched.pop()
        setattr(owner, name, original)


def _patch(owner: object, name: str, wrap: Callable[[Any], Any]) -> None:
    if any(owner is o and name == n for o, n, _ in _patched):
        return
    original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if original is not None:  # clip_grads_with_norm_ arrived in torch 2.6
        _patched.append((owner, name, original))
        setattr(owner, name, wrap(original))


def _restore(reader: Callable[..., Any], parameters: list[torch.Tensor] | None) -> None:
    reads = current_reads()
    if reads is not None:  # None: called through a name kept from while it was swapped
        reads.restore(reader.__qualname__, parameters)


def _restore_listed(reader: Callable[..., Any], parameters: list[torch.Tensor]) -> None:
    """`_restore` for a clip, whose refusal over a list naming a parameter twice (which
    only restoring answers as torch does) says so."""
    try:
        _restore(reader, parameters)
    except RuntimeError as error:
        if len(set(parameters)) == len(parameters):
            raise
        raise RuntimeError(
            f"{reader.__qualname__} over a list naming a parameter twice (a tied weight in "
            "[*a.parameters(), *b.parameters()]): torch counts and clips it twice, which "
            "the cache can give only by restoring every gradient, refused here. Pass each "
            "parameter once (model.parameters()) and it is answered from the cache. "
            f"({error})"
        ) from error


def _answers(parameters: list[torch.Tensor]) -> ClipAnswers | None:
    reads = current_reads()
    if reads is None or len(set(parameters)) < len(parameters):
        # torch counts a parameter listed twice twice in the norm and clips it twice: its
        # own function, over the gradients restored, does exactly that.
        return None
    return reads.cache_for(parameters)


def _clip_grad_value(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def clip_grad_value_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        clip_value: float,
        foreach: bool | None = None,
    ) -> None:
        params = _as_list(parameters)
        _restore(function, params)
        function(params, clip_value, foreach)

    return clip_grad_value_


def _unscale(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def unscale_(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        if scaler.is_enabled():  # a disabled scaler's unscale_ reads nothing (bf16 loops)
            _restore(function, [p for group in optimizer.param_groups for p in group["params"]])
        function(scaler, optimizer)

    return unscale_


def _clip_grad_norm(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def clip_grad_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        params = _as_list(parameters)
        cache = _answers(params)
        if cache is None:
            _restore_listed(function, params)
            return function(params, max_norm, norm_type, error_if_nonfinite, foreach)
        with torch.no_grad():
            total = cache.norm(params, float(norm_type))
            if error_if_nonfinite and not bool(torch.isfinite(total)):
                raise RuntimeError(
                    f"The total norm of order {norm_type} for gradients from `parameters` is "
                    "non-finite, so it cannot be clipped. To disable this error and scale the "
                    "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
                )
            cache.clip(params, max_norm, total)
        return total

    return clip_grad_norm_


def _clip_grads_with_norm(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def clip_grads_with_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        total_norm: torch.Tensor,
        foreach: bool | None = None,
    ) -> None:
        params = _as_list(parameters)
        cache = _answers(params)
        if cache is None:
            _restore_listed(function, params)
            function(params, max_norm, total_norm, foreach)
            return
        with torch.no_grad():
            cache.clip(params, max_norm, total_norm)

    return clip_grads_with_norm_


def _accelerator_clip(function: Callable[..., Any]) -> Callable[..., Any]:
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
        cache = _answers(params) if answered else None
        if cache is None:
            _restore(function, params)
            return function(accelerator, params, max_norm, norm_type)
        if not hasattr(type(accelerator), "_clip_grad_norm_dtensor_aware"):
            # Before accelerate 1.16 it called its unscale_gradients (routed: it restores
            # first), then torch's clip_grad_norm_: correct, without the fused path.
            return function(accelerator, params, max_norm, norm_type)
        with torch.no_grad():
            norm = cache.norm(params, float(norm_type))
            total = torch.linalg.vector_norm(torch.stack([norm]), norm_type)
            if max_norm != float("inf"):
                cache.clip(params, max_norm, total)
        return total

    return clip_grad_norm_


def _accelerator_clip_value(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def clip_grad_value_(
        accelerator: Any, parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float
    ) -> Any:
        params = _as_list(parameters)
        _restore(function, params)
        return function(accelerator, params, clip_value)

    return clip_grad_value_


def _accelerator_unscale(function: Callable[..., Any]) -> Callable[..., Any]:
    """``Accelerator.unscale_gradients(optimizer=None)``: every gradient restored first (the
    optimizers it unscales are accelerate's to pick)."""

    @functools.wraps(function)
    def unscale_gradients(accelerator: Any, *args: Any, **kwargs: Any) -> Any:
        _restore(function, None)
        return function(accelerator, *args, **kwargs)

    return unscale_gradients


def _optimizer_zero_grad(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def zero_grad(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        _zeroed(lambda: [p for group in optimizer.param_groups for p in group["params"]])
        function(optimizer, *args, **kwargs)

    return zero_grad


def _module_zero_grad(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def zero_grad(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        _zeroed(lambda: list(module.parameters()))
        function(module, *args, **kwargs)

    return zero_grad


def _zeroed(parameters: Callable[[], list[torch.Tensor]]) -> None:
    reads = current_reads()
    if reads is not None:
        reads.zeroed(parameters)


def _as_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
