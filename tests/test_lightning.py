"""GradientCacheCallback in a real lightning.pytorch.Trainer on the CPU, against plain runs."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

import gradient_cache  # noqa: E402
from gradient_cache.integrations.lightning import GradientCacheCallback  # noqa: E402

# Lightning 2.6 on torch 2.13 warns about its own use of a deprecated pytree class.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`")
BATCHES = 12
LOSSLESS = dict(compression_ratio=1, bucket_size_mb=0.004)  # several buckets per backward


class Regressor(L.LightningModule):
    """A small MLP that records what its own hooks see of the gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        self.emptied_after_backward: list[bool] = []
        self.norms_before_step: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    # LightningModule hooks run after the callbacks' hooks of the same name.
    def on_after_backward(self) -> None:
        self.emptied_after_backward.append(all(p.grad is None for p in self.parameters()))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms_before_step.append(torch.nn.utils.get_total_norm(grads).item())


class Wide(L.LightningModule):
    """Six 32x32 layers: a bucket (4 KiB) holds one weight, so the fused step's buckets are
    small beside all the gradients, as in a large model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6)))
        self.net = nn.Sequential(nn.Linear(16, 32), self.inner, nn.Linear(32, 4))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(8 * BATCHES, 16, generator=generator)
    return DataLoader(TensorDataset(inputs, torch.randn(8 * BATCHES, 4, generator=generator)), 8)


def fit(
    model: L.LightningModule,
    callbacks: list[L.Callback],
    *,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = L.Trainer(callbacks=callbacks, **{**options, **trainer_kwargs})
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer


def same_weights(left: nn.Module, right: nn.Module) -> bool:
    pairs = zip(left.parameters(), right.parameters(), strict=True)
    return all(torch.equal(a, b) for a, b in pairs)


def fp16_with_grad_scaler() -> dict[str, Any]:
    """precision="16-mixed" on the CPU: Lightning turns the flag into bf16 there, so pass
    its 16-mixed plugin with a CPU GradScaler. The large initial scale overflows fp16 in
    the first steps, so the scaler skips steps and backs off, as it does on a GPU."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    return dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])


PRECISIONS = {
    "32-true": dict,
    "bf16-mixed": lambda: dict(precision="bf16-mixed"),
    "16-mixed": fp16_with_grad_scaler,
}


