"""`GradientCacheCallback`: the cache for a `lightning.pytorch.Trainer`, no model changes.

Where Lightning touches gradients in one optimizer step (automatic optimization):

    per micro-batch:  training_step → backward → on_after_backward
    last micro-batch: ... → on_after_backward → [16-mixed: scaler.unscale_]
                      → on_before_optimizer_step → gradient clipping → optimizer.step

The callback offloads during every backward and drains in every ``on_after_backward`` (so
nothing lingers between micro-batches). Then, by default, the step is the fused step
(`routing.StepRouting`): Lightning's ``optimizer.step(closure)`` runs the closure (the
last backward, ``on_before_optimizer_step``, clipping through ``clip_grad_norm_``, answered
from the cache), then the cache restores and steps a bucket at a time. With a GradScaler
(``"16-mixed"``), which unscales every gradient at once, or ``fused_step=False``, it
restores in the ``on_after_backward`` of the micro-batch that is followed by a step: the
last place that runs before a GradScaler unscales, ``on_before_optimizer_step`` hooks and
clipping read the gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..engine.config import DEFAULT_COMPRESSION_RATIO
from ..manager import GradientCacheHookManager
from . import SUMMARY_LOGGED_FIELDS, CacheOptions, missing_extra
from .routing import StepRouting

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy, Strategy
except ImportError as error:
    raise missing_extra(__name__, "lightning", "lightning", error) from error


def _leave_on_host() -> None:
    """A strategy's ``model_to_device`` while the callback sets the model up from the host."""


