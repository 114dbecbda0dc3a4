"""The `gradient-cache demo` comparison: one model trained several ways from one seed.

Plain PyTorch, the cache lossless (ratio 1), the cache at a chosen ratio and, in the
memory-bound scenario, the cache lossless with the optimizer state in host memory too
(`offload_optimizer_state`) and with the weights there as well (`offload_parameters`, set up
from the host with ``device=``) train the built-in TinyGPT on the embedded byte corpus
from the same initial weights and batches, in one of three scenarios (`SCENARIOS`):
"memory-bound" (the default: activation checkpointing and gradient accumulation, where
gradients are part of the peak), "activations" (neither: activations set the peak before
any gradient exists) or "larger-than-device" (a device capped at half the model's fp32
weights, the model built on the host: plain PyTorch refused at placement under the cap and
trained without it, and the cache lossless with the weights and the state on the host,
`offload_parameters`, set up from the host with ``device=`` and trained under the cap;
`variants`).
Each run records its loss and time per step and, per phase of a step (forward, backward,
optimizer), device memory: on CUDA from the caching allocator on every step; on the CPU
from `gradient_cache.demo.accounting`'s tensor tracker on a few designated steps only, because
its dispatch mode slows a step down (about 1.5x on the small model, 3x on the tiny one); on
the emulated device (``emulated``: `gradient_cache.testing`, larger-than-device only) from
its allocator, which holds the cap on every step, with the tracker beside it on those steps.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, TextIO

import psutil
import torch

from .. import __version__
from ..engine.config import EngineConfig
from ..manager import create_gradient_cache
from ..stats import MIB, process_rss_mb
from .models import GPT_SIZES, TinyGPT, byte_corpus, make_batches
from .processes import fresh_processes
from .training import (
    PHASES,
    PhaseMemory,
    PhaseScope,
    PhaseWatch,
    micro_batches,
    no_phase,
    train_step,
)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """How a demo run trains: a step is ``micro_batches`` forward/backward passes of
    ``micro_batch_size`` sequences each, then one optimizer step."""

    name: str
    activation_checkpointing: bool
    micro_batches: int
    micro_batch_size: int
    summary: str
    # Defaults of the command line, chosen to finish in about 2 minutes on a 2-core CPU.
    model_size: str
    steps: int
    # A fourth run, lossless with the optimizer state on the host (offload_optimizer_state),
    # and a fifth with the weights there too (offload_parameters), set up from the host
    # (device=), uncapped.
    state_run: bool = False
    # The device capped at half the model's fp32 weights (`device_cap_bytes`) before
    # anything is placed on it, the model built on the host: plain is placed under the cap
    # (refused) and trains without it (the reference), the cache lossless with the weights
    # and the state on the host (offload_parameters) is set up from the host (device=) and
    # trains under it; no ratio run.
    cap_below_weights: bool = False
    bucket_size_mb: float | None = None  # the cache's; None: the library's own choice
    cuda_model_size: str | None = None  # the default model on CUDA, where it differs

    def default_model_size(self, device: torch.device) -> str:
        if device.type == "cuda" and self.cuda_model_size is not None:
            return self.cuda_model_size
        return self.model_size


SCENARIOS = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            name="memory-bound",
            activation_checkpointing=True,
            micro_batches=2,
            micro_batch_size=2,
            summary="activation checkpointing per block, 2 micro-batches of 2 per step: "
            "gradients live across micro-batches and into the step, and are part of the peak",
            # "small" misses the goal at ratio 100 (72% of the offloaded bytes): the
            # error-feedback encode of its tied embedding, 11% of the gradients, needs
            # about 13 MiB of scratch at the end of backward.
            model_size="medium",
            steps=12,
            state_run=True,
        ),
        Scenario(
            name="activations",
            activation_checkpointing=False,
            micro_batches=1,
            micro_batch_size=4,
            summary="one batch of 4 per step, no checkpointing: activations set the peak "
            "at the start of backward, before any gradient exists",
            model_size="small",
            steps=50,
        ),
        Scenario(
            name="larger-than-device",
            activation_checkpointing=True,
            micro_batches=2,
            micro_batch_size=2,
            summary="the device capped at half the model's fp32 weights, the model built on "
            "the host: plain PyTorch cannot even place it under the cap, the cache with the "
            "weights and the optimizer state on the host (offload_parameters), set up from "
            "the host (device=), trains under it, bit for bit with plain PyTorch uncapped",
            # "bytes": 99% of its weights in its 16 blocks, which stream a block at a time.
            # On CUDA "bytes-xl": the allocator's overheads need a cap of half a GiB.
            model_size="bytes",
            cuda_model_size="bytes-xl",
            steps=10,
            cap_below_weights=True,
            # Small next to the cap: the step holds two buckets of weights, gradients and
            # AdamW's two moments (with the library's choice here, a 32nd of the gradients,
            # 0.86 MiB: 6.9 MiB, half the cap; docs/saving.md's table is this size's).
            bucket_size_mb=0.5,
        ),
    )
}
DEFAULT_SCENARIO = "memory-bound"
STATE_RUN = "cache r=1, state on host"
WEIGHTS_RUN = "cache r=1, weights and state on host"
PLAIN_UNDER_CAP = "plain, under the cap"
PLACEMENT = "placement"  # where a run's model could not be placed under the device cap
BATCH_SIZE = 4  # sequences per optimizer step, in every scenario
LEARNING_RATE = 1e-3
VAL_BATCHES = 4
VAL_BATCH_SIZE = 8
# Loss reported as "final": the mean of the last steps, smoother than one batch's loss.
FINAL_LOSS_STEPS = 10
# CPU only: how many steps the tensor tracker measures, spread from the first to the last.
CPU_MEASURED_STEPS = 4

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    """What the command line chose; validated there."""

    steps: int
    ratio: float
    model_size: str
    device: torch.device
    seed: int
    scenario: str = DEFAULT_SCENARIO
    # Every run uses the parent's intra-op thread count: a CPU kernel that sums per-thread
    # partial results (LayerNorm's backward does) gives other bits with other counts.
    threads: int = field(default_factory=torch.get_num_threads)
    # The runs train on the emulated device (gradient_cache.testing), its allocator capped
    # where a run is; ``device`` is then the CPU it runs on. Installed in each run's
    # process, never in the caller's (it is for the whole process, for good).
    emulated: bool = False
    # The validation batches each run evaluates at its end, VAL_BATCHES as the settings are
    # made (the runs' processes import this module anew: a test lowers it before, here).
    val_batches: int = field(default_factory=lambda: VAL_BATCHES)

    @property
    def device_label(self) -> str:
        """Where the runs train, as the report names it."""
        return "emu (emulated on the CPU)" if self.emulated else str(self.device)


class DeviceCapExceeded(RuntimeError):
    """A run that should train under the scenario's device cap ran out of memory there."""


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One run of a scenario: plain PyTorch (``ratio`` None) or the cache at ``ratio``."""

    name: str
    ratio: float | None = None
    state_on_host: bool = False  # offload_optimizer_state
    weights_on_host: bool = False  # offload_parameters (the state on the host too)
    capped: bool = False  # under the scenario's device cap from the first step


def variants(settings: DemoSettings) -> tuple[list[Variant], Variant | None]:
    """The runs of ``settings``' scenario, compared with the first (plain PyTorch), and the
    run of plain PyTorch under the device cap, where the scenario sets one."""
    scenario = SCENARIOS[settings.scenario]
    if scenario.cap_below_weights:
        cached = Variant(
            name=WEIGHTS_RUN, ratio=1.0, state_on_host=True, weights_on_host=True, capped=True
        )
        return [Variant(name="plain"), cached], Variant(name=PLAIN_UNDER_CAP, capped=True)
    runs = [
        Variant(name="plain"),
        Variant(name="cache r=1", ratio=1.0),
        Variant(name=f"cache r={settings.ratio:g}", ratio=settings.ratio),
    ]
    if scenario.state_run:
        runs.append(Variant(name=STATE_RUN, ratio=1.0, state_on_host=True))
        runs.append(Variant(name=WEIGHTS_RUN, ratio=1.0, state_on_host=True, weights_on_host=True))
    return runs, None


def device_cap_bytes(settings: DemoSettings) -> int | None:
    """The scenario's device cap: half the model's fp32 weights (None: no cap)."""
    if not SCENARIOS[settings.scenario].cap_below_weights:
        return None
    return weight_bytes(settings) // 2


def weight_bytes(settings: DemoSettings) -> int:
    """The bytes of the model's weights (fp32)."""
    with torch.device("meta"):  # shapes only
        params = TinyGPT(GPT_SIZES[settings.model_size]).parameters()
        return sum(p.numel() * p.element_size() for p in params)


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    step: int
    start_bytes: int
    phases: dict[str, PhaseMemory]