@pytest.mark.parametrize(
    "precision,accumulate,clip,fused",
    [
        ("32-true", 1, None, True),
        ("32-true", 3, 0.05, True),
        ("bf16-mixed", 3, 0.05, True),
        ("32-true", 3, 0.05, False),
        ("16-mixed", 1, None, False),
        ("16-mixed", 3, 0.05, False),
    ],
)
def test_lossless_callback_ends_with_the_weights_of_a_plain_run(
    precision: str, accumulate: int, clip: float | None, fused: bool
) -> None:
    """The fused step by default; restored before on_before_optimizer_step with
    fused_step=False, and under 16-mixed (its GradScaler takes the restore path)."""
    settings = dict(accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    plain, cached = Regressor(), Regressor()
    plain_trainer = fit(plain, [], **settings, **PRECISIONS[precision]())
    options = LOSSLESS if fused else dict(LOSSLESS, fused_step=False)
    callback = GradientCacheCallback(**options)
    cached_trainer = fit(cached, [callback], **settings, **PRECISIONS[precision]())

    assert same_weights(cached, plain)
    assert not same_weights(plain, Regressor())  # it trained
    if clip is not None:
        finite = [norm for norm in plain.norms_before_step if math.isfinite(norm)]
        assert finite and min(finite) > clip  # so clipping changed every step
    assert not any(plain.emptied_after_backward)
    steps = BATCHES // accumulate
    if fused:
        # The gradients stay cached through on_before_optimizer_step (and the clipping),
        # and the fused step frees them, as zero_grad() would.
        assert cached.emptied_after_backward == [True] * BATCHES
        assert cached.norms_before_step == [0.0] * steps
        assert all(p.grad is None for p in cached.parameters())
        assert callback.last_summary["steps"] == steps
        return
    # Every optimizer step saw the plain run's gradients, before clipping cut them.
    torch.testing.assert_close(  # NaN where fp16 overflowed and the scaler skipped the step
        cached.norms_before_step, plain.norms_before_step, rtol=0, atol=0, equal_nan=True
    )
    # The cache held the gradients between the micro-batches of each step.
    assert cached.emptied_after_backward == ([True] * (accumulate - 1) + [False]) * steps
    # Steps the scaler skipped are not counted; the last step's fate is learnt only when
    # a next step begins, and the summary was taken before its optimizer step.
    skipped_before_last = sum(not math.isfinite(norm) for norm in plain.norms_before_step[:-1])
    assert skipped_before_last == 0 or precision == "16-mixed"
    assert callback.last_summary["steps"] == steps - skipped_before_last
    assert callback.last_summary["memory_saved_mb"] > 0
    if precision == "16-mixed":
        scales = [t.precision_plugin.scaler.get_scale() for t in (plain_trainer, cached_trainer)]
        assert scales[0] == scales[1] < 2.0**20  # the same overflow steps were skipped
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # the last step's gradients, as Lightning leaves them


class StepPeak(L.Callback):
    """The largest device peak (the CPU accounting) from on_before_optimizer_step to the
    batch's end: the clipping and the optimizer step."""

    def __init__(self, meter: Any) -> None:
        self.meter = meter
        self.peak = 0
        self._phase: Any = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._phase = self.meter.phase("step")
        self._phase.__enter__()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
            self.peak = max(self.peak, self.meter.peaks["step"].peak.device_bytes)


@pytest.mark.parametrize("state_on_host", [False, True], ids=["gradients", "gradients+state"])
def test_the_fused_step_lowers_the_steps_device_peak(state_on_host: bool) -> None:
    """accumulate_grad_batches and gradient_clip_val, bit for bit with plain Lightning, and
    the step's accounted peak below plain's by most of the gradients' bytes (and of AdamW's
    state, on the host): a few buckets of them are on the device at the step."""
    from gradient_cache.demo.accounting import TensorMemoryTracker

    settings = dict(accumulate_grad_batches=3, gradient_clip_val=0.05)
    peaks = []
    models = []
    for cached in (False, True):
        model = Wide()
        callback = GradientCacheCallback(**LOSSLESS, offload_optimizer_state=state_on_host)

        def host(callback: GradientCacheCallback = callback) -> tuple[torch.Tensor, ...]:
            manager = callback._manager
            return () if manager is None else manager.cache_tensors().host

        meter = TensorMemoryTracker(params=list(model.parameters()), host=host)
        peak = StepPeak(meter)
        with meter:
            fit(model, [peak, callback] if cached else [peak], **settings)
        peaks.append(peak.peak)
        models.append(model)
    assert same_weights(*models)
    gradients = sum(p.numel() * p.element_size() for p in models[0].parameters())
    saved = (peaks[0] - peaks[1]) / gradients
    assert saved > (2.0 if state_on_host else 0.6)  # of 1 (gradients) and 3 (and AdamW's)


def test_summary_is_logged_through_the_trainer_logger(tmp_path: Path) -> None:
    model = Regressor()
    callback = GradientCacheCallback(compression_ratio=10, codec="topk", min_compress_numel=1)
    logger = CSVLogger(tmp_path, name="run", version=0)
    fit(model, [callback], logger=logger, log_every_n_steps=1)

    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("gradient_cache/kept_fraction")]
    assert len(rows) == BATCHES
    for row in rows:
        assert 4 < float(row["gradient_cache/overall_compression_ratio"]) <= 5  # 10%, int32 idx
        assert float(row["gradient_cache/memory_saved_mb"]) > 0
    assert callback.last_summary["overall_compression_ratio"] == pytest.approx(
        float(rows[-1]["gradient_cache/overall_compression_ratio"])
    )


def test_manual_optimization_is_refused_with_the_fix() -> None:
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    model = Manual()
    with pytest.raises(ValueError, match=r"automatic_optimization is False.*apply_gradients"):
        fit(model, [GradientCacheCallback()])
    assert all(p.grad is None for p in model.parameters())


def test_multi_device_strategies_are_refused_in_setup() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    with pytest.raises(ValueError, match=r"got strategy DDPStrategy.*ModelParallelStrategy"):
        GradientCacheCallback().setup(trainer, Regressor(), stage="fit")