class GradientCacheCallback(pl.Callback):
    """Offloads the LightningModule's gradients to host memory between backward and step.

    Args:
        compression_ratio, exclude_layers, verbose, options: as for
            `gradient_cache.create_gradient_cache`; checked here, applied to the
            LightningModule when fitting starts.

    Supported: a single device (``strategy="auto"`` with one device, or a
    ``SingleDeviceStrategy``) and FSDP2 through ``ModelParallelStrategy`` (``fully_shard``
    applied in ``configure_model``; each rank caches its shards), automatic
    optimization, any ``accumulate_grad_batches``, ``gradient_clip_val`` and precision
    ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"``. Manual optimization and the other
    multi-device strategies (DDP, FSDP1, DeepSpeed) are refused in ``setup`` with the
    reason.

    The step: in ``"32-true"`` and ``"bf16-mixed"`` it is the fused step, so at most two
    buckets of gradients (and, with ``offload_optimizer_state=True``, of optimizer state)
    are on the device at the step; ``gradient_clip_val`` by norm is answered from the cache
    and applied as each bucket is restored, with plain Lightning's bits. Gradients are then
    None in ``.grad`` in ``on_before_optimizer_step``; a hook that reads them there needs
    ``fused_step=False``, which restores every gradient before that hook, as does
    ``"16-mixed"`` (its GradScaler unscales every gradient at once; the step's peak is then
    plain's, and ``offload_optimizer_state=True`` is refused).

    At every optimizer step the figures in ``SUMMARY_LOGGED_FIELDS`` are logged through the
    LightningModule's ``log`` (so every logger of the trainer, at ``log_every_n_steps``)
    as ``gradient_cache/<field>``; ``last_summary`` holds the whole
    ``get_compression_summary()`` of the latest step, and stays after ``fit`` returns.

    A model on the host (``device=`` with ``offload_parameters=True``, as for
    `gradient_cache.create_gradient_cache`): the strategy does not move the LightningModule
    to its device in this fit; the cache sets it up from the host in ``on_fit_start``, its
    weights on the device a window at a time, while Lightning puts the batches on the
    device as usual. ``device`` must be the trainer's (its strategy's ``root_device``; a
    device without an index takes the trainer's), on one device (``SingleDeviceStrategy``);
    anything else is refused in ``setup``.

    Checkpoints: the cache's state (``GradientCacheHookManager.state_dict()``) is saved
    in Lightning's checkpoints and loaded on ``trainer.fit(..., ckpt_path=...)``, so a
    resumed run continues as the uninterrupted one would.

    Gradients are empty in ``.grad`` during the micro-batches that accumulate: hooks
    that read them there (``on_after_backward`` of those micro-batches) see None;
    ``on_before_optimizer_step`` sees them all only on the restore path (above).
    """

    def __init__(
        self,
        compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
        *,
        exclude_layers: Sequence[str] | None = None,
        verbose: bool = False,
        **options: Any,
    ) -> None:
        self._options = CacheOptions.from_arguments(
            compression_ratio=compression_ratio,
            exclude_layers=exclude_layers,
            verbose=verbose,
            options=options,
        )
        # This fit's options: ``device=`` resolved to the trainer's device (see setup).
        self._fit_options = self._options
        # The strategy kept from moving the model to its device in this fit (``device=``).
        self._strategy_on_hold: Strategy | None = None
        self._manager: GradientCacheHookManager | None = None
        self.last_summary: dict[str, Any] | None = None
        # A checkpoint's cache state: Lightning restores callbacks before on_fit_start,
        # where the manager is created (most strategies), so it waits here until then.
        self._state_to_load: dict[str, Any] | None = None
        self._per_rank_state = False  # ModelParallelStrategy: see state_dict
        self._routing: StepRouting | None = None  # in place from on_fit_start to teardown
        self._logged_steps = -1  # the summary's step count when it was last logged

    # --- checks and lifetime ------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                f"GradientCacheCallback needs automatic optimization, but "
                f"{type(pl_module).__name__}.automatic_optimization is False (manual "
                "optimization, e.g. for several optimizers): the callback cannot know when "
                "you step. Remove the callback and, in training_step, create the cache with "
                "gradient_cache.create_gradient_cache(self) and call "
                "hook_manager.apply_gradients() after self.manual_backward(loss) and before "
                "clipping or opt.step()."
            )
        strategy = trainer.strategy
        self._per_rank_state = isinstance(strategy, ModelParallelStrategy)
        if not isinstance(strategy, (SingleDeviceStrategy, ModelParallelStrategy)):
            raise ValueError(
                f"GradientCacheCallback supports one device (SingleDeviceStrategy) and FSDP2 "
                f"(ModelParallelStrategy, with fully_shard applied in configure_model), got "
                f"strategy {type(strategy).__name__}. Under DDP the cache would take each "
                "rank's gradients before DDP averages them, and the ranks would drift apart; "
                "DDP's reducer also keeps every gradient on the device anyway. Use "
                "strategy=ModelParallelStrategy(tensor_parallel_size=1) and fully_shard the "
                "model in configure_model, train on one device, or remove the callback."
            )
        self._fit_options = self._options
        if self._options.config.device is not None:
            device = torch.device(self._options.config.device)
            self._fit_options = self._hold_on_host(strategy, device)

    def _hold_on_host(self, strategy: Strategy, device: torch.device) -> CacheOptions:
        """``device=``: this fit's options on the trainer's own device, after keeping the
        strategy from moving the whole model there (raises naming what cannot)."""
        if not isinstance(strategy, SingleDeviceStrategy):
            raise ValueError(
                f"GradientCacheCallback(device={str(device)!r}) sets the model up from the host "
                f"on one device, and strategy {type(strategy).__name__} places it itself: "
                "fully_shard puts each rank's shards on its device in configure_model, from "
                "which offload_parameters=True takes them to the host. Drop device (build the "
                "model in configure_model), or train on one device."
            )
        root = strategy.root_device
        if root.type != device.type or device.index not in (None, root.index):
            flags = f"accelerator={device.type!r}"
            if device.index is not None:
                flags += f", devices=[{device.index}]"
            raise ValueError(
                f"GradientCacheCallback(device={str(device)!r}) sets the model up on {device}, "
                f"and this trainer runs on {root} (its strategy's root_device, where Lightning "
                f"puts the batches). Give the Trainer that device ({flags}) or pass "
                f"device={str(root)!r}."
            )
        # SingleDeviceStrategy.setup, after this hook and before on_fit_start, moves the
        # whole LightningModule to root_device (model_to_device): the model the cache is for
        # may not fit there. For this fit it does nothing (an instance attribute, removed in
        # _release); on_fit_start's cache then sets the model up from the host (buffers to
        # the device, weights a window at a time). Lightning still puts each batch on
        # root_device, and LightningModule.device already answers root_device (Lightning
        # sets it before the setup hooks).
        strategy.model_to_device = _leave_on_host  # type: ignore[method-assign]
        self._strategy_on_hold = strategy
        config = dataclasses.replace(self._options.config, device=root)
        return dataclasses.replace(self._options, config=config)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not in setup: configure_model and the move to the device come after it.
        self._detach()
        # 16-mixed's GradScaler: error feedback then keeps its residual unscaled.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        fused = self._options.fused_step and not (scaler is not None and scaler.is_enabled())
        if self._options.config.offload_optimizer_state and not fused:
            raise ValueError(
                "offload_optimizer_state=True needs the fused step, which precision "
                "'16-mixed' cannot take: its GradScaler unscales every gradient at once, and "
                "the step would need the whole optimizer state on the device. Use "
                "precision='bf16-mixed' or '32-true', or drop offload_optimizer_state."
            )
        if (
            self._options.config.offload_optimizer_state
            and trainer.gradient_clip_val
            and trainer.gradient_clip_algorithm == "value"
        ):
            raise ValueError(
                "gradient_clip_algorithm='value' cannot run with offload_optimizer_state=True: "
                "clipping by value reads every gradient on the device at once, and the step "
                "would then need the whole optimizer state there. Clip by norm "
                "(gradient_clip_algorithm='norm', answered from the cache a bucket at a "
                "time), or drop offload_optimizer_state."
            )
        self._manager = self._fit_options.create_manager(pl_module, grad_scaler=scaler)
        self._logged_steps = -1
        manager = self._manager
        self._routing = StepRouting(lambda: [manager], fused=fused).__enter__()
        if self._state_to_load is not None:
            state, self._state_to_load = self._state_to_load, None
            self._load(state)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed fit loaded the optimizers' state and moved it to the device after
        # on_fit_start: with offload_optimizer_state=True it goes to host memory here,
        # before the first forward (and before a memory budget measures a step).
        step = None if self._manager is None else self._manager.optimizer_step
        if step is not None:
            step.offload_loaded_state(trainer.optimizers)

    # --- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The manager's ``state_dict()`` (residuals, counters, generators), saved by
        Lightning in every checkpoint; empty before fitting starts.

        Under ``ModelParallelStrategy`` every rank caches its own shards, while Lightning
        writes callback states from rank 0 only: the ranks' states are gathered
        (``all_gather_object``) under ``"ranks"``, and each rank loads its own.
        """
        if self._manager is None:
            return {}
        state = self._manager.state_dict()
        if not self._per_rank_state:
            return {"cache": state}
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, state)
        return {"ranks": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by Lightning when fitting resumes from ``ckpt_path``; applied once the
        manager exists, which refuses a state made with other settings."""
        if "ranks" in state_dict:
            states = state_dict["ranks"]
            if len(states) != dist.get_world_size():
                raise ValueError(
                    f"This checkpoint's gradient-cache state holds {len(states)} ranks' shards; "
                    f"this run has {dist.get_world_size()} processes. Resume with the world "
                    "size it was saved with."
                )
            self._state_to_load = states[dist.get_rank()]
        else:
            self._state_to_load = state_dict.get("cache")
        if self._manager is not None and self._state_to_load is not None:
            # Strategies that restore after setup (ModelParallelStrategy) call this after
            # on_fit_start made the manager, still before the first backward.
            state, self._state_to_load = self._state_to_load, None
            self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        """The manager's state, without the gradients of a step in progress: Lightning
        keeps no ``.grad`` in a checkpoint written mid-accumulation and restarts the
        epoch's batches on resume, so plain Lightning loses that step's earlier
        micro-batches; added to other batches, these would train differently."""
        assert self._manager is not None
        self._manager.load_state_dict(state)
        self._manager.discard_gradients()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._release()  # Lightning skips teardown hooks when fit raises

    def _release(self) -> None:
        """Detach, and let the strategy move the model again (``device=``)."""
        strategy, self._strategy_on_hold = self._strategy_on_hold, None
        try:
            self._detach()
        finally:
            if strategy is not None:
                vars(strategy).pop("model_to_device", None)

    def _detach(self) -> None:
        """Put back anything still cached and remove the hooks from the model."""
        routing, self._routing = self._routing, None
        manager, self._manager = self._manager, None
        try:
            if routing is not None:
                routing.__exit__(None, None, None)
        finally:
            if manager is not None:  # never refused: the fit ended, or raised
                manager.remove_hooks(abandon_an_awaited_backward=True)

    # --- the training step --------------------------------------------------------

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._manager is None or self._routing is None:
            return
        # Lightning's own ThroughputMonitor asks the fit loop the same question.
        if self._routing.fused or trainer.fit_loop._should_accumulate():
            self._manager.compress_and_free_gradients()
        else:
            self._manager.apply_gradients()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._manager is None or self._routing is None or self._routing.fused:
            return
        # Normally a no-op: on_after_backward restored. Not when the step's own
        # training_step returned None (no backward) after micro-batches that did run.
        self._manager.apply_gradients()
        self._log(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if self._manager is not None and self._routing is not None and self._routing.fused:
            self._log(pl_module)  # after the fused step, if this batch stepped

    def _log(self, pl_module: pl.LightningModule) -> None:
        """Log the summary of a step not logged yet."""
        assert self._manager is not None
        summary = self._manager.get_compression_summary()
        if summary["step_pending"] or summary["steps"] == self._logged_steps:
            return
        self._logged_steps = summary["steps"]
        self.last_summary = summary
        pl_module.log_dict(
            {f"gradient_cache/{field}": float(summary[field]) for field in SUMMARY_LOGGED_FIELDS},
            on_step=True,
            on_epoch=False,
        )
