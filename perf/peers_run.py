"""One contender of `perf.peers`, in its own process: its rows for each scenario, and the
largest batch that fits the budget.

Per scenario: train ``steps`` steps from the seed, the last one measured (device bytes by
phase and component; host bytes), save or compare the final weights, search the largest
batch (S1), then time ``rounds`` more steps against a plain AdamW model in the same
process, interleaved. Memory is measured before the timing model exists, since on CUDA the
allocator counts the whole process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradient_cache.demo.accounting import (
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    CudaMemoryMeter,
    DeviceMemoryMeter,
    cache_tensors,
    device_memory_meter,
    optimizer_state_tensors,
    plain_tensors,
    storage_bytes,
)
from gradient_cache.demo.models import GPT_SIZES, TinyGPT, byte_corpus, make_batches
from gradient_cache.demo.training import PHASES, PhaseWatch
from perf.peers_contenders import (
    CONTENDERS,
    SCENARIOS,
    Batch,
    Contender,
    Scenario,
    Trainer,
    build,
)
from perf.peers_search import largest_batch

#: Contenders whose final weights others are compared with.
REFERENCES = {"plain", *(c.exact_reference for c in CONTENDERS.values() if c.exact_reference)}
#: The batch search's settings: activation checkpointing per block, or none.
CHECKPOINTING = {"checkpointing": True, "no checkpointing": False}


@dataclass(frozen=True, kw_only=True)
class PeerSettings:
    model_size: str
    steps: int
    rounds: int
    seed: int
    device: str
    threads: int
    search: bool
    max_batch: int
    reference_dir: str  # where exact references leave their final weights


def run_contender(
    key: str, settings: PeerSettings, budgets: dict[str, int] | None
) -> dict[str, Any]:
    """Every figure of contender ``key``. ``budgets`` (device bytes per checkpointing
    setting) come from plain's run; plain, run with None, measures them."""
    torch.set_num_threads(settings.threads)
    contender = CONTENDERS[key]
    device = torch.device(settings.device)
    result: dict[str, Any] = {"key": key, "label": contender.label, "scenarios": {}}
    for scenario in SCENARIOS.values():
        reason = contender.refusal(scenario, device)
        if reason is not None:
            result["scenarios"][scenario.name] = {"supported": False, "reason": reason}
            continue
        started = time.perf_counter()
        row, trainer = _train_and_measure(contender, scenario, settings, device)
        row["weights"] = _weights_check(contender, scenario, trainer.model, settings)
        row["train_seconds"] = time.perf_counter() - started
        if scenario.name == "S1" and settings.search:
            result["batch_search"] = _search(trainer, budgets, settings, device)
        started = time.perf_counter()
        row["step_time"] = _time_steps(trainer, scenario, settings, device)
        row["step_time"]["seconds"] = time.perf_counter() - started
        result["scenarios"][scenario.name] = row
        trainer.close()
        del trainer
        _release(device)
    if "batch_search" not in result and settings.search:
        result["batch_search"] = {
            "supported": False,
            "reason": result["scenarios"]["S1"].get("reason", "S1 did not run"),
        }
    return result


def new_model(settings: PeerSettings, device: torch.device, *, checkpointing: bool) -> TinyGPT:
    torch.manual_seed(settings.seed)
    config = GPT_SIZES[settings.model_size]
    return TinyGPT(config, activation_checkpointing=checkpointing).to(device)


class Batches:
    """The same stream of training batches in every process: windows of the demo's corpus."""

    def __init__(self, settings: PeerSettings, device: torch.device, *, offset: int = 0) -> None:
        self.tokens, _ = byte_corpus()
        self.seq_len = GPT_SIZES[settings.model_size].seq_len
        self.generator = torch.Generator().manual_seed(settings.seed + offset)
        self.device = device

    def step(self, scenario: Scenario, *, batch_size: int | None = None) -> list[Batch]:
        """One step's micro-batches."""
        x, y = make_batches(
            self.tokens,
            batch_size=batch_size or scenario.batch_size,
            seq_len=self.seq_len,
            generator=self.generator,
        )
        parts = zip(x.chunk(scenario.micro_batches), y.chunk(scenario.micro_batches), strict=True)
        return [(xs.to(self.device), ys.to(self.device)) for xs, ys in parts]