@dataclass(kw_only=True)
class RunResult:
    """One training run; ``ratio`` is None for plain PyTorch."""

    name: str
    ratio: float | None
    losses: list[float]
    step_seconds: list[float]
    timed_steps: list[int]  # steps whose time counts: those the CPU tracker did not slow
    memory: list[StepMemory]
    val_loss: float
    process_rss_mb: float  # psutil, at the end of the run
    peak_rss_mb: float  # the run's process, whole run
    summary: dict[str, Any] | None
    weights: dict[str, torch.Tensor]  # final, on the CPU; compared, not reported
    # The optimizer state's bytes in host memory (offload_optimizer_state; else 0).
    offloaded_state_bytes: int = 0
    # The weights' masters' bytes in host memory (offload_parameters; else 0).
    offloaded_weight_bytes: int = 0
    # Where and how a run under the device cap ran out of memory ("placement: ..." where
    # its model could not be placed on the device); None: it did not.
    out_of_memory: str | None = None

    @property
    def refused_at_placement(self) -> bool:
        return self.out_of_memory is not None and self.out_of_memory.startswith(PLACEMENT)

    @property
    def peak_device_bytes(self) -> int:
        return max(p.peak_bytes for m in self.memory for p in m.phases.values())

    @property
    def peak_accounted_bytes(self) -> int | None:
        """The tensor tracker's peak beside an allocator's (the emulated device); else None."""
        accounted = [p.accounted_bytes for m in self.memory for p in m.phases.values()]
        if not accounted or None in accounted:
            return None
        return max(a for a in accounted if a is not None)

    def phase_peak_bytes(self, phase: str) -> int:
        return max(m.phases[phase].peak_bytes for m in self.memory)

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_seconds[s - 1] for s in self.timed_steps) * 1e3

    @property
    def final_train_loss(self) -> float:
        return statistics.fmean(self.losses[-FINAL_LOSS_STEPS:])

    @property
    def offloaded_gradient_bytes(self) -> int:
        if self.summary is None:
            return 0
        return sum(layer["dense_bytes"] for layer in self.summary["layers"].values())

    @property
    def offloaded_bytes(self) -> int:
        """What the run takes off the device: its gradients, its optimizer state and its
        weights, where it keeps those on the host."""
        return (
            self.offloaded_gradient_bytes + self.offloaded_state_bytes + self.offloaded_weight_bytes
        )


