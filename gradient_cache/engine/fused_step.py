"""The fused step: restore and step one bucket at a time, safe to retry after an error.

Only one bucket's dense gradients (plus the one restoring ahead, on CUDA) are on the
device at once. A bucket's payloads leave the cache only after its ``optimizer.step()``
returned, so if a step raises before changing anything (an injected failure, an OOM the
user catches), calling `step` again finishes the job with plain PyTorch's result: the
buckets already stepped are not stepped twice, and the clip factor of the first attempt
is reused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

from . import scaling, sharding
from .backend import Restore
from .norms import gradient_norm
from .optimizer_state import Arrival
from .pipeline import HeldProgress, Pipeline
from .store import BucketPayloads


def step(
    pipeline: Pipeline,
    optimizer: torch.optim.Optimizer,
    *,
    max_grad_norm: float | None,
    norm_type: float,
    model_order: Mapping[torch.nn.Parameter, int],
    step_call: Callable[[], object] | None = None,
    before_steps: Callable[[], object] | None = None,
) -> torch.Tensor | None:
    """Restore and step bucket by bucket; see GradientCacheHookManager.step.

    ``model_order``: each parameter's place in ``model.parameters()``, the order the norms
    are summed in. ``step_call``: what steps a bucket; ``optimizer.step`` by default (its
    hooks fire once per bucket); the manager passes the optimizer's step without its hooks
    (`manager._unhooked_step`), which then fire once, around the whole fused step or the
    user's own ``optimizer.step()`` (the integrations). ``before_steps``: called once the
    step is known not to be skipped (a GradScaler's inf), before the first bucket steps:
    the manager fires the pre-hooks there, as ``scaler.step`` calls ``optimizer.step()``
    only when it steps."""
    step_once = optimizer.step if step_call is None else step_call
    pipeline.drain()
    states = pipeline.optimizer_state
    if states is not None:
        states.begin_step(optimizer)  # a skipped step moves no state either
    stepped = dict.fromkeys(p for group in optimizer.param_groups for p in group["params"])
    pipeline.check_not_taken(optimizer, stepped)  # a shared parameter another step took
    # A clip_grad_norm_ answered from the cache (the integrations): its factor applies to
    # the cached gradients as they are restored; the device ones it clipped in place.
    deferred = pipeline.deferred_clip
    clip, progress = pipeline.retry() if pipeline.interrupted else (None, HeldProgress())
    if clip is None and deferred is not None:
        if max_grad_norm is not None:
            raise ValueError(
                "step(optimizer, max_grad_norm=...) after clip_grad_norm_ clipped these "
                "gradients already: clip once, with one or the other."
            )
        clip = (None, deferred)
    delivered = [p for p in pipeline.store if p in stepped]
    pipeline.take_for(optimizer, delivered)
    # A cached gradient that also has a device part is restored whole first: it then
    # behaves like any device gradient. Parameters of other optimizers stay cached.
    mixed = [p for p in delivered if p.grad is not None]
    pipeline.deliver_and_restore(mixed)
    held = {p: p.grad for p in stepped if p.grad is not None}
    parts = pipeline.parts(stepped)
    scaler = scaling.enabled_scaler(pipeline, optimizer)
    skip, inv_scale = False, None
    if scaler is not None:
        inv_scale = scaling.inv_scale(scaler)
        skip = scaling.found_inf(pipeline, parts, held)
    if clip is None:
        clip = _clip_factor(
            pipeline, model_order, parts, held, max_grad_norm, norm_type, inv_scale=inv_scale
        )
    total_norm, clip_factor = clip
    held_factor = None if deferred is not None else clip_factor
    if skip:
        assert scaler is not None
        _skip(pipeline, scaler, optimizer, parts, held, delivered, held_factor)
        return total_norm
    if before_steps is not None:
        before_steps()
    # Parameters only from here: a payload is let go as soon as its bucket is stepped.
    buckets = [[param for param, _ in part] for part in parts]
    del parts
    for param in held:
        param.grad = None  # hidden from the bucket steps, stepped once at the end
    backend = pipeline.backend
    store = pipeline.store
    ahead: deque[Restore] = deque()
    # Each bucket's optimizer state on its way, beside its gradients (offloaded state only).
    arrivals: deque[Arrival] = deque()
    try:
        for i, params in enumerate(buckets):
            while len(ahead) <= backend.restore_ahead and i + len(ahead) < len(buckets):
                later = buckets[i + len(ahead)]
                items = [(param, store[param]) for param in later]
                ahead.append(backend.start_restore(items, clip_factor=clip_factor))
                if states is not None:
                    arrivals.append(states.bring(optimizer, later))
            grads = backend.finish_restore(ahead.popleft())
            if states is not None:
                states.install(optimizer, arrivals[0])
            _step_with(step_once, grads)
            if i == 0:
                # The step counts, and its residuals become current, once an optimizer
                # step went through: a step that failed before can still be discarded
                # without a trace. (A retry completes again: counting is idempotent.)
                pipeline.deliver([p for p in delivered if p in store])
            store.remove(params)  # stepped: the payloads are spent
            if states is not None:
                states.send_back(optimizer, arrivals.popleft())
        if held:  # left in place afterwards (clipped), as plain PyTorch leaves them
            _scale_in_place(held, held_factor, progress)
            chunks = _chunks(
                [p for p in held if p not in progress.stepped],
                pipeline.assembler.capacity_bytes,
            )
            for chunk in chunks:
                # A bucket's worth at a time: its state (offloaded) is on the device only
                # for its own step, as a cached bucket's is.
                if states is not None:
                    arrivals.append(states.bring(optimizer, chunk))
                    states.install(optimizer, arrivals[0])
                _step_with(step_once, [(param, held[param]) for param in chunk])
                progress.stepped.update(chunk)
                if states is not None:
                    states.send_back(optimizer, arrivals.popleft())
            _put_back(held)
            _free_kept(pipeline, held)
    except BaseException:
        for restore in ahead:
            backend.finish_restore(restore)  # before its blocks are freed
        if states is not None:
            states.abandon(optimizer, arrivals)
        _put_back(held)  # as the retry finds them: `progress` says what was done to them
        pipeline.interrupt(clip, progress)
        raise
    if scaler is not None:
        scaling.record(scaler, optimizer, found_inf=False)
    pipeline.finish_step()
    return total_norm


def _scale_in_place(
    held: dict[torch.nn.Parameter, torch.Tensor],
    factor: torch.Tensor | None,
    progress: HeldProgress,
) -> None:
    """The device gradients times ``factor`` (unscale and clip), in place, as
    ``scaler.unscale_`` and ``clip_grads_with_norm_`` multiply them: no second copy lives
    through the step. Each is marked in ``progress`` as it is scaled, so that a retry
    after a failed step does not scale it twice."""
    if factor is None:
        return
    for param, grad in held.items():
        if param not in progress.scaled:
            local = sharding.local(grad)
            local.mul_(factor.to(local.device))
            progress.scaled.add(param)


def _put_back(held: dict[torch.nn.Parameter, torch.Tensor]) -> None:
    """The device gradients back in ``param.grad``."""
    for param, grad in held.items():
        param.grad = grad


def _chunks(params: list[torch.nn.Parameter], size_bytes: int) -> list[list[torch.nn.Parameter]]:
    """``params`` in order, cut into runs of about ``size_bytes`` of gradient each (a
    bucket's size; a larger gradient alone)."""
    chunks: list[list[torch.nn.Parameter]] = []
    filled = size_bytes
    for param in params:
        nbytes = param.numel() * param.element_size()
        if filled + nbytes > size_bytes and filled:
            chunks.append([])
            filled = 0
        chunks[-1].append(param)
        filled += nbytes
    return chunks


def _skip(
    pipeline: Pipeline,
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    parts: list[BucketPayloads],
    held: dict[torch.nn.Parameter, torch.Tensor],
    delivered: list[torch.nn.Parameter],
    factor: torch.Tensor | None,
) -> None:
    """A gradient was not finite: step nothing, as scaler.step() skips. The step is
    delivered (counted, its residuals current) and the scaler told, so its update() backs
    off and the engine undoes the step at the next backward (`settle_scaled_step`); the
    payloads are spent; device gradients are left unscaled and clipped, as plain AMP
    leaves them."""
    pipeline.deliver([p for p in delivered if p in pipeline.store])
    for part in parts:
        pipeline.store.remove([param for param, _ in part])
    _scale_in_place(held, factor, HeldProgress())
    _put_back(held)
    _free_kept(pipeline, held)
    scaling.record(scaler, optimizer, found_inf=True)
    pipeline.finish_step()


def _free_kept(pipeline: Pipeline, held: dict[torch.nn.Parameter, torch.Tensor]) -> None:
    """The device gradients a memory budget keeps, freed as cached ones are after their
    step: a loop written for the fused step (no zero_grad) must not add them into the next;
    and no checkpoint carries them as part of a pending step any more."""
    kept = held.keys() & pipeline.kept_on_device
    for param in kept:
        param.grad = None
    pipeline.kept_stepped(kept)


def _step_with(
    step_once: Callable[[], object], grads: list[tuple[torch.nn.Parameter, torch.Tensor]]
) -> None:
    """A step with exactly ``grads`` set; ``param.grad`` is None afterwards."""
    for param, grad in grads:
        param.grad = sharding.as_grad_of(param, grad)
    try:
        step_once()
    finally:
        for param, _ in grads:
            param.grad = None


def _clip_factor(
    pipeline: Pipeline,
    model_order: Mapping[torch.nn.Parameter, int],
    parts: list[BucketPayloads],
    held: dict[torch.nn.Parameter, torch.Tensor],
    max_grad_norm: float | None,
    norm_type: float,
    *,
    inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The global norm of the optimizer's gradients and the factor the restores apply:
    the clip factor, times ``inv_scale`` (a GradScaler's) where given; (None, factor)
    without clipping.

    The cached gradients' norms come from `Pipeline.read_norms` (the encodes' or the host
    payloads', complete after the drain); the device gradients' are computed here. They
    are reduced on the device, in the model's order. Under FSDP2 each rank holds shards:
    their norms are combined across ranks (`sharding.global_norm`).
    """
    if max_grad_norm is None:
        if pipeline.pending is None or not pipeline.pending.norm_read:
            pipeline.clip_with(None)  # no one asks for norms: the encodes stop computing them
        return None, inv_scale
    local = pipeline.read_norms(parts, norm_type)
    for param, grad in held.items():
        local[param] = gradient_norm(sharding.local(grad), norm_type)
    total = sharding.global_norm(clip_grad_norm_order(local, model_order), norm_type)
    if inv_scale is not None:
        # The norms of the scaled gradients times 1/scale, a power of two: exactly the
        # norm of the unscaled ones that clip_grad_norm_ after scaler.unscale_() computes.
        total = total * inv_scale.to(total.device)
    device = pipeline.backend.device
    factor = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0).to(device)
    return total, factor if inv_scale is None else factor * inv_scale.to(device)


Norm = TypeVar("Norm")


def clip_grad_norm_order(
    norms: dict[torch.nn.Parameter, Norm], model_order: Mapping[torch.nn.Parameter, int]
) -> list[tuple[torch.nn.Parameter, Norm]]:
    """``norms`` in the order ``clip_grad_norm_(model.parameters())`` sums them: grouped by
    device and dtype (in order of first appearance), each group in the model's order.

    A sum of floats depends on its order, so any other (the optimizer's: nanoGPT's decay
    and no-decay groups) gives another norm in the last bit, and the weights drift. The
    order is the same in every process, so under FSDP2 every rank sums alike. Parameters
    the model does not list (another module's, in the same optimizer) go last.
    """
    last = len(model_order)
    ordered = sorted(norms, key=lambda param: model_order.get(param, last))
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for param in ordered:
        groups.setdefault((param.device, param.dtype), []).append(param)
    return [(param, norms[param]) for group in groups.values() for param in group]
