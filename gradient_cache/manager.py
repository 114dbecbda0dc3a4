"""The public face: GradientCacheHookManager and create_gradient_cache."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, cast

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import gradient_readers
from .data_parallel import check_data_parallel
from .engine import checkpoint, scaling, sharding, weights
from .engine.budget import BudgetWatch, DeviceMemory, MemoryBudget, device_memory_of
from .engine.compiled import uncompiled
from .engine.config import (
    DEFAULT_COMPRESSION_RATIO,
    EngineConfig,
    validate_compression_ratio,
    validate_exclude_layers,
)
from .engine.factory import BackendFactory, create_backend
from .engine.figures import CacheTensors, cache_tensors
from .engine.pipeline import Pipeline
from .engine.records import HELD_BY_THE_CACHE
from .engine.step import OptimizerStep, lbfgs_needs
from .engine.step_hooks import OWN_HOOKS, after_the_closure
from .engine.users_line import outside_the_package
from .model_watch import ParameterWatch
from .stats import CompressionSummary, compression_summary

logger = logging.getLogger("gradient_cache")


class GradientCacheHookManager:
    """Offloads a model's gradients to host memory during backward and restores them.

    Args:
        model: the ``nn.Module`` whose trainable parameters are cached.
        compression_ratio: 1 keeps gradients whole (lossless offload); r > 1 holds and moves
            each gradient in at most ``1 / r`` of its lossless bytes (codes, scales and indices
            counted), by the codec `EngineConfig.codec` picks (perf/RESULTS.md, "Codec
            frontier"); a tensor too small for any codec to reach r takes the most compact one
            (the summary reports the ratio achieved). ``codec="topk"`` (or ``TopK(...)``) keeps
            ``numel / r`` entries; the ladder's top-k keeps what fits in 1/r of the bytes.
        exclude_layers: substrings of parameter names whose gradients stay on the device
            exactly as plain PyTorch leaves them (e.g. ``["lm_head", "norm"]``).
        verbose: log a one-line summary at each restored step (logger ``gradient_cache``).
        config: an ``EngineConfig``; the defaults when None.
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, if any. Error-feedback
            residuals are then kept unscaled (the scale's changes do not re-weight them), and a
            step the scaler skips leaves no trace: at the next backward (or ``state_dict()``)
            the cache sees, on the host, that ``scaler.update()`` ran and no optimizer stepped,
            and puts back the residuals, random draws and step count of before it. Without it,
            the residual mixes scales, and a skipped step's residual restarts from zero.
        backend_factory: builds the engine's backend from the parameters, the config and the
            ratio; the default picks by the parameters' device. Tests pass one that runs the
            accelerator backend on stand-in streams.
        device_memory: what a ``memory_budget`` reads of the device
            (`engine.budget.DeviceMemory`); the default reads the CUDA allocator's statistics,
            and a CPU has none. Tests pass their own.

    Use ``compress_and_free_gradients()`` after backward and ``apply_gradients()`` before
    ``optimizer.step()``, or ``step(optimizer)`` for both. As a context manager it removes its hooks
    on exit; garbage-collected while attached (never kept), it removes them too, with a warning
    where it did nothing.

    While attached, ``torch.nn.utils.clip_grad_norm_`` (and ``clip_grads_with_norm_``) over
    parameters it caches, between backward and the restore, is answered from the cache: plain
    PyTorch's norm, the clip applied at the restore; ``clip_grad_value_`` and an enabled
    ``GradScaler.unscale_`` restore the gradients they read first
    (`gradient_cache.gradient_readers`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
        exclude_layers: Sequence[str] | None = None,
        verbose: bool = False,
        config: EngineConfig | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        backend_factory: BackendFactory = create_backend,
        device_memory: DeviceMemory | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}. Pass the model "
                "itself, not its parameters or state_dict."
            )
        check_data_parallel(model)
        ratio = validate_compression_ratio(compression_ratio)
        if config is None:
            config = EngineConfig()
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a gradient_cache.EngineConfig, got {config!r}.")
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be True or False, got {verbose!r}.")
        patterns = validate_exclude_layers(exclude_layers)
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler (the one that scales the loss), "
                f"got {type(grad_scaler).__name__}."
            )
        if grad_scaler is not None:
            scaling.warn_unless_powers_of_two(grad_scaler)
        elif config.compute_dtype == torch.float16:
            warnings.warn(
                "compute_dtype=torch.float16 and no GradScaler given: fp16 gradients underflow "
                "unless the loss is scaled. Scale it with a torch.amp.GradScaler and pass "
                "that scaler (create_gradient_cache(..., grad_scaler=scaler)), whose unscale "
                "and skip the fused step then does; or compute in torch.bfloat16.",
                UserWarning,
                stacklevel=outside_the_package(),
            )

        # Names as the uncompiled model gives them: checkpoints and exclude_layers mean the same.
        named = uncompiled(model)
        trainable = [(n, p) for n, p in named.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(
                f"{type(model).__name__} has no trainable parameters (none has "
                "requires_grad=True), so there are no gradients to cache."
            )
        included = [(n, p) for n, p in trainable if not any(s in n for s in patterns)]
        for pattern in patterns:
            if not any(pattern in name for name, _ in trainable):
                warnings.warn(
                    f"exclude_layers entry {pattern!r} matches no trainable parameter name "
                    f"of {type(model).__name__}; check model.named_parameters() for the names.",
                    UserWarning,
                    stacklevel=outside_the_package(),
                )
        if not included:
            raise ValueError(
                f"exclude_layers={list(patterns)} excludes every trainable parameter; "
                "nothing would be cached."
            )
        self.compression_ratio = ratio
        self.config = config
        self.verbose = verbose
        self._num_excluded = len(trainable) - len(included)
        if verbose and not logger.handlers:
            logger.addHandler(logging.StreamHandler())
            logger.setLevel(logging.INFO)
        groups = sharding.fsdp_groups(model)
        if groups and config.memory_budget is not None:
            raise ValueError(
                f"memory_budget={config.memory_budget!r} is not supported under FSDP2 yet: "
                "a group's gradients share one buffer, which would have to stay or leave "
                "whole, on every rank alike. Drop memory_budget (everything is offloaded)."
            )
        _warn_of_split_groups(groups, trainable, included)
        units = weights.plan(named, config, patterns, groups)
        pipeline = Pipeline(
            included,
            ratio=ratio,
            config=config,
            grad_scaler=grad_scaler,
            groups=groups,
            backend_factory=backend_factory,
        )
        # With offload_parameters: the weights' owner (None without).
        self._weights = None if units is None else weights.attach(named, pipeline, units)
        if config.codec is None:
            _warn_of_the_ladders_last_rung(pipeline, ratio)
        budget = None
        if config.memory_budget is not None:
            device = pipeline.backend.device
            budget = BudgetWatch(
                MemoryBudget.parse(config.memory_budget),
                device_memory if device_memory is not None else device_memory_of(device),
                device.type,
                warmup_steps=config.warmup_steps,
                weights=self._weights,
            )
        # The step holds the manager weakly, so an unkept manager is still collected.
        log_step = weakref.WeakMethod(self._log_step)

        def on_restored(steps_before: int) -> None:
            method = log_step()
            if method is not None:
                method(steps_before)

        self._step: OptimizerStep | None = OptimizerStep(
            pipeline,
            # The fused step sums norms in model.parameters() order, as clip_grad_norm_ does;
            # weak keys keep no replaced parameter alive.
            model_order=WeakIdKeyDictionary({p: i for i, (_, p) in enumerate(trainable)}),
            budget=budget,
            on_restored=on_restored,
        )
        # The forward check sits on the module called (outside a compiled graph).
        called_names = {p: n for n, p in model.named_parameters()}
        self._watch = ParameterWatch(
            model,
            [(called_names[p], p) for _, p in included],
            excluded=patterns,
            device=pipeline.backend.device,
            in_place=None if self._weights is None else self._weights.masters.in_place,
            retry_pending=lambda: pipeline.interrupted,
            at_forward=functools.partial(pipeline.settle_scaled_step, known_only=True),
        )
        _attached.add(self)  # the readers answer from it
        gradient_readers.fall_back_to(_ATTACHED_READS)
        # The finalizer holds the manager's attributes, not the manager, so an unkept manager
        # is collected and its hooks go. Not at exit: the process ends anyway.
        weakref.finalize(self, _detach_dropped, vars(self), weakref.ref(model)).atexit = False

    # --- the training-loop calls --------------------------------------------------

    def compress_and_free_gradients(self) -> None:
        """Finish offloading this backward's gradients (call after ``loss.backward()``): encode the
        last partial bucket and wait until every gradient is in host memory. Harmless twice."""
        self._live().drain()

    def apply_gradients(self) -> None:
        """Put the cached gradients back into ``param.grad`` (call before the optimizer).

        Drains first, so ``compress_and_free_gradients()`` is optional. A gradient already on the
        device (say, produced while disabled) is added to, not overwritten.
        """
        if self._live().optimizer_state is not None:
            raise RuntimeError(
                "apply_gradients() cannot run with offload_optimizer_state=True: the "
                "optimizer's state is in host memory between steps, and optimizer.step() "
                "would need all of it on the device at once. Call "
                "hook_manager.step(optimizer) instead (it takes max_grad_norm= for "
                "clipping), which brings the state to the device a bucket at a time."
            )
        self._live_step().restore_all()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
    ) -> torch.Tensor | None:
        """Restore and step bucket by bucket: at most two buckets of dense gradients on the device.

        As ``apply_gradients()`` then ``optimizer.step()`` for optimizers whose update of a
        parameter reads only its own gradient and state (SGD, Adam, AdamW, ...):
        ``optimizer.step()`` runs per bucket with only its gradients set, then a bucket's worth at a
        time for gradients never offloaded (excluded layers, those a ``memory_budget`` keeps). The
        optimizer's step hooks (pre and post, global ones too) fire once, as around a plain
        ``optimizer.step()``: pre-hooks before the first bucket (no cached gradient in ``.grad``),
        post-hooks after the last and after the state's copies to the host are complete
        (``offload_optimizer_state``), so they may read ``optimizer.state``. The bucket steps run
        without them (an LR scheduler still sees the step); a step a GradScaler skips fires none.
        The restored gradients are freed afterwards (``param.grad`` None, as after ``zero_grad()``),
        excluded layers' left as they were; cached gradients of parameters ``optimizer`` does not
        own stay cached (another optimizer's ``step()``, ``apply_gradients()``).

        ``max_grad_norm`` clips the global norm (``norm_type``) of the optimizer's gradients before
        anything is restored and returns it on the device, as ``clip_grad_norm_(model.parameters(),
        ...)`` does over them: in the model's parameter order whatever the optimizer's, from the
        norms `gradient_norm` reads (under FSDP2 every rank must call ``step``). With an enabled
        GradScaler given to the cache (``grad_scaler=``) it does what
        ``scaler.unscale_(optimizer)``, ``clip_grad_norm_`` and ``scaler.step(optimizer)`` do:
        gradients unscaled as restored, the norm returned unscaled, a step with any inf or NaN
        stepping nothing; call ``scaler.update()`` after it, neither ``unscale_`` nor
        ``scaler.step``.

        If ``optimizer.step()`` raises before changing anything (as PyTorch's optimizers do on an
        allocation failure you catch), the buckets not yet stepped stay cached and the device
        gradients in place: ``step(optimizer)`` again completes the step as if nothing had failed,
        with the first attempt's clip factor.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}; for another "
                "object with a step(), call hook_manager.apply_gradients() and then its step()."
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            # The closure's own backwards are cached again: the restore belongs inside it.
            raise TypeError(
                "step(optimizer) cannot step LBFGS: it steps one bucket at a time, while LBFGS "
                "updates all its parameters along one direction with a line search that "
                f"re-evaluates the loss (closure). {lbfgs_needs(self.config)}"
            )
        max_norm = None if max_grad_norm is None else _positive_or_inf(max_grad_norm)
        if max_norm is None and max_grad_norm is not None:
            raise ValueError(
                f"Invalid max_grad_norm: {max_grad_norm!r}; expected a number > 0 (inf: the "
                "norm, returned, without clipping, as clip_grad_norm_ gives it)."
            )
        norm = _positive_or_inf(norm_type)
        if norm is None:
            raise ValueError(f"Invalid norm_type: {norm_type!r}; expected a number > 0 or inf.")
        self._warn_of_a_missing_grad_scaler()
        self._watch.check_before_step()
        warn_of_a_partial_zero_grad(self._live(), optimizer)
        if max_norm is not None:
            self._refuse_a_clip_over_another_cache(optimizer)
        total = self._live_step().step(optimizer, max_norm=max_norm, norm_type=norm, hooks=True)
        self._mark_what_it_passed_over(optimizer)
        return total

    def _mark_what_it_passed_over(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients of ``optimizer``'s parameters another cache holds stay there for its own
        ``step(optimizer)``; plain's ``optimizer.step()`` would have stepped them, so a
        ``zero_grad()`` dropping them first is refused (`ManagerReads.zeroed`)."""
        params = {p for group in optimizer.param_groups for p in group["params"]}
        for step in _steps_of(_attached):
            pending = step.pipeline.pending
            if step is not self._step and pending is not None:
                pending.passed_over |= params & set(_held(step.pipeline))

    def _refuse_a_clip_over_another_cache(self, optimizer: torch.optim.Optimizer) -> None:
        """Where another cache holds gradients of ``optimizer``'s parameters too, each would clip
        by its own share's norm, not the optimizer's global one."""
        params = {p for group in optimizer.param_groups for p in group["params"]}
        others = [
            step
            for step in _steps_of(_attached)
            if step is not self._step and not params.isdisjoint(step.pipeline.records)
        ]
        if others:
            raise RuntimeError(
                f"step({type(optimizer).__name__}, max_grad_norm=...) over parameters that "
                f"{len(others) + 1} gradient caches hold (one optimizer over several models): "
                "each cache would clip by the norm of its own share, not of all the "
                "optimizer's gradients. Create one cache over a module holding the models "
                "(torch.nn.ModuleDict), whose max_grad_norm covers all of them, or give "
                "each model its own optimizer."
            )

    def _warn_of_a_missing_grad_scaler(self) -> None:
        """Once: fp16 autocast, no GradScaler. The fused step would step scaled gradients, and
        ``scaler.update()`` then raise "No inf checks were recorded" without a word of the cache."""
        if self._live().grad_scaler is not None or not self._watch.saw_fp16_autocast:
            return
        self._watch.saw_fp16_autocast = False  # warned once per manager
        warnings.warn(
            "The forward ran under float16 autocast and this gradient cache was given no "
            "GradScaler. If you scale the loss with one, pass it: "
            "create_gradient_cache(model, grad_scaler=scaler); then step(optimizer) "
            "unscales, skips a step with an inf and records the step for scaler.update() "
            "(without it the scaled gradients are stepped as they are, and scaler.update() "
            "raises 'No inf checks were recorded'). Without a GradScaler, ignore this.",
            UserWarning,
            stacklevel=outside_the_package(),
        )

    def gradient_norm(
        self, parameters: torch.Tensor | Iterable[torch.Tensor], *, norm_type: float = 2.0
    ) -> torch.Tensor:
        """``torch.nn.utils.get_total_norm([p.grad for p in parameters], norm_type)`` with cached
        gradients counted where they are, none restored: ``clip_grad_norm_(parameters)``'s norm, in
        its bits at ``compression_ratio=1`` (summed in the order of ``parameters``).

        A cached gradient's norm is the one its last encode computed on the device (under
        accumulation, of the earlier micro-batches' decoded sum plus the last one's gradient; with a
        lossy codec, before compression), or, the first time one is asked for, read from its host
        copy. Under FSDP2 it covers every rank's shards (an all-reduce: every rank must call it).
        The integrations call this for ``clip_grad_norm_``; so can your loop, with
        `clip_grads_with_norm_`.
        """
        return self._live_step().norm(_parameter_list(parameters), float(norm_type))

    def clip_grads_with_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        total_norm: torch.Tensor,
    ) -> None:
        """``torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)`` with cached
        gradients left cached: device ones clipped in place, cached ones by the same factor as they
        are restored, with an in-place clip's bits. A clip covering only some of the step's cached
        gradients restores those and clips them in place. A backward before the step first restores
        the clipped gradients (plain PyTorch adds the next micro-batch to clipped gradients).
        """
        self._live_step().clip(_parameter_list(parameters), max_norm, total_norm)

    def offload_state_of(self, optimizer: torch.optim.Optimizer) -> None:
        """With ``offload_optimizer_state=True``: ``optimizer``'s state on the device goes to
        the host, and from now on ``optimizer.load_state_dict`` loads there. ``step(optimizer)``
        does both as it begins; when resuming call this before loading, else the loaded state
        sits on the device, whole, until then. The integrations call it as training starts."""
        self._live_step().offload_state_of(optimizer)

    def discard_gradients(self) -> None:
        """Drop every cached gradient, as ``optimizer.zero_grad()`` drops device ones.

        A ``zero_grad()`` over all of them does this itself; call it where a skipped step's
        ``zero_grad()`` reaches only some (an optimizer over part of the model), or they are added
        into the next step. No trace is left: error-feedback residuals and the random generators go
        back to before its backward. The cost: new residuals are kept beside the old until the
        restore (on CUDA, a second host slot each), except with
        ``TopK(keep_previous_residual=False)``, whose residuals keep the discarded step's part.
        Refused after a fused step that raised having stepped some buckets: call
        ``step(optimizer)``.
        """
        engine = self._live()
        if _awaits_its_retry(engine):
            raise RuntimeError(
                "discard_gradients() after a fused step that raised having stepped part of "
                "its buckets would keep those updates and drop the rest, a step plain "
                "PyTorch never takes. Call hook_manager.step(optimizer) again to complete "
                "it, as an uninterrupted step would."
            )
        engine.discard()

    def keep_gradients(self) -> None:
        """Let the next backward add to the cached gradients a step left (another optimizer's,
        stepping later), as plain PyTorch adds to ``.grad`` without a ``zero_grad()``. Without
        this (or `discard_gradients`) that backward is refused: it cannot tell whether one ran."""
        pending = self._live().pending
        if pending is not None:
            pending.siblings_taken = False

    def state_dict(self) -> dict[str, Any]:
        """The cache's state, to save with the model's and the optimizer's.

        Error-feedback residuals, the step counter, the random generators and any gradients cached
        but not yet restored (with those a ``memory_budget`` kept on the device for the pending
        step), by parameter name, as CPU tensors (``torch.load(..., weights_only=True)`` reads it).
        Drains first. Loaded into a manager built the same way it continues bit for bit as the
        saving run goes on (the drain compresses a micro-batch's gradients still on the device,
        which with a lossy codec a run that never saved would have summed with the next one
        exactly). Under FSDP2 it holds this rank's shards: load each into the same rank at the same
        world size. With a ``grad_scaler``, call it after ``scaler.update()``: before it, a restored
        step that stepped no optimizer may be one the scaler skipped, and it refuses.
        """
        pipeline = self._live()
        if pipeline.deferred_clip is not None:
            raise RuntimeError(
                "state_dict() was called between a clip_grad_norm_ answered from the cache and "
                "optimizer.step(): the cached gradients' clip is applied as they are restored, "
                "and a checkpoint would hold them unclipped. Save after optimizer.step()."
            )
        return checkpoint.save(pipeline)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from what ``state_dict()`` returned.

        Needs nothing pending (load before the first backward) and the checkpoint's
        ``compression_ratio``, ``codec`` (top-k's ``error_feedback``, ``residual_dtype`` and
        ``value_dtype`` too), ``min_compress_numel``, ``warmup_steps`` and parameter names, else it
        raises saying what differs; other options may change. The random generators' states load
        only onto the kind of device they were saved on; elsewhere the draws restart from the seed.
        """
        checkpoint.load(self._live(), state_dict)

    def step_completed(self) -> None:
        """Mark the end of a training step.

        Restoring already records the step's figures; this checks nothing is left behind: gradients
        still cached are kept, with a warning, for the next restore.
        """
        pipeline = self._live()
        pipeline.drain()
        if pipeline.store:
            warnings.warn(
                f"step_completed() called with {len(pipeline.store)} gradients still cached; "
                "they are kept and will be added by the next apply_gradients() or step().",
                UserWarning,
                stacklevel=2,
            )

    def get_compression_summary(self) -> dict[str, Any]:
        """`summary()` as the original API's dict (its fields, plus ``memory_saved_mb``).

        While a step is pending (``step_pending``: after backward, before the restore, for any
        optimizer) the figures are of what is cached now, else of the last restored step. Right
        after backward the last, partial bucket is in none until ``compress_and_free_gradients()``.
        """
        return self.summary().as_dict()

    def summary(self) -> CompressionSummary:
        """Figures of the gradients cached now, or of the last restored step (typed; every
        field is documented on `gradient_cache.stats.CompressionSummary`)."""
        step = self._live_step()
        note = step.budget.note if isinstance(step.budget, BudgetWatch) else ""
        return compression_summary(
            step.pipeline, num_excluded=self._num_excluded, memory_budget=note
        )

    # --- switches and lifetime ----------------------------------------------------

    def enable(self) -> None:
        """Resume offloading in later backward passes."""
        self._live().set_enabled(True)

    def disable(self) -> None:
        """Leave later gradients on the device; what is already cached stays cached. Refused with
        ``offload_parameters=True``: a gradient left in ``.grad`` would outlive its weights there.

        Switched between micro-batches, the step sums them in another order than plain PyTorch, ``(b
        + c) + a`` for ``(a + b) + c``: equal up to rounding, not bit for bit.
        """
        if self._weights is not None:
            raise RuntimeError(
                "disable() cannot run with offload_parameters=True: a gradient left on the "
                "device would outlive its weights there, which go back to the host after "
                "backward. Keep the cache enabled, or create it without offload_parameters."
            )
        self._live().set_enabled(False)

    def remove_hooks(self, *, abandon_an_awaited_backward: bool = False) -> None:
        """Put any cached gradients back into ``param.grad`` and detach from the model.

        The manager cannot be used afterwards; calling this twice is harmless. If the device
        has no room for the gradients it raises ``torch.OutOfMemoryError``, still attached
        with the rest cached: call it again once memory is free. With
        ``offload_parameters=True`` it raises, changing nothing, between a forward and its backward
        (which would read weights the close moves); ``abandon_an_awaited_backward=True`` closes
        anyway (the integrations at their end, a with-block left on an exception).
        """
        if self._step is None:
            return
        if self._weights is not None:  # the weights back on the device first, where .grad goes
            # If they cannot be, nothing is detached yet.
            self._weights.close(refuse_an_awaited_backward=not abandon_an_awaited_backward)
            self._weights = None
        pipeline = self._step.pipeline
        try:
            pipeline.drain()
            pipeline.restore(list(pipeline.store))
        except torch.OutOfMemoryError as error:  # still attached, the rest cached: retried
            raise torch.OutOfMemoryError(
                f"remove_hooks() could not put every cached gradient back in .grad on the "
                f"device ({error}): {len(pipeline.store)} stay cached and the cache stays "
                "attached, so none is lost. Free device memory and call remove_hooks() again "
                "(under @gradient_cache.optimize: gradient_cache.manager_of(model) finds the "
                "cache, and the next decorated call closes it first), or drop them first with "
                "discard_gradients()."
            ) from error
        except BaseException:
            self._detach(pipeline)
            raise
        self._detach(pipeline)

    def _detach(self, pipeline: Pipeline) -> None:
        self._step = None
        self._watch.remove()
        if not _steps_of(_attached):  # the readers' originals return (unless an integration runs)
            gradient_readers.fall_back_to(None)
        pipeline.close()

    def __enter__(self) -> GradientCacheHookManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Leaving on an exception closes anyway: that exception is the one to see.
        self.remove_hooks(abandon_an_awaited_backward=exc_type is not None)

    def cache_tensors(self) -> CacheTensors:
        """The tensors the cache has now, host and device (`CacheTensors`), for memory accounting;
        empty once closed, when everything went back to ``param.grad``."""
        return CacheTensors() if self._step is None else cache_tensors(self._step.pipeline)

    @property
    def engine(self) -> Pipeline | None:
        """The engine, for tests and benchmarks that look inside; None once closed. Internal: its
        attributes may change between versions."""
        return None if self._step is None else self._step.pipeline

    @property
    def optimizer_step(self) -> OptimizerStep | None:
        """The owner of the step (`engine.step.OptimizerStep`), which the integrations
        call; None once closed."""
        return self._step

    # --- helpers ------------------------------------------------------------------

    def _live_step(self) -> OptimizerStep:
        if self._step is None:
            raise RuntimeError(
                "This GradientCacheHookManager was closed by remove_hooks() (or by leaving "
                "its with-block); create a new one with gradient_cache.create_gradient_cache."
            )
        return self._step

    def _live(self) -> Pipeline:
        return self._live_step().pipeline

    def _log_step(self, steps_before: int) -> None:
        """After a restore: the verbose log line, where it completed a step."""
        steps = self._live().steps
        if self.verbose and steps > steps_before and steps % self.config.checkpoint_frequency == 0:
            summary = self.summary()
            logger.info(
                "gradient-cache step %d: %.1f MiB of gradients offloaded, stored in %.2f MiB "
                "(%.1fx), kept fraction %.4f",
                summary.steps,
                summary.dense_gradient_mb,
                summary.stored_gradient_mb,
                summary.overall_compression_ratio,
                summary.kept_fraction,
            )
            if self._live().optimizer_state is not None:
                logger.info(
                    "gradient-cache step %d: optimizer state %.1f MiB in host memory, "
                    "%.1f MiB moved between host and device",
                    summary.steps,
                    summary.optimizer_state_host_mb,
                    summary.optimizer_state_moved_mb,
                )


def create_gradient_cache(
    model: torch.nn.Module,
    compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
    verbose: bool = False,
    *,
    exclude_layers: Sequence[str] | None = None,
    config: EngineConfig | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    backend_factory: BackendFactory = create_backend,
    device_memory: DeviceMemory | None = None,
    **options: Any,
) -> GradientCacheHookManager:
    """Attach a gradient cache to ``model`` and return its manager.

    ``options`` are `EngineConfig` fields (``bucket_size_mb=8``,
    ``codec=gradient_cache.TopK(selection="exact")``, ...); pass them or a whole ``config``, not
    both. The top-k codec's options, once fields of their own (``error_feedback=``,
    ``selection=``, ...), are still taken where they act (`EngineConfig.from_options`).
    """
    if config is not None and options:
        raise ValueError(
            f"Pass engine options either as config= or as keywords, not both "
            f"(got config and {sorted(options)})."
        )
    if config is None:
        config = EngineConfig.from_options(options, compression_ratio=compression_ratio)
    return GradientCacheHookManager(
        model,
        compression_ratio=compression_ratio,
        exclude_layers=exclude_layers,
        verbose=verbose,
        config=config,
        grad_scaler=grad_scaler,
        backend_factory=backend_factory,
        device_memory=device_memory,
    )


class ManagerReads:
    """The gradient readers answered from ``managers()`` (`gradient_readers.CacheReads`).

    A norm or clip over parameters one attached manager caches, while it has a step pending, is that
    manager's `gradient_norm` and `clip_grads_with_norm_`: nothing restored, the clip applied at the
    restore. Other readers restore the cached gradients they read first; with the optimizer state on
    the host that would bring the whole state to the device at the step, so they are refused, with
    ``fix``.
    """

    def __init__(
        self, managers: Callable[[], Iterable[GradientCacheHookManager]], *, fix: str
    ) -> None:
        self._managers = managers
        self._fix = fix

    def restore(self, reader: str, parameters: list[torch.Tensor] | None) -> None:
        """Restore the gradients of every manager caching any of ``parameters`` (None: every one)
        before ``reader`` reads them."""
        refusal = (
            f"{reader} needs every gradient on the device at once here, which with "
            "offload_optimizer_state=True would need the whole optimizer state there "
            f"too at the step. {self._fix}"
        )
        for step in self._caching(parameters):
            step.restore_all(refusal=refusal)

    def cache_for(self, parameters: list[torch.Tensor]) -> OptimizerStep | None:
        """The one cache holding gradients of ``parameters`` with a step pending, which answers a
        norm or clip over them without restoring; None otherwise (no cache or several, nothing
        pending, a GradScaler given to the cache)."""
        # By what it caches and whether a step is pending, not the gradients held now: under
        # FSDP2 every rank must take the same path (the norm is all-reduced).
        holders = [step for step in self._caching(parameters) if step.pipeline.step_pending]
        if len(holders) != 1:
            return None
        (holder,) = holders
        scaler = holder.pipeline.grad_scaler
        return None if scaler is not None and scaler.is_enabled() else holder

    def zeroed(self, parameters: Callable[[], list[torch.Tensor]]) -> None:
        """``zero_grad()`` over ``parameters()``: a manager whose pending gradients are all among
        them (also where the zero_grad() calls since the last backward reached them together: two
        optimizers') drops them, as ``zero_grad()`` drops ``.grad``; one holding others' too keeps
        them all (it cannot drop a part of its step)."""
        zeroed: set[torch.Tensor] | None = None  # built once, where a step is pending
        dropped: list[Pipeline] = []
        for pipeline in (step.pipeline for step in _steps_of(self._managers())):
            if not pipeline.step_pending:  # the common case: zero_grad() after the step
                # Settle a known GradScaler skip here, outside a hook: the forward's check misses
                # it where Lightning's training_step calls submodules.
                pipeline.settle_scaled_step(known_only=True)
                continue
            if _awaits_its_retry(pipeline):
                continue
            held = _held(pipeline)
            zeroed = set(parameters()) if zeroed is None else zeroed
            if held and pipeline.pending and set(held) <= pipeline.pending.zeroed_since(zeroed):
                _refuse_to_drop_what_a_step_passed_over(pipeline, pipeline.pending.passed_over)
                dropped.append(pipeline)
        for pipeline in dropped:  # none until none is refused
            with pipeline.capture.lock:  # not beside a failed backward's last hook
                pipeline.discard()

    def _caching(self, parameters: list[torch.Tensor] | None) -> list[OptimizerStep]:
        """The steps caching any of ``parameters`` (None: every one)."""
        return [
            s for s in _steps_of(self._managers()) if parameters is None or s.caches(parameters)
        ]


def _held(pipeline: Pipeline) -> list[torch.nn.Parameter]:
    """The parameters whose gradients ``pipeline`` holds now."""
    return [p for p, r in pipeline.records.items() if r.gradient in HELD_BY_THE_CACHE]


def warn_of_a_partial_zero_grad(pipeline: Pipeline, optimizer: torch.optim.Optimizer) -> None:
    """A zero_grad() since the last backward that reached some of the gradients the cache
    holds, not all: kept (a part of a step cannot be dropped), ``optimizer`` steps those of
    them it owns. (Another optimizer's, a later zero_grad() may still drop.)"""
    pending = pipeline.pending
    if pending is None or not pending.zeroed or pending.zeroed_after != pending.backwards:
        return
    held = _held(pipeline)
    owned = {p for group in optimizer.param_groups for p in group["params"]}
    reached = [pipeline.records[p].name for p in held if p in pending.zeroed and p in owned]
    if reached and len(reached) < len(held):
        warnings.warn(
            f"zero_grad() since the last backward reached {len(reached)} of the "
            f"{len(held)} parameters whose gradients this cache holds "
            f"({', '.join(reached[:3])}{', ...' if len(reached) > 3 else ''}), and the cache "
            "keeps them all (it cannot drop a part of a step), so this step steps them, "
            "where plain PyTorch's would not. Call hook_manager.discard_gradients() to drop "
            "every one, or keep those gradients on the device (exclude_layers=[...]), where "
            "zero_grad() reaches them.",
            UserWarning,
            stacklevel=outside_the_package(),
        )


def _refuse_to_drop_what_a_step_passed_over(
    pipeline: Pipeline, passed_over: set[torch.Tensor]
) -> None:
    if passed_over:
        names = [pipeline.records[p].name for p in pipeline.records if p in passed_over]
        raise RuntimeError(
            f"zero_grad() would drop the gradients this cache holds of {len(names)} "
            f"parameters ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) whose "
            "optimizer stepped through another cache's step(optimizer), which steps only the "
            "gradients that cache holds; plain optimizer.step() would have stepped these too. "
            "Call this cache's step(optimizer) as well before zero_grad(), or create one "
            "cache over a torch.nn.ModuleDict of the models."
        )


# Every manager constructed, held weakly; the attached ones answer the gradient readers
# where no integration routes them (`gradient_readers.fall_back_to`).
_attached: weakref.WeakSet[GradientCacheHookManager] = weakref.WeakSet()
_ATTACHED_READS = ManagerReads(
    lambda: _attached,
    fix="Clip with hook_manager.step(optimizer, max_grad_norm=...) (or clip_grad_norm_ over "
    "one model's parameters, answered from the cache), and give the GradScaler to the cache "
    "(create_gradient_cache(..., grad_scaler=scaler)): step(optimizer) then unscales as it "
    "restores, in place of scaler.unscale_(optimizer) and scaler.step(optimizer).",
)


def _refuse_plain_steps(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A global step pre-hook: the user's ``optimizer.step()`` over parameters whose gradients an
    attached manager holds once the closure ran is refused (it would step without them), unless
    an integration routes it to the fused step. Registered once, at import: a manager made or
    closed inside a step hook must not change torch's global hooks while torch runs them."""
    if gradient_readers.routed() or not _steps_of(_attached):
        return None  # the closure as it is: nothing to refuse

    def refuse() -> None:
        for step in _steps_of(_attached):
            step.refuse_a_plain_step(optimizer)

    return after_the_closure(args, kwargs, refuse)


register_optimizer_step_pre_hook(_refuse_plain_steps)
OWN_HOOKS.add(_refuse_plain_steps)  # not the user's: a fused step's hooks leave it out


def _steps_of(managers: Iterable[GradientCacheHookManager]) -> list[OptimizerStep]:
    """The steps of ``managers`` not closed (a closed one stays in `_attached` while kept)."""
    steps = (manager.optimizer_step for manager in managers)
    return [step for step in steps if step is not None]


def _detach_dropped(attributes: dict[str, Any], model: weakref.ref[torch.nn.Module]) -> None:
    """The finalizer of a manager collected while attached: its hooks would keep taking gradients no
    one can restore and hold the parameters against a new cache, so it detaches as
    ``remove_hooks()`` does, on a stand-in holding the manager's attributes. Where the model
    lives on and the manager never completed a step or holds cached gradients, it warns that
    the result of ``create_gradient_cache`` was not kept."""
    step = attributes.get("_step")
    if step is None:
        return  # closed by remove_hooks() first
    pipeline = step.pipeline
    unused = model() is not None and (pipeline.steps == 0 or pipeline.step_pending)
    stand_in = GradientCacheHookManager.__new__(GradientCacheHookManager)
    vars(stand_in).update(attributes)
    try:
        stand_in.remove_hooks(abandon_an_awaited_backward=True)
    finally:
        if unused:
            warnings.warn(
                "A GradientCacheHookManager was garbage-collected while attached, before it "
                "completed a step or while it had gradients cached: its hooks are removed and "
                "the cached gradients are back in .grad, so the model trains without the cache. "
                "Keep the manager create_gradient_cache returns (hook_manager = "
                "gradient_cache.create_gradient_cache(model)) and call hook_manager.step("
                "optimizer), or use it as a context manager (with ... as hook_manager:).",
                UserWarning,
                stacklevel=3,  # the line that dropped it, where reference counting freed it
            )


def _parameter_list(
    parameters: torch.Tensor | Iterable[torch.Tensor],
) -> list[torch.nn.Parameter]:
    """``parameters`` as clip_grad_norm_ takes them (a tensor or an iterable), as a list. A plain
    tensor is found in no store and counts by its ``.grad``, as clip_grad_norm_ counts it."""
    tensors = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    return cast(list[torch.nn.Parameter], tensors)


def _awaits_its_retry(pipeline: Pipeline) -> bool:
    """Whether a fused step raised after stepping a bucket (a discard would keep part of it)."""
    pending = pipeline.pending
    return pipeline.interrupted and pending is not None and pending.partly_stepped()


def _positive_or_inf(value: Any) -> float | None:
    """``value`` as the float ``clip_grad_norm_`` makes of it (of a one-element tensor, or a string
    such as ``"inf"`` too) where that is > 0 or inf; None otherwise (a bool, a larger tensor)."""
    if isinstance(value, str) or (
        isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool
    ):
        with contextlib.suppress(ValueError):
            value = float(value)
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    # not value <= 0 as value > 0: numbers.Real promises < and <=, not >
    return float(value) if real and not math.isnan(value) and not value <= 0 else None


def _warn_of_the_ladders_last_rung(pipeline: Pipeline, ratio: float) -> None:
    """Warn where some tensor gets no dense codec: top-k without a residual trains far worse."""
    routes = pipeline.plan.at(pipeline.config.warmup_steps)
    taken = [pipeline.records[p].name for p, route in routes.items() if route.codec.name == "topk"]
    if not taken:
        return
    warnings.warn(
        f"compression_ratio={ratio:g}: no dense codec fits 1/{ratio:g} of a gradient's bytes, "
        f"so {len(taken)} of {len(routes)} cached tensors ({', '.join(taken[:3])}"
        f"{', ...' if len(taken) > 3 else ''}) take top-k without a residual, the ladder's "
        "last rung. Top-k alone at ratio 100 trained 19.2% (AdamW) and 13.0% (SGD) worse "
        "than plain over 1,500 steps, 3 seeds (perf/RESULTS.md, 'Compression recipes': "
        "python -m perf.quality), where the default int8 is within 1%. The most compact "
        "codec that trained within about 2% there is sign, 3.9% of the bytes "
        "(codec='sign', 'Codec frontier'). Name a codec (codec='sign', or codec='topk' to "
        "keep this) and this warning goes; summary().layers says which codec each tensor "
        "took.",
        UserWarning,
        stacklevel=outside_the_package(),
    )


def _warn_of_split_groups(
    groups: list[list[torch.nn.Parameter]],
    trainable: list[tuple[str, torch.nn.Parameter]],
    included: list[tuple[str, torch.nn.Parameter]],
) -> None:
    """Warn where exclude_layers splits an FSDP2 group: its buffer then stays whole."""
    names = {param: name for name, param in trainable}
    cached = {param for _, param in included}
    for group in groups:
        kept = [names[p] for p in group if p in names and p not in cached]
        if kept and len(kept) < sum(p in names for p in group):
            warnings.warn(
                f"exclude_layers keeps {len(kept)} gradients of an FSDP2 group on the device "
                f"({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}) while the cache "
                "takes the others. A group's gradients are views into one reduce-scatter "
                "buffer, which stays on the device whole while any of them does: the cache "
                "saves no device memory for this group. Exclude the whole group (all of its "
                "module's parameters) or none of it.",
                UserWarning,
                stacklevel=outside_the_package(),
            )