@dataclass(kw_only=True)
class DemoResult:
    settings: DemoSettings
    model: dict[str, Any]
    machine: dict[str, Any]
    memory_method: str
    runs: list[RunResult]
    wall_seconds: float
    # A second plain run, made only when the lossless run did not end bit for bit on the
    # first: it tells which of the two left the common path (see `run_demo`).
    plain_again: RunResult | None = None
    # The scenario's device cap (`device_cap_bytes`), and plain PyTorch's run under it.
    cap_bytes: int | None = None
    plain_under_cap: RunResult | None = None

    def weight_difference(self, run: RunResult, *, plain: RunResult | None = None) -> float:
        """Largest absolute difference between ``run``'s final weights and plain's (the
        first plain run unless ``plain`` is given)."""
        reference = (plain or self.runs[0]).weights
        return max((reference[k] - w).abs().max().item() for k, w in run.weights.items())


def run_demo(settings: DemoSettings) -> DemoResult:
    """Train the scenario's runs (`variants`: plain, the cache at ratio 1 and at
    ``settings.ratio`` and, memory-bound, at ratio 1 with the optimizer state and then with
    the weights on the host as well); return every figure.

    Each run gets a fresh process, so its host RSS and CUDA allocator figures hold only
    its own memory, not what earlier runs left in the allocators.
    """
    started = time.perf_counter()
    config = GPT_SIZES[settings.model_size]
    scenario = SCENARIOS[settings.scenario]
    compared, under_cap = variants(settings)
    with fresh_processes() as in_fresh_process:
        # Under the cap first: what plain PyTorch does there is the question the scenario asks.
        plain_under_cap = (
            None if under_cap is None else in_fresh_process(_train, under_cap, settings)
        )
        runs = [in_fresh_process(_train, variant, settings) for variant in compared]
        for run in runs:
            if run.out_of_memory is not None:
                raise DeviceCapExceeded(
                    f"{run.name!r} ran out of memory under the device cap of "
                    f"{device_cap_bytes(settings) or 0:_} bytes at {run.out_of_memory}; it "
                    "should train under it. Please report this, with the command line."
                )
        # Plain PyTorch itself has ended a run on other bits than its other runs on this CPU
        # (perf/RESULTS.md, "Determinism"): when the lossless run differs from plain, a second
        # plain run says whether the cache or that first plain run left the common path.
        plain_again = None
        if weights_differ(runs[0], runs[1]):
            plain_again = in_fresh_process(_train, Variant(name="plain, again"), settings)
    train_tokens, val_tokens = byte_corpus()
    with torch.device("meta"):  # shapes only: count what each run trained
        params = list(TinyGPT(config).parameters())
    return DemoResult(
        settings=settings,
        model={
            "size": settings.model_size,
            "config": vars(config),
            "parameters": sum(p.numel() for p in params),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in params),
            "batch_size": BATCH_SIZE,
            "scenario": scenario.name,
            "scenario_summary": scenario.summary,
            "activation_checkpointing": scenario.activation_checkpointing,
            "micro_batches": scenario.micro_batches,
            "micro_batch_size": scenario.micro_batch_size,
            # The size the cache takes for this model (bucket_size_mb=None: sized from it).
            "bucket_size_mb": EngineConfig(bucket_size_mb=scenario.bucket_size_mb).bucket_bytes(
                sum(p.numel() * p.element_size() for p in params)
            )
            / MIB,
            "learning_rate": LEARNING_RATE,
            "optimizer": "AdamW",
            "corpus_bytes": {"train": train_tokens.numel(), "validation": val_tokens.numel()},
        },
        machine=_machine(settings),
        memory_method=_memory_method(settings),
        runs=runs,
        wall_seconds=time.perf_counter() - started,
        plain_again=plain_again,
        cap_bytes=device_cap_bytes(settings),
        plain_under_cap=plain_under_cap,
    )