def _train_and_measure(
    contender: Contender, scenario: Scenario, settings: PeerSettings, device: torch.device
) -> tuple[dict[str, Any], Trainer]:
    trainer = build(contender, new_model(settings, device, checkpointing=True))
    batches = Batches(settings, device)
    losses, first_step = [], None
    for step in range(1, settings.steps + 1):
        micro_batches = batches.step(scenario)
        if step < settings.steps:
            started = time.perf_counter()
            losses.append(trainer.step(micro_batches, scenario))
            first_step = first_step or time.perf_counter() - started
        else:
            loss, memory = measure_step(trainer, micro_batches, scenario, device)
            losses.append(loss)
    row = {
        "supported": True,
        "losses": losses,
        "loss": losses[-1],
        "first_step_seconds": first_step,
        **memory,
    }
    return row, trainer


def measure_step(
    trainer: Trainer, micro_batches: list[Batch], scenario: Scenario, device: torch.device
) -> tuple[float, dict[str, Any]]:
    """One step under the device meter: each phase's peak (the largest over micro-batches)
    with its components, what is held when backward ends, and the host bytes then."""
    meter = _meter(trainer, device)
    watch = PhaseWatch(meter)
    at_end_of_backward: dict[str, Any] = {}

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        with watch(name):
            yield
        if name == "backward":  # the last micro-batch's is what the step starts from
            at_end_of_backward.clear()
            at_end_of_backward.update(_reading(meter, trainer))

    with meter, _opaque_step(trainer, meter):
        loss = trainer.step(micro_batches, scenario, phase=phase)
    peaks = {}
    for name in PHASES:
        memory = watch.memory(name)
        peaks[name] = {"total": memory.peak_bytes, **memory.peak_by_category}
    peak_phase = max(peaks, key=lambda name: peaks[name]["total"])
    return loss, {
        "phases": peaks,
        "end_of_backward": at_end_of_backward,
        "peak": peaks[peak_phase]["total"],
        "peak_phase": peak_phase,
        "host_bytes": at_end_of_backward.pop("host_bytes"),
    }


def _meter(trainer: Trainer, device: torch.device) -> DeviceMemoryMeter:
    """The meter of ``device``: chosen by the run's device, not the parameters', which
    FSDP2's CPU offload keeps on the host."""
    if device.type == "cuda":
        if trainer.cache is None:
            return CudaMemoryMeter(device=device)
        return CudaMemoryMeter(device=device, host=cache_tensors(trainer.cache)[0])
    return device_memory_meter(
        trainer.model, optimizer=trainer.meter_optimizers, cache=trainer.cache
    )


def _reading(meter: DeviceMemoryMeter, trainer: Trainer) -> dict[str, Any]:
    reading = meter.reading()
    figures: dict[str, Any] = {"total": reading.device_bytes, **reading.by_category}
    if not reading.by_category:  # CUDA: the allocator has no categories; count ours
        census = _census(trainer)
        figures.update(census, **{OTHER: reading.device_bytes - sum(census.values())})
    figures["host_bytes"] = trainer.host_bytes()
    return figures


def _census(trainer: Trainer) -> dict[str, int]:
    """Parameters, gradients and optimizer state on the device now, counted from the
    tensors themselves (CUDA, where the allocator only knows totals)."""

    def on_device(tensors: Any) -> list[torch.Tensor]:
        plain = (t for each in tensors if each is not None for t in plain_tensors(each))
        return [t for t in plain if t.device.type != "cpu"]

    params = list(trainer.model.parameters())
    return {
        PARAMETERS: storage_bytes(on_device(params)),
        GRADIENTS: storage_bytes(on_device(p.grad for p in params)),
        OPTIMIZER_STATE: storage_bytes(
            on_device(optimizer_state_tensors(trainer.meter_optimizers))
        ),
    }