def test_fsdp2_through_model_parallel_strategy_on_two_processes(tmp_path: Path) -> None:
    """Two CPU processes (gloo): ratio 1 ends bit for bit as plain ModelParallelStrategy
    with clipping, and so does it with the weights and the state on the host; a ratio-100
    run resumed from a (distributed) checkpoint ends as the uninterrupted one, each rank
    loading its own residuals, and so does one with the weights and the state on the host."""
    script = Path(__file__).with_name("lightning_fsdp_run.py")
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["lossless"] == 0.0
    assert results["weights on host"] == 0.0
    assert results["resumed"] == 0.0
    assert results["weights on host resumed"] == 0.0
    assert results["summary_numel"] == 3 * 64  # rank 0 caches 3 of the head's 5 rows


def test_bad_arguments_fail_when_the_callback_is_made() -> None:
    with pytest.raises(ValueError, match="Invalid compression_ratio: 0"):
        GradientCacheCallback(compression_ratio=0)
    with pytest.raises(TypeError, match=r"Unknown engine option\(s\) \['bucket_mb'\]"):
        GradientCacheCallback(bucket_mb=1)


class SeedReadmePattern(Regressor):
    """The seed README: compress in on_after_backward, restore in optimizer_step."""

    def on_fit_start(self) -> None:
        self.hook_manager = gradient_cache.create_gradient_cache(self, compression_ratio=1)

    def on_after_backward(self) -> None:
        self.hook_manager.compress_and_free_gradients()

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any) -> None:
        self.hook_manager.apply_gradients()
        optimizer.step(closure=closure)


class RestoreInsideTheClosure(SeedReadmePattern):
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any) -> None:
        def closure_then_restore() -> Any:
            loss = closure()
            self.hook_manager.apply_gradients()
            return loss

        optimizer.step(closure=closure_then_restore)


def test_seed_readme_pattern_is_refused_restoring_inside_the_closure_trains() -> None:
    """Lightning runs the step's backward inside optimizer.step(closure), after
    optimizer_step began: restoring there comes too early and the step would find no
    gradients (it trained nothing, silently); the step over gradients the cache holds is
    refused, naming the fix. Restoring inside the closure trains as plain."""
    plain, fixed = Regressor(), RestoreInsideTheClosure()
    for model in (plain, fixed):
        fit(model, [], accumulate_grad_batches=3, gradient_clip_val=0.05)
    assert same_weights(fixed, plain)
    with pytest.raises(RuntimeError, match=r"Call hook_manager\.step\(optimizer\) in place of"):
        fit(SeedReadmePattern(), [], accumulate_grad_batches=3, gradient_clip_val=0.05)


def test_callback_hands_the_trainers_grad_scaler_to_the_cache() -> None:
    """16-mixed scales the loss; error feedback must know the scale to keep its residual."""
    callback = GradientCacheCallback(
        compression_ratio=10, codec="topk", error_feedback=True, min_compress_numel=1
    )
    seen = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            seen.append(callback._manager.engine.grad_scaler)

    trainer = fit(Regressor(), [callback, Spy()], **fp16_with_grad_scaler())
    assert seen and all(s is trainer.precision_plugin.scaler for s in seen)


def test_a_checkpoint_written_mid_accumulation_resumes_as_plain_lightning(
    tmp_path: Path,
) -> None:
    """A checkpoint written between two micro-batches of a step: Lightning keeps no
    ``.grad`` in it and restarts the epoch's batches, so plain Lightning resumed loses the
    step's first micro-batch. The cache's state held it and added it to another batch
    (2.8e-2 off plain resumed); the callback now drops it on load, as plain does."""

    class SaveAfterBatch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 2:  # accumulate_grad_batches=2: the second step's first half
                trainer.save_checkpoint(tmp_path / f"{type(pl_module).__name__}-{id(self)}.ckpt")

    resumed = []
    for options in (None, dict(**LOSSLESS, offload_optimizer_state=True)):
        extra = [] if options is None else [GradientCacheCallback(**options)]
        saver = SaveAfterBatch()
        fit(Regressor(), [saver, *extra], accumulate_grad_batches=2)
        (checkpoint,) = tmp_path.glob(f"*-{id(saver)}.ckpt")
        model = Regressor()
        extra = [] if options is None else [GradientCacheCallback(**options)]
        fit(model, extra, accumulate_grad_batches=2, ckpt_path=str(checkpoint))
        resumed.append(model)
    assert same_weights(*resumed)