def _memory_method(settings: DemoSettings) -> str:
    if settings.emulated:
        return (
            "torch.accelerator.max_memory_allocated on the emulated device, whose allocator "
            "holds the cap on every step, reset at each phase; beside it the tensor storages "
            "counted by gradient_cache.demo.accounting"
        )
    if settings.device.type == "cuda":
        return "torch.cuda.max_memory_allocated, reset at each phase of every step"
    return (
        "tensor storages counted by gradient_cache.demo.accounting (on a CPU, device "
        "and host are the same RAM; this counts what would live on a device)"
    )


def weights_differ(a: RunResult, b: RunResult) -> bool:
    return any(not torch.equal(w, b.weights[k]) for k, w in a.weights.items())


def measured_steps(steps: int, device: torch.device) -> list[int]:
    """The 1-based steps whose memory is measured: all on CUDA, a spread few on the CPU."""
    if device.type == "cuda" or steps <= CPU_MEASURED_STEPS:
        return list(range(1, steps + 1))
    last = CPU_MEASURED_STEPS - 1
    return sorted({1 + round(i * (steps - 1) / last) for i in range(CPU_MEASURED_STEPS)})


def _train(variant: Variant, settings: DemoSettings) -> RunResult:
    """One run, in its own process: train, evaluate, and hand back figures and weights.
    A run under the device cap that runs out of memory stops there and says where."""
    # Here, not at the top: the accounting needs private torch names (._torch_private), and
    # the command line, which imports this module, must work without them.
    from .accounting import device_memory_meter

    torch.set_num_threads(settings.threads)
    cap_bytes = device_cap_bytes(settings) if variant.capped else None
    device = run_device(settings, cap_bytes)
    name = variant.name
    config = GPT_SIZES[settings.model_size]
    train_tokens, val_tokens = byte_corpus()
    val_generator = torch.Generator().manual_seed(settings.seed + 1)
    val_batches = [
        make_batches(
            val_tokens, batch_size=VAL_BATCH_SIZE, seq_len=config.seq_len, generator=val_generator
        )
        for _ in range(settings.val_batches)
    ]
    scenario = SCENARIOS[settings.scenario]
    torch.manual_seed(settings.seed)
    # On the host: where the cache keeps the weights on the host, it sets the model up on
    # the device from there (device=), the weights never whole on the device.
    model = TinyGPT(config, activation_checkpointing=scenario.activation_checkpointing)
    if not variant.weights_on_host:
        try:
            model = place(model, device, cap_bytes)
        except torch.OutOfMemoryError as error:
            if cap_bytes is None:
                raise
            return RunResult(
                name=name, ratio=variant.ratio, losses=[], step_seconds=[], timed_steps=[],
                memory=[], val_loss=math.nan, process_rss_mb=process_rss_mb(),
                peak_rss_mb=_peak_rss_bytes() / MIB, summary=None, weights={},
                out_of_memory=f"{PLACEMENT}: {_first_line(error)}",
            )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    manager = None
    if variant.ratio is not None:
        manager = create_gradient_cache(
            model,
            compression_ratio=variant.ratio,
            offload_optimizer_state=variant.state_on_host,
            offload_parameters=variant.weights_on_host,
            bucket_size_mb=scenario.bucket_size_mb,
            # From the host: the masters stay there, a window of the weights goes over.
            device=device if variant.weights_on_host else None,
        )
    generator = torch.Generator().manual_seed(settings.seed)  # the same batches in every run

    def train(x: torch.Tensor, y: torch.Tensor, *, phase: PhaseScope = no_phase) -> torch.Tensor:
        """One step of the scenario. The cache runs use the fused step, which restores one
        bucket of dense gradients at a time (apply_gradients() would restore all at once)."""
        batches = micro_batches(x, y, scenario.micro_batches)
        return train_step(
            model, optimizer, manager, batches, fused=True, keep_logits=True, phase=phase
        )

    measured = measured_steps(settings.steps, device)
    losses, seconds, memory = [], [], []
    out_of_memory = None
    bar = ProgressBar(name, settings.steps, stream=sys.stderr)
    parent = multiprocessing.parent_process()  # None when called in the main process
    for step in range(1, settings.steps + 1):
        if parent is not None and not parent.is_alive():
            raise SystemExit(f"{name}: the demo that started this run has ended; stopping.")
        x, y = make_batches(
            train_tokens, batch_size=BATCH_SIZE, seq_len=config.seq_len, generator=generator
        )
        x, y = x.to(device), y.to(device)
        start = time.perf_counter()
        watch = None
        try:
            if step in measured:
                meter = device_memory_meter(
                    model, optimizer=optimizer, cache=manager, cap_bytes=cap_bytes
                )
                watch = PhaseWatch(meter)
                with meter:
                    start_bytes = meter.reading().device_bytes
                    loss = train(x, y, phase=watch)
                phases = {name: watch.memory(name) for name in PHASES}
                memory.append(StepMemory(step=step, start_bytes=start_bytes, phases=phases))
            else:  # an allocator holds the cap here too (on the CPU only the tracker does)
                loss = train(x, y)
        except torch.OutOfMemoryError as error:
            if cap_bytes is None:
                raise
            where = f"step {step}" + ("" if watch is None else f", {watch.current}")
            out_of_memory = f"{where}: {_first_line(error)}"
            break
        losses.append(loss.item())  # on CUDA this waits for the step, so the time is real
        seconds.append(time.perf_counter() - start)
        bar.update(step, losses[-1])
    bar.close()
    if out_of_memory is not None:
        # Nothing to evaluate or compare: the run stopped where the device ran out.
        return RunResult(
            name=name, ratio=variant.ratio, losses=losses, step_seconds=seconds,
            timed_steps=[], memory=memory, val_loss=math.nan,
            process_rss_mb=process_rss_mb(), peak_rss_mb=_peak_rss_bytes() / MIB,
            summary=None, weights={}, out_of_memory=out_of_memory,
        )  # fmt: skip
    # Evaluated and copied out before the cache closes: closing brings weights kept on the
    # host back to the device, where a capped device has no room for them all (it leaves
    # them on the host, and warns).
    val_loss = _evaluate(model, val_batches, device)
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    summary, state_bytes, host_weight_bytes = None, 0, 0
    if manager is not None:
        summary = manager.get_compression_summary()
        state_bytes = round(summary["optimizer_state_host_mb"] * MIB)
        host_weight_bytes = round(summary["parameters_host_mb"] * MIB)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*did not fit on the device")
            manager.remove_hooks()
    unmeasured = [s for s in range(1, settings.steps + 1) if s not in measured]
    return RunResult(
        name=name,
        ratio=variant.ratio,
        losses=losses,
        step_seconds=seconds,
        timed_steps=unmeasured or measured,
        memory=memory,
        val_loss=val_loss,
        process_rss_mb=process_rss_mb(),
        peak_rss_mb=_peak_rss_bytes() / MIB,
        summary=summary,
        weights=weights,
        offloaded_state_bytes=state_bytes,
        offloaded_weight_bytes=host_weight_bytes,
    )


