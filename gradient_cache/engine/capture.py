"""Capture: backward's hooks hand each gradient over, buckets launch while backward goes on.

Capture moves gradients and their records' locations; the step's state is the pipeline's.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, cast

import torch

from ..codecs.payloads import NARROW_FLOATS
from . import sharding
from .backend import Encoded
from .bucket import BucketState, Item
from .records import HELD_BY_THE_CACHE, GradientAt
from .scaling import loss_scale

if TYPE_CHECKING:
    from .pipeline import Pipeline
    from .step_state import PendingStep

Param = torch.nn.Parameter


class Capture:
    """The pipeline's capture: its hook, its launches (see the module docstring)."""

    def __init__(self, pipeline: Pipeline) -> None:
        # Weakly: a cycle would keep the model alive until a full garbage collection.
        self.pipeline = cast("Pipeline", weakref.proxy(pipeline))
        self._gradient_checked = False
        # Held by the hook, and by a zero_grad()'s discard on the main thread: after a
        # backward raised, autograd's device thread may still be in a hook of it.
        self.lock = threading.RLock()

    def on_grad_ready(self, param: Param) -> None:
        """Backward's hook: ``param``'s gradient is complete."""
        with self.lock:
            self._take(param)

    def _take(self, param: Param) -> None:
        pipeline = self.pipeline
        grad = param.grad
        if grad is None or grad.is_sparse:
            return  # sparse (nn.Embedding(sparse=True)) gradients stay where they are
        if not pipeline.enabled:
            return  # left on the device; what is cached joins it at the restore
        record = pipeline.records[param]
        if record.keep_on_device:
            record.gradient = GradientAt.KEPT_ON_DEVICE  # left in .grad, part of the step
            return
        weights = pipeline.weights
        if weights is not None:  # a use before the forward: its accumulator had no hook
            weights.refuse_a_host_gradient(param, grad, in_grad=True)
        if weights is not None and weights.part_to_come(param):
            # Autograd adds the next use's part into .grad, in the compute dtype too: taken
            # whole, as plain's one node (FSDP2's one bf16 parameter) sums them.
            return
        pending = pipeline.pending
        if pending is not None and pending.siblings_taken and not pipeline.interrupted:
            # Before the cache takes anything. The refused backward's part leaves .grad
            # (the cache held the rest): its fix, then the backward again, counts it once.
            _refuse_adding_to_left_gradients(pipeline, pending, param)
        if pipeline.deferred_clip is not None:
            # A backward after a clip answered from the cache: plain PyTorch adds to the
            # clipped gradients, so they come back clipped first (a restore, once).
            self._restore_clipped()
        if not self._gradient_checked:
            sharding.check_gradient_is_reduced(record.name, grad)
            self._gradient_checked = True
        pipeline.begin_capture()
        cast("PendingStep", pipeline.pending).backwards.add(torch._C._current_graph_task_id())
        param.grad = None
        if pipeline.assembler.holds(param) and param in pipeline.store:
            # A third micro-batch while the second waits here and the first is cached: the
            # waiting bucket goes first ((a + b) + c, plain PyTorch's order).
            self.launch(pipeline.assembler.flush())
        group_complete = record.group is not None and record.group.arrive()
        self.add(param, self._carried(param, sharding.local(grad)))
        if group_complete:
            # The group's shared buffer is freed once its last gradient leaves: send it now.
            self.launch(pipeline.assembler.flush())

    def _carried(self, param: Param, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` as its bucket carries it: in the master's dtype (as FSDP2's reduce_dtype),
        but a bf16 gradient on a lossless route crosses as it is (half the bytes; widened
        exactly where added or restored) where nothing joins it, or beside the first
        micro-batch's part unless a GradScaler's inf check reads the sum (it can overflow)."""
        pipeline = self.pipeline
        route = pipeline.records[param].route
        if grad.dtype not in NARROW_FLOATS or route.dtype != torch.float32 or route.codec.lossy:
            return grad.to(route.dtype)
        if pipeline.assembler.holds(param):
            return grad.to(route.dtype)
        cached = pipeline.store.payload(param)
        if cached is None:
            return grad
        inf_checked = pipeline.pending is not None and pipeline.pending.found_inf is not None
        return grad if cached.followed_by(grad) and not inf_checked else grad.to(route.dtype)

    def _restore_clipped(self) -> None:
        """Every cached gradient back in ``param.grad`` times the deferred clip, then spent;
        the step goes on, undelivered (this backward hands them back, as accumulation)."""
        pipeline = self.pipeline
        if pipeline.weights is not None:
            raise RuntimeError(
                "A backward came after a clip of this step's gradients (clip_grad_norm_ "
                "between two backwards, whose clip the cache defers to the step) with the "
                "weights on the host (offload_parameters=True): the clipped gradients would "
                "come back into .grad on the device beside parameters on the host, which a "
                "GPU refuses. Clip once, after the step's last backward: "
                "hook_manager.step(optimizer, max_grad_norm=...)."
            )
        pipeline.drain()
        pipeline.restore(list(pipeline.store))
        assert pipeline.pending is not None  # a deferred clip lives in the pending step
        pipeline.pending.deferred_clip = None

    def add(self, param: Param, grad: torch.Tensor) -> None:
        """``grad`` into the open bucket, which launches once full."""
        items = self.pipeline.assembler.add(param, grad, self.pipeline.records[param].route.dtype)
        self.pipeline.records[param].gradient = GradientAt.OPEN_BUCKET
        self.launch(items)

    def launch(self, items: list[Item] | None) -> None:
        """Encode ``items`` and send them to host memory. If an encode fails, the rest get
        their gradients back in ``param.grad`` (the next restore adds the cached part)."""
        if not items:
            return
        pipeline = self.pipeline
        pipeline.launching()
        scale = loss_scale(pipeline.grad_scaler)
        encoded: list[Encoded] = []
        try:
            with pipeline.backend.encoding([param for param, _ in items]):
                for param, grad in items:
                    encoded.append(self._encode(param, grad, scale))
        except BaseException:
            for param, grad in items[len(encoded) :]:
                # In the parameter's dtype now (a carried bf16 one's master may be fp32 again).
                param.grad = sharding.as_grad_of(param, grad.to(param.dtype))
                pipeline.records[param].gradient = self._cached_part_at(param)
            raise
        finally:
            self.store_encoded(encoded, [grad for _, grad in items[: len(encoded)]])

    def _encode(self, param: Param, grad: torch.Tensor, scale: torch.Tensor | None) -> Encoded:
        """Runs where the backend's `encoding` puts it; reads but never changes cached state."""
        pipeline = self.pipeline
        route = pipeline.records[param].route
        flat = route.flatten(grad.detach())
        cached = pipeline.store.payload(param)
        joined = None if cached is None or flat.dtype == route.dtype else cached.followed_by(flat)
        if cached is not None and joined is None:  # accumulation: the cached part joins
            flat = cached.moved(pipeline.backend.to_device).add_to(flat.to(route.dtype))
        residual = None if route.codec.residual is None else pipeline.backend.residuals.read(param)
        pending = pipeline.pending
        if pending is not None and pending.found_inf is not None:
            # The fused step skips on it, as scaler.step() would.
            torch.logical_or(pending.found_inf, ~torch.isfinite(flat).all(), out=pending.found_inf)
        if pending is not None and pending.norms is not None:
            # The norm of what this encode compresses (earlier micro-batches' parts joined),
            # so the fused step's clip needs no pass over the payloads.
            whole = flat.to(route.dtype)  # a carried bf16's, widened
            if joined is not None and cached is not None:
                # The sum's norm: the first micro-batch's part is brought for it.
                whole = cached.moved(pipeline.backend.to_device).add_to(whole)
            pending.norms.write(param, whole)
        if joined is not None:  # lossless: no codec, no residual
            return Encoded(param, joined, None)
        payload, new_residual = route.codec.encode(flat, residual, loss_scale=scale)
        return Encoded(param, payload, new_residual, () if residual is None else (residual,))

    def store_encoded(self, encoded: list[Encoded], grads: list[torch.Tensor]) -> None:
        """Send ``encoded`` to host memory (residuals to the backend); in flight until a drain."""
        if encoded:
            pipeline = self.pipeline
            pipeline.store.put(pipeline.backend.store(encoded, grads))
            for each in encoded:
                pipeline.records[each.param].gradient = GradientAt.IN_FLIGHT

    def _cached_part_at(self, param: Param) -> GradientAt:
        """Where the store's part of ``param``'s gradient is (NONE: it has none)."""
        state = self.pipeline.store.bucket_state(param)
        if state is None:
            return GradientAt.NONE
        return GradientAt.IN_FLIGHT if state is BucketState.LANDING else GradientAt.STORED


def _refuse_adding_to_left_gradients(
    pipeline: Pipeline, pending: PendingStep, param: Param
) -> None:
    """Refuse a backward adding to gradients a step left cached beside those it took
    (`PendingStep.siblings_taken`): plain PyTorch leaves them in ``.grad``, where a
    ``zero_grad()`` the cache cannot see may have cleared them."""
    names = [r.name for r in pipeline.records.values() if r.gradient in HELD_BY_THE_CACHE]
    if not names:
        pending.siblings_taken = False  # nothing was left
        return
    param.grad = None
    raise RuntimeError(
        f"A backward began while the gradient cache holds gradients of {len(names)} "
        f"parameters ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) that an "
        "earlier backward gave beside gradients another optimizer's step has taken since "
        "(a GAN's generator step leaves the discriminator's gradients from the generator's "
        "loss). Plain PyTorch leaves them in .grad, and whether they join this backward's "
        "depends on a zero_grad() the cache cannot see. After that step, call "
        "hook_manager.discard_gradients() to drop them (what D.zero_grad() does), or "
        "hook_manager.keep_gradients() to add this backward's to them (no zero_grad() in "
        "between); or step their optimizer first. @gradient_cache.optimize and the "
        "integrations put them in .grad after each step, where zero_grad() reaches them."
    )