def test_a_run_resumed_from_a_checkpoint_continues_as_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    """Top-k at ratio 100 with error feedback: the residuals and the engine's
    generators travel in Lightning's checkpoint, so two epochs in one go and one epoch,
    a checkpoint and a resumed second epoch end with the same weights. With the state
    offloaded: Lightning loads the optimizer's state and moves it to the device before the
    first resumed step; the callback sends it to the host in on_train_start, so every
    resumed step starts with each state tensor a host copy."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    options = dict(
        compression_ratio=100, codec="topk", min_compress_numel=1, offload_optimizer_state=True
    )
    uninterrupted = Regressor()
    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)
    fit(
        uninterrupted,
        [GradientCacheCallback(**options), saver],
        max_epochs=2,
        enable_checkpointing=True,
    )
    first_epoch = sorted(tmp_path.glob("epoch=0*.ckpt"))
    assert len(first_epoch) == 1
    saved = torch.load(first_epoch[0], weights_only=True)
    (state,) = [v for k, v in saved["callbacks"].items() if "GradientCacheCallback" in k]
    assert state["cache"]["residuals"]  # the residuals are in the checkpoint
    resumed = Regressor()
    cache = GradientCacheCallback(**options)
    spy = StateOnTheHost(cache)
    fit(resumed, [cache, spy], max_epochs=2, ckpt_path=str(first_epoch[0]))
    assert spy.seen == [True] * BATCHES
    assert same_weights(uninterrupted, resumed)


class StateOnTheHost(L.Callback):
    """At each step's start, whether every state tensor with a dimension of the trainer's
    optimizer is the cache's host copy (the cache's callback holds its manager)."""

    def __init__(self, cache: GradientCacheCallback) -> None:
        self.cache = cache
        self.seen: list[bool] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        (optimizer,) = trainer.optimizers
        assert self.cache._manager is not None and self.cache._manager.engine is not None
        host = self.cache._manager.engine.optimizer_state.copies_of(optimizer)
        values = [
            value is host.get(param, {}).get(key)
            for param, state in optimizer.state.items()
            for key, value in state.items()
            if value.dim() > 0
        ]
        self.seen.append(all(values) and bool(values))


def test_the_weights_on_the_host_train_as_plain_lightning_bit_for_bit() -> None:
    """offload_parameters=True through the callback: accumulate_grad_batches and
    gradient_clip_val, the blocks (the outer Sequential's children) a block at a time."""
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    plain, cached = Wide(), Wide()
    fit(plain, [], **settings)
    callback = GradientCacheCallback(
        **LOSSLESS, offload_optimizer_state=True, offload_parameters=True
    )
    fit(cached, [callback], **settings)
    assert same_weights(plain, cached)


def test_clipping_by_value_with_the_state_on_the_host_is_refused_at_fit_start() -> None:
    """Lightning's own clip_grad_value_ call needs every gradient on the device, which the
    state offload refuses at the first step, in a call of Lightning's: refused before any
    step instead, naming clipping by norm."""
    callback = GradientCacheCallback(compression_ratio=1, offload_optimizer_state=True)
    model = Regressor()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="gradient_clip_algorithm='norm'"):
        fit(model, [callback], gradient_clip_val=0.5, gradient_clip_algorithm="value")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class WideThroughForward(Wide):
    """Wide whose training_step calls the module itself, whose forward runs the network."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs).float(), targets)


class WideCallingTheNet(Wide):
    """Wide whose training_step calls a submodule (``self.net``), not the module."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs).float(), targets)


def test_a_compute_dtype_casts_the_inputs_of_a_submodule_the_training_step_calls() -> None:
    """docs/integrations.md: the cache casts the floating inputs where the module's forward,
    each block and a submodule outside the blocks called on its own begin, so a
    `training_step` calling `self.net(x)` trains as one calling `self(x)`, bit for bit (it
    handed fp32 inputs to bf16 weights, and torch raised "mat1 and mat2 must have the same
    dtype")."""
    options = dict(
        compression_ratio=1,
        offload_optimizer_state=True,
        offload_parameters=True,
        compute_dtype=torch.bfloat16,
    )
    trained = []
    for model in (WideCallingTheNet(), WideThroughForward()):
        callback = GradientCacheCallback(**options)
        fit(model, [callback], max_steps=2)
        assert callback.last_summary["steps"] == 2
        trained.append(model)
    assert same_weights(*trained)