def run_device(settings: DemoSettings, cap_bytes: int | None) -> torch.device:
    """The device a run trains on, capped at ``cap_bytes`` (None: uncapped) before anything
    is placed on it: the emulated device, installed in this process (a run's own) with its
    allocator's capacity; CUDA with `hold_cuda_cap`; the CPU as it is (the tracker holds
    the cap in the steps it measures, and `place` at placement)."""
    if settings.emulated:
        from ..testing import emulated_device  # here: it is for the whole process

        return emulated_device(capacity_bytes=cap_bytes)
    if cap_bytes is not None and settings.device.type == "cuda":
        hold_cuda_cap(settings.device, cap_bytes)
    return settings.device


def place(model: TinyGPT, device: torch.device, cap_bytes: int | None) -> TinyGPT:
    """Plain PyTorch's ``model.to(device)``; under the cap, an allocator's (the emulated
    device's, CUDA's) refuses it with ``torch.OutOfMemoryError`` if the weights do not fit.
    On the CPU stand-in nothing is allocated (the model is already there): the cap is held
    by arithmetic, the weights' bytes against it, and the error says so."""
    if cap_bytes is not None and device.type == "cpu":
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        if weights > cap_bytes:
            raise torch.OutOfMemoryError(
                f"{weights:_} bytes of weights > the cap of {cap_bytes:_} bytes, by arithmetic "
                "on the CPU stand-in (no allocator holds a cap there)"
            )
    return model.to(device)


