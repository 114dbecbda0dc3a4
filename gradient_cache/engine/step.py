"""The step, from backward's end to the optimizer's update (`OptimizerStep`).

Its phases, one module each: docs/ARCHITECTURE.md, "The step, phase by phase".
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import fused_step, scaling, sharding
from .budget import BudgetWatch
from .config import EngineConfig
from .fused_step import BucketSteps, Journeys, Traveller
from .norms import StepNorms, clip_factor, clip_grad_norm_order, clip_order, gradient_norm
from .pipeline import Pipeline, refuse_taken
from .records import HELD_BY_THE_CACHE, GradientAt
from .step_hooks import StepHooks
from .step_state import Clip, HeldProgress
from .store import BucketPayloads
from .weights.masters import StepJourney

Param = torch.nn.Parameter
Optimizer = torch.optim.Optimizer


def lbfgs_needs(config: EngineConfig) -> str:
    """How LBFGS runs with a cache made with ``config``: its line search re-evaluates the
    loss (the closure) and moves every parameter along one direction, so it steps with all
    its gradients in ``.grad`` and its whole state on the device, never a bucket at a time."""
    if config.offload_optimizer_state:
        also = " and offload_parameters, which needs it" if config.offload_parameters else ""
        return (
            f"With offload_optimizer_state=True it cannot run: create the cache without it{also} "
            "(the gradients are still offloaded), then call optimizer.step(closure) with "
            "hook_manager.apply_gradients() inside the closure, after its loss.backward()."
        )
    return (
        "Call optimizer.step(closure) yourself with hook_manager.apply_gradients() inside the "
        "closure, after its loss.backward(), or run the loop under @gradient_cache.optimize(), "
        "which hands LBFGS the closure's gradients."
    )


class OptimizerStep:
    """The step over what one pipeline caches. ``model_order``: each parameter's place in
    ``model.parameters()``, the clip's summing order. ``budget``: decided around the
    restores. ``on_restored(steps_before)``: after every restore (the verbose log)."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        model_order: Mapping[Param, int],
        budget: BudgetWatch | None = None,
        on_restored: Callable[[int], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.budget = budget
        self._model_order = model_order
        self._on_restored = on_restored
        # Held gradients stepped inside an integration's optimizer.step(), out of .grad until
        # that call ends (`show_held`). Weak keys: a call that raised keeps no optimizer.
        self._hidden: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def step(
        self,
        optimizer: Optimizer,
        *,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        hooks: bool = True,
    ) -> torch.Tensor | None:
        """The fused step (`GradientCacheHookManager.step`). ``hooks``: fire the step hooks
        once around it; False inside an integration's own ``optimizer.step()``, which fires
        them itself and whose own step must not see the held gradients (`show_held`)."""
        pipeline = self.pipeline
        if pipeline.optimizer_state is not None:
            _refuse_sparse_momentum(pipeline, optimizer)
        steps_before = pipeline.steps
        if self.budget is not None:
            self.budget.before_restore(pipeline)
        step_hooks = StepHooks(optimizer, through_instance=hooks)
        weights = pipeline.weights
        with contextlib.nullcontext() if weights is None else weights.plain_through_the_step():
            total_norm, left = self._fused(optimizer, max_norm, norm_type, step_hooks, hooks=hooks)
        self._after_restore(steps_before)
        states = pipeline.optimizer_state
        step_hooks.fire_post_hooks(wait_for_state=None if states is None else states.wait_on_host)
        if not hooks:
            # Added to, not replaced: a subclass's super().step() runs a second fused step
            # inside the call, which finds nothing left to hold.
            self._hidden.setdefault(optimizer, {}).update(left)
        return total_norm

    def norm(self, params: Iterable[Param], norm_type: float) -> torch.Tensor:
        """``get_total_norm`` of ``params``' gradients, cached ones read where they are,
        summed in ``params``' order (`GradientCacheHookManager.gradient_norm`)."""
        params = list(params)
        pipeline = self._clip_ready("gradient_norm")
        grads = {param: param.grad for param in params if param.grad is not None}
        order = {param: i for i, param in enumerate(params)}
        return _total_norm(pipeline, pipeline.store.parts(set(params)), grads, order, norm_type)

    def clip(self, params: Iterable[Param], max_norm: float, total: torch.Tensor) -> None:
        """``clip_grads_with_norm_``: device gradients clipped in place, cached ones by the
        same factor as restored (`GradientCacheHookManager.clip_grads_with_norm_`)."""
        params = list(params)
        pipeline = self._clip_ready("clip_grads_with_norm_")
        cached = [param for param in params if param in pipeline.store]
        if cached and not set(pipeline.store) <= set(params):
            pipeline.deliver_and_restore(cached)
            cached = []
        factor = clip_factor(float(max_norm), total)
        for param in params:  # as torch's: a parameter listed twice is scaled twice
            if param.grad is not None:
                grad = sharding.local(param.grad)
                grad.mul_(factor.to(grad.device))
        if cached:
            # Applied as each cached gradient is restored (the clip covers all of them).
            assert pipeline.pending is not None and pipeline.pending.deferred_clip is None
            pipeline.pending.deferred_clip = factor.to(pipeline.backend.device)

    def restore_all(self, *, refusal: str | None = None) -> None:
        """Every cached gradient back in ``param.grad``, wherever the state is (the
        integrations restore what other optimizers left). ``refusal``: raised instead where
        the state is on the host and gradients are cached (a reader of every gradient at
        once would need the whole state on the device at the step)."""
        pipeline = self.pipeline
        if refusal is not None:
            pipeline.drain()
            if pipeline.optimizer_state is not None and pipeline.store:
                raise RuntimeError(refusal)
        steps_before = pipeline.steps
        if pipeline.step_pending and self.budget is not None:
            self.budget.before_restore(pipeline)
        failed = pipeline.pending if pipeline.interrupted else None
        if failed is not None and (failed.partly_stepped() or (failed.held and failed.held.scaled)):
            raise RuntimeError(
                "apply_gradients() after a fused step(optimizer) that raised once it had "
                "stepped a bucket or scaled device gradients in place: restoring the rest "
                "whole would clip or step those twice, or leave the rest unclipped beside "
                "clipped ones. Call step(optimizer) again to finish that step."
            )
        pipeline.apply()
        self._after_restore(steps_before)

    def caches(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether this cache takes the gradients of any of ``params``."""
        return any(param in self.pipeline.records for param in params)

    def takes(self, optimizer: Optimizer) -> bool:
        """Whether the fused step takes ``optimizer``'s step (an integration's routing): it
        has cached gradients, or gradients a fused step took this step (plain would step
        them again), or its state on the host. Never LBFGS (it steps every parameter at
        once), refused with the state on the host."""
        owned = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.caches(owned):
            return False
        pipeline = self.pipeline
        if isinstance(optimizer, torch.optim.LBFGS):
            if pipeline.optimizer_state is not None:
                raise RuntimeError(_LBFGS_REFUSAL)
            return False
        pipeline.drain()
        if pipeline.optimizer_state is not None:
            return True
        records = [pipeline.records[p] for p in owned if p in pipeline.records]
        return any(r.gradient is GradientAt.STORED or r.taken_by is not None for r in records)

    def step_in_call(self, optimizer: Optimizer) -> None:
        """An integration's own ``optimizer.step()``: the fused step where this cache
        `takes` it, the step hooks left to the call."""
        if self.takes(optimizer):
            self.step(optimizer, hooks=False)

    def refuse_a_plain_step(self, optimizer: Optimizer) -> None:
        """The user's own ``optimizer.step()``: refused where this cache holds gradients of
        its parameters, not in ``.grad`` (most optimizers would silently skip them)."""
        records = self.pipeline.records
        held = [
            records[param].name
            for group in optimizer.param_groups
            for param in group["params"]
            if param in records and records[param].gradient in HELD_BY_THE_CACHE
        ]
        if held and isinstance(optimizer, torch.optim.LBFGS):
            needs = lbfgs_needs(self.pipeline.config)
            raise RuntimeError(f"LBFGS.step() while the gradient cache holds gradients. {needs}")
        if held:
            apply = self.pipeline.optimizer_state is None  # else apply_gradients is refused
            or_apply = ", or hook_manager.apply_gradients() before it" if apply else ""
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() while the gradient cache holds the "
                f"gradients of {len(held)} of its parameters ({', '.join(held[:3])}"
                f"{', ...' if len(held) > 3 else ''}), which are not in .grad: it would step "
                "without them. Call hook_manager.step(optimizer) in place of "
                f"optimizer.step() (the fused step){or_apply}."
            )

    def show_held(self, optimizer: Optimizer) -> None:
        """An integration's ``optimizer.step()`` is over: the held gradients back in ``.grad``."""
        records = self.pipeline.records
        for param, grad in self._hidden.pop(optimizer, {}).items():
            param.grad = grad
            if param in records:
                records[param].gradient = GradientAt.NONE  # the user's, as plain leaves it

    def offload_state_of(self, optimizer: Optimizer) -> None:
        """``optimizer``'s state on the device to the host, and its loads there from now
        on (see `GradientCacheHookManager.offload_state_of`)."""
        states = self.pipeline.optimizer_state
        if states is None:
            raise RuntimeError(
                "offload_state_of() needs offload_optimizer_state=True in "
                "create_gradient_cache(...): without it the state stays on the device."
            )
        states.send_to_host(optimizer)
        states.wait_on_host()  # the host may read them next (a checkpoint)

    def offload_loaded_state(self, optimizers: Iterable[Optimizer]) -> None:
        """At an integration's training start: the state a framework loaded onto the device
        on resume goes to the host, for each optimizer stepping a parameter this cache
        holds; a memory budget measures from here. Nothing without the state offload."""
        if self.pipeline.optimizer_state is None:
            return
        for optimizer in optimizers:
            if self.caches(p for group in optimizer.param_groups for p in group["params"]):
                self.offload_state_of(optimizer)
        if self.budget is not None:
            self.budget.measure_from_now()  # before any forward: the steps are measured

    def _fused(
        self,
        optimizer: Optimizer,
        max_norm: float | None,
        norm_type: float,
        step_hooks: StepHooks,
        *,
        hooks: bool,
    ) -> tuple[torch.Tensor | None, dict[Param, torch.Tensor]]:
        """Decide the step (delivered gradients, the clip, a GradScaler's skip), then run
        its buckets (``hooks``: the pre-hooks fired first, unless the step is skipped, and
        the held gradients left in .grad).
        Returns the global norm and the held gradients (`fused_step.settle_held`)."""
        pipeline = self.pipeline
        stepped, journeys = self._begin(optimizer)
        deferred = pipeline.deferred_clip
        clip, progress = pipeline.retry() if pipeline.interrupted else (None, HeldProgress())
        if clip is None and deferred is not None:
            if max_norm is not None:
                raise ValueError(
                    "step(optimizer, max_grad_norm=...) after clip_grad_norm_ clipped these "
                    "gradients already: clip once, with one or the other."
                )
            clip = (None, deferred)
        delivered = [p for p in pipeline.store if p in stepped]
        taker = weakref.ref(optimizer)  # they leave the cache once stepped, as by zero_grad()
        for param in delivered:
            pipeline.records[param].taken_by = taker
        # A cached gradient with a device part too is restored whole first, then held.
        pipeline.deliver_and_restore(p for p in delivered if p.grad is not None)
        held = {p: p.grad for p in stepped if p.grad is not None}
        parts = pipeline.store.parts(set(stepped))
        scaler, inv_scale, skip = _scaler_verdict(pipeline, optimizer, parts, held)
        if clip is None:
            order = clip_order(self._model_order, stepped)
            clip = _clip(
                pipeline, order, parts, held, max_norm, norm_type, inv_scale=inv_scale, skip=skip
            )
        total_norm, factor = clip
        held_factor = None if deferred is not None else factor  # a deferred clip clipped them
        if skip:
            # Step nothing, as scaler.step() skips: the step is still delivered, its payloads
            # spent (undone at the next backward), the held gradients unscaled as AMP's are.
            pipeline.skip(delivered)
            fused_step.scale_in_place(held, held_factor, HeldProgress())
            left = fused_step.settle_held(pipeline, held, hidden=not hooks)
        else:
            if hooks:  # not on a skipped step: scaler.step() then calls no optimizer.step()
                step_hooks.fire_pre_hooks()
            buckets = [[param for param, _ in part] for part in parts]
            del parts  # parameters only from here: a payload goes as soon as its bucket stepped
            steps = BucketSteps(
                buckets,
                held,
                delivered,
                held_factor,
                clip,
                progress,
                # The hook tables emptied: the global refusal of a plain step
                # (`refuse_a_plain_step`) cannot fire inside this step.
                step_hooks.unhooked_step,
                journeys,
                not hooks,
            )
            left = fused_step.run(pipeline, steps)
        if scaler is not None:  # told, so that update() backs off on a skip
            scaling.report_step(scaler, id(optimizer), found_inf=skip)
        pipeline.finish_step()
        return total_norm, left

    def _begin(self, optimizer: Optimizer) -> tuple[dict[Param, None], Journeys]:
        """Drain, send ``optimizer``'s state home, refuse a parameter another optimizer's
        step took. Returns its parameters (ordered) and its buckets' journeys."""
        pipeline = self.pipeline
        pipeline.drain()
        travellers: list[Traveller] = []
        if pipeline.weights is not None:
            travellers.append(StepJourney(pipeline.weights))
        if pipeline.optimizer_state is not None:  # a skipped step moves none either
            travellers.append(pipeline.optimizer_state.begin_step(optimizer))
        stepped = dict.fromkeys(p for group in optimizer.param_groups for p in group["params"])
        refuse_taken(self.pipeline, optimizer, stepped)
        return stepped, Journeys(travellers)

    def _clip_ready(self, caller: str) -> Pipeline:
        """The pipeline, drained, with nothing cached that a device gradient also holds and
        no deferred clip (what it clipped is restored): what `norm` and `clip` read."""
        pipeline = self.pipeline
        if pipeline.grad_scaler is not None and pipeline.grad_scaler.is_enabled():
            raise RuntimeError(
                f"{caller}() cannot run with an enabled GradScaler given to the cache: the "
                "cached gradients are scaled. Call step(optimizer, max_grad_norm=...), "
                "which unscales, clips and steps, in place of unscale_, clip_grad_norm_ "
                "and scaler.step."
            )
        pipeline.drain()
        if pipeline.deferred_clip is not None:
            self.restore_all()  # clipped again: from the clipped gradients, on the device
        pipeline.deliver_and_restore(p for p in pipeline.store if p.grad is not None)
        return pipeline

    def _after_restore(self, steps_before: int) -> None:
        """After a restore (which may find nothing): a budget's sample, the manager's word."""
        if self.budget is not None:
            self.budget.sample()
        if self._on_restored is not None:
            self._on_restored(steps_before)


def _scaler_verdict(
    pipeline: Pipeline,
    optimizer: Optimizer,
    parts: list[BucketPayloads],
    held: dict[Param, torch.Tensor],
) -> tuple[torch.amp.GradScaler | None, torch.Tensor | None, bool]:
    """An enabled GradScaler, its 1/scale, and whether it skips this step (a gradient
    not finite); (None, None, False) without one."""
    scaler = pipeline.grad_scaler
    if scaler is None or not scaler.is_enabled():
        return None, None, False  # a disabled scaler is no scaler
    sharded = any(record.sharded for record in pipeline.records.values())
    scaling.check_ready(scaler, optimizer, sharded=sharded)
    flag = None if pipeline.pending is None else pipeline.pending.found_inf
    skip = scaling.found_inf(flag, parts, held, pipeline.backend.device)
    return scaler, scaling.inv_scale(scaler), skip


def _clip(
    pipeline: Pipeline,
    model_order: Mapping[Param, int],
    parts: list[BucketPayloads],
    held: dict[Param, torch.Tensor],
    max_norm: float | None,
    norm_type: float,
    *,
    inv_scale: torch.Tensor | None,
    skip: bool,
) -> Clip:
    """The global norm and the factor the restores apply: the clip factor, times
    ``inv_scale`` where given; (None, inv_scale) without clipping."""
    if max_norm is None:
        if pipeline.pending is None or not pipeline.pending.norm_read:
            pipeline.compute_norms(None)  # no one asks for norms: the encodes stop
        return None, inv_scale
    total = _total_norm(pipeline, parts, held, model_order, norm_type)
    if inv_scale is not None:
        # The norms of the scaled gradients times 1/scale, a power of two: exactly the
        # norm of the unscaled ones that clip_grad_norm_ after scaler.unscale_() computes.
        total = total * inv_scale.to(total.device)
        if not skip and not bool(torch.isfinite(total)):  # a host sync, as the verdict's
            # Finite gradients whose scaled norm overflowed fp32, at a scale past 2**64 (bf16
            # compute never overflows in backward, so it grows): its factor 0 would zero them.
            total = _total_norm(pipeline, parts, held, model_order, norm_type, inv_scale=inv_scale)
    device = pipeline.backend.device
    factor = clip_factor(max_norm, total).to(device)
    return total, factor if inv_scale is None else factor * inv_scale.to(device)


def _total_norm(
    pipeline: Pipeline,
    parts: list[BucketPayloads],
    grads: dict[Param, torch.Tensor],
    order: Mapping[Param, int],
    norm_type: float,
    *,
    inv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The norm of the cached gradients in ``parts`` (their last encode's norms, else their
    payloads') and the device ``grads``, in ``order`` on the device, across ranks under FSDP2.
    ``inv_scale``: of each gradient unscaled alone, as ``unscale_()`` makes them, every
    payload's norm computed again (the encode's are of the scaled gradients)."""
    encoded = _encoded_norms(pipeline, norm_type) if inv_scale is None else None
    device = pipeline.backend.device
    local = {}
    for part in parts:
        for param, payload in part:
            norm = None if encoded is None else encoded.get(param)
            if norm is None:  # no encode computed it (the first step that asks, a resumed one)
                values = payload.kept_values().to(pipeline.records[param].route.dtype)
                if inv_scale is None:
                    norm = gradient_norm(values, norm_type).to(device)
                else:
                    norm = gradient_norm(values.to(device) * inv_scale.to(device), norm_type)
            local[param] = norm
    for param, grad in grads.items():
        grad = sharding.local(grad)
        scaled = grad if inv_scale is None else grad * inv_scale.to(grad.device)
        local[param] = gradient_norm(scaled, norm_type)
    return sharding.global_norm(clip_grad_norm_order(local, order), norm_type)


def _encoded_norms(pipeline: Pipeline, norm_type: float) -> StepNorms | None:
    """The pending step's encoded norms if of ``norm_type``, which later encodes compute."""
    pending = pipeline.pending
    if pending is not None:
        pending.norm_read = True
    pipeline.compute_norms(norm_type)
    norms = None if pending is None else pending.norms
    return norms if norms is not None and norms.norm_type == norm_type else None


def _refuse_sparse_momentum(pipeline: Pipeline, optimizer: Optimizer) -> None:
    """Raise before anything steps where SGD with momentum meets a sparse gradient: its
    sparse momentum buffer cannot go to the dense host copies (torch's "copy_() between
    dense and sparse" after the step, on every retry)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        sparse = [p for p in group["params"] if p.grad is not None and p.grad.is_sparse]
        if group["momentum"] == 0 or not sparse:
            continue
        record = pipeline.records.get(sparse[0])
        name = f"a parameter of shape {tuple(sparse[0].shape)}" if record is None else record.name
        raise RuntimeError(
            f"{name} has a sparse gradient (nn.Embedding(sparse=True), say), and SGD with "
            f"momentum={group['momentum']} keeps a sparse momentum buffer for it, which "
            "offload_optimizer_state=True cannot keep in host memory (its host copies are "
            "dense). Nothing was stepped. Step that parameter with an optimizer whose state "
            "is dense (torch.optim.SparseAdam, Adagrad) or SGD without momentum, make the "
            "embedding dense (sparse=False), or drop offload_optimizer_state=True."
        )


_LBFGS_REFUSAL = (
    "LBFGS cannot step with offload_optimizer_state=True: it updates every parameter along "
    "one direction found from all the gradients and its whole history (a line search "
    "re-evaluating the closure), so its state and every gradient must be on the device at "
    "once, while the state offload brings the state a bucket at a time. Drop "
    "offload_optimizer_state=True (the gradients are still offloaded), or use an optimizer "
    "that updates each parameter from its own gradient (SGD, Adam, AdamW)."
)