@contextlib.contextmanager
def _opaque_step(trainer: Trainer, meter: DeviceMemoryMeter) -> Iterator[None]:
    """torchao's step is compiled, and torch.compile refuses to run under the CPU
    tracker: while measuring, each ``optimizer.step()`` (the fused step's too) runs as one
    opaque operator."""
    if not trainer.compiled_step:
        yield
        return
    optimizer = trainer.optimizer
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        with meter.opaque():
            return original(*args, **kwargs)

    optimizer.step = step
    try:
        yield
    finally:
        del optimizer.step  # the class's method again


def _weights_check(
    contender: Contender, scenario: Scenario, model: torch.nn.Module, settings: PeerSettings
) -> dict[str, Any]:
    """Save the weights where another contender compares against them; compare with
    plain's and, for an exact contender, with its reference's."""
    weights = _cpu_weights(model)
    folder = Path(settings.reference_dir)
    if contender.key in REFERENCES:
        torch.save(weights, folder / f"{contender.key}-{scenario.name}.pt")
    check: dict[str, Any] = {}
    for reference in dict.fromkeys(["plain", contender.exact_reference]):
        path = folder / f"{reference}-{scenario.name}.pt"
        if reference is None or reference == contender.key or not path.exists():
            continue
        expected = torch.load(path, weights_only=True)
        check[reference] = max((expected[k] - w).abs().max().item() for k, w in weights.items())
    return {"exact_reference": contender.exact_reference, "max_abs_diff": check}


def _cpu_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # FSDP2's DTensor
            value = value.full_tensor()
        weights[name] = value.detach().to("cpu", copy=True)
    return weights


def _search(
    trainer: Trainer,
    budgets: dict[str, int] | None,
    settings: PeerSettings,
    device: torch.device,
) -> dict[str, Any]:
    """The largest S1 batch within each setting's budget; plain (``budgets`` None) first
    measures its own peak at S1's batch, which is the budget."""
    scenario = dataclasses.replace(SCENARIOS["S1"], name="search")
    batches = Batches(settings, device, offset=1)
    found: dict[str, Any] = {}
    for name, checkpointing in CHECKPOINTING.items():
        trainer.model.activation_checkpointing = checkpointing

        @functools.cache
        def peak_of(batch: int) -> int:
            micro_batches = batches.step(scenario, batch_size=batch)
            return measure_step(trainer, micro_batches, scenario, device)[1]["peak"]

        started = time.perf_counter()
        budget = peak_of(scenario.batch_size) if budgets is None else budgets[name]
        search = largest_batch(peak_of, budget=budget, limit=settings.max_batch)
        found[name] = {
            "supported": True,
            "budget": budget,
            "largest": search.largest,
            "capped": search.capped,
            "probes": search.probes,
            "seconds": time.perf_counter() - started,
        }
    trainer.model.activation_checkpointing = True
    return found


def _time_steps(
    trainer: Trainer, scenario: Scenario, settings: PeerSettings, device: torch.device
) -> dict[str, float]:
    """Step time against plain AdamW, interleaved in this process on the same batches: the
    median (and range) over rounds of ``trainer``'s step time over plain's. Its memory is
    measured by now: on CUDA the plain model would count in it."""
    pacer = build(CONTENDERS["plain"], new_model(settings, device, checkpointing=True))
    batches = Batches(settings, device, offset=2)
    pacer.step(batches.step(scenario), scenario)  # its first step makes its state
    ratios, own, plain = [], [], []
    for round_index in range(settings.rounds):
        micro_batches = batches.step(scenario)
        order = [trainer, pacer] if round_index % 2 else [pacer, trainer]  # alternate
        seconds = {id(r): _timed(r, micro_batches, scenario, device) for r in order}
        own.append(seconds[id(trainer)])
        plain.append(seconds[id(pacer)])
        ratios.append(own[-1] / plain[-1])
    pacer.close()
    del pacer
    _release(device)
    return {
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ms": statistics.median(own) * 1e3,
        "plain_ms": statistics.median(plain) * 1e3,
        "rounds": settings.rounds,
    }


def _timed(
    trainer: Trainer, micro_batches: list[Batch], scenario: Scenario, device: torch.device
) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    trainer.step(micro_batches, scenario)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