def hold_cuda_cap(device: torch.device, cap_bytes: int) -> None:
    """Cap what this process's CUDA allocator may reserve on ``device`` at ``cap_bytes``
    (its cached blocks returned first, so the cap counts what is in use)."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)


def _first_line(error: BaseException) -> str:
    """An error's message up to its first line's end (CUDA's runs on with advice)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@torch.no_grad()
def _evaluate(model: TinyGPT, batches: list[Batch], device: torch.device) -> float:
    """Mean cross-entropy over the fixed validation batches."""
    model.eval()
    losses = [model(x.to(device), y.to(device))[1].item() for x, y in batches]
    model.train()
    return statistics.fmean(losses)


def _peak_rss_bytes() -> int:
    """The most resident memory this process has had (the OS's own high-water mark)."""
    if sys.platform == "win32":  # no resource module: psutil has the peak working set
        return psutil.Process().memory_info().peak_wset
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _machine(settings: DemoSettings) -> dict[str, Any]:
    device = settings.device
    processor = platform.processor() or platform.machine()
    return {
        "device": "emu" if settings.emulated else str(device),
        "device_name": (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"emulated on the CPU ({processor})"
            if settings.emulated
            else processor
        ),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradient_cache": __version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_ram_mb": psutil.virtual_memory().total / MIB,
    }


class ProgressBar:
    """One run's progress on ``stream``: redrawn in place on a terminal; elsewhere (CI
    logs) a line at each quarter, so a log gets a handful of lines, not one per step."""

    WIDTH = 24
    REDRAW_SECONDS = 0.1

    def __init__(self, label: str, total: int, *, stream: TextIO) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self.interactive = stream.isatty()
        self._started = time.perf_counter()
        self._drawn_at = 0.0
        self._next_line = 1  # quarters reported so far + 1 (non-interactive)

    def update(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        if self.interactive:
            if step == self.total or now - self._drawn_at >= self.REDRAW_SECONDS:
                self._drawn_at = now
                self.stream.write("\r" + self._line(step, loss, now))
                self.stream.flush()
        elif step * 4 >= self._next_line * self.total:
            self._next_line = step * 4 // self.total + 1
            self.stream.write(self._line(step, loss, now) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self, step: int, loss: float, now: float) -> str:
        filled = self.WIDTH * step // self.total
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        return (
            f"{self.label:<14} [{bar}] {step:>{len(str(self.total))}}/{self.total} "
            f"{now - self._started:6.1f} s  loss {loss:.3f}"
        )
