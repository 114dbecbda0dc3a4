"""A model twice as large as its device cap, trained with the weights on the host.

    python -m perf.larger_than_device --device cuda --json perf/results/gpu/larger.json
    python -m perf.larger_than_device --device emu --size tiny   # the emulated device
    python -m perf.larger_than_device --device cpu --size tiny   # the CPU stand-in

Every run builds the model on the host. Plain PyTorch (fp32 AdamW, activation
checkpointing) is placed on the device (``model.to(device)``) and trains a few steps
uncapped: the reference bits and step time. Then the device is capped at half the
model's fp32 weights (`CAP_SHARE`): on CUDA with ``torch.cuda.set_per_process_memory_fraction``,
on the emulated device (``--device emu``, `gradient_cache.testing.emulated_device`, installed
in this process) with its allocator's capacity. Plain under the cap is refused at placement
(``model.to(device)`` raises ``torch.OutOfMemoryError``: caught and reported as such). The
cache (lossless, ``offload_optimizer_state=True``, ``offload_parameters=True``) is set up
from the host (``device=``: the masters stay there, a window of the weights goes over) and
trains under the cap; its weights are compared with plain uncapped's, bit for bit.

Each run reports the allocator's figures (``torch.accelerator``): the device's peak (for
the cache, from right after its creation to the end), its reserved peak, its retries and
out-of-memory errors, with the cache's own `summary()` fields (the weights' masters and
state on the host, the weights moved a step) beside the planner's window (the rest and two
blocks in forward and backward, two buckets at the step). The step time is set against the
planner's floor (`planner.plan`'s weights column: the busier direction of the link at
``--link-gbps``) and the compute's (6 x parameters x tokens at ``--tflops``). ``--json``
is rewritten as each run ends, so a run cut off by a timeout leaves the figures before it.

On a CPU there is no allocator to cap: the same runs but plain under the cap, the cap
reported as not enforced, no allocator figures, and the step time against the same floor
(copies within RAM: not a link's figure).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import gradient_cache
from gradient_cache.demo.models import GPTConfig, TinyGPT
from gradient_cache.engine.config import AUTO_BUCKET_MAX_MB, EngineConfig
from gradient_cache.engine.units import MIB
from gradient_cache.planner import PlanInputs, plan, trainable_sizes, weight_layout

# Deep and narrow-headed: a block is a small share of the weights, so the device's window
# (the rest and two blocks, a block's gradients, a pass's activations) fits under half.
SIZES = {
    # About 310M parameters: 1.2 GiB of fp32 weights (a cap of 0.6 GiB, over the CUDA
    # allocator's own overheads), 4.6 GiB with gradients and AdamW state.
    "gpu": GPTConfig(vocab_size=8192, seq_len=256, d_model=1024, n_layers=24, n_heads=16),
    # About 19M parameters (76 MB of weights): the emulated device's larger run.
    "small": GPTConfig(vocab_size=256, seq_len=128, d_model=256, n_layers=24, n_heads=4),
    # About 1.2M parameters (4.7 MB): tests/emulated/test_larger_than_device.py's model.
    "tiny": GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=24, n_heads=2),
}
CAP_SHARE = 0.5  # of the model's fp32 weights
# The cache's buckets: the step holds two, each its weights, gradients and AdamW's two
# moments (8 buckets' bytes): a bucket at most 1/32 of the cap keeps them to a quarter.
BUCKET_SHARE = 1 / 32
EMULATED = ("emu", "emulated")
PLAIN, PLAIN_UNDER_CAP, CACHE = "plain", "plain_under_cap", "cache"


@dataclass
class Run:
    step_seconds: list[float] = field(default_factory=list)
    memory: dict[str, int | None] = field(default_factory=dict)  # the allocator's figures
    weights: list[torch.Tensor] | None = None  # None: out of memory
    error: str = ""
    summary: dict[str, Any] = field(default_factory=dict)  # the cache's own figures


def make(config: GPTConfig) -> TinyGPT:
    """The model, on the host."""
    torch.manual_seed(0)
    return TinyGPT(config, activation_checkpointing=True)


def batches(config: GPTConfig, batch: int, steps: int, device: torch.device) -> list[Any]:
    generator = torch.Generator().manual_seed(1)
    shape = (batch, config.seq_len)
    return [
        (
            torch.randint(config.vocab_size, shape, generator=generator).to(device),
            torch.randint(config.vocab_size, shape, generator=generator).to(device),
        )
        for _ in range(steps)
    ]


def weight_bytes(config: GPTConfig) -> int:
    """The model's fp32 weights' bytes (shapes only)."""
    with torch.device("meta"):
        return sum(p.numel() * p.element_size() for p in TinyGPT(config).parameters())


def bucket_mb(cap_bytes: int) -> float:
    """The cache's bucket size: `BUCKET_SHARE` of the cap, at most the library's largest."""
    return min(AUTO_BUCKET_MAX_MB, cap_bytes * BUCKET_SHARE / MIB)


def train(
    config: GPTConfig, data: list[Any], device: torch.device, *, bucket: float | None = None
) -> Run:
    """``data``'s steps from a model built on the host: plain (``bucket`` None: placed with
    ``model.to(device)``) or the cache with ``bucket_size_mb=bucket``, set up from the host
    (``device=``). Out of memory is reported, at placement or at a step."""
    run = Run()
    _reset_accumulated(device)
    _reset_peak(device)
    model, where, manager = make(config), "placement", None
    try:
        if bucket is None:
            model.to(device)
        else:
            where = "set-up"
            before = _allocated(device)
            manager = gradient_cache.create_gradient_cache(
                model,
                compression_ratio=1,
                offload_optimizer_state=True,
                offload_parameters=True,
                bucket_size_mb=bucket,
                device=device,
            )
            after = _allocated(device)
            run.memory["setup_bytes"] = None if after is None else after - (before or 0)
            _reset_peak(device)  # the peak from here: the cache's training, not its set-up
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step, (tokens, targets) in enumerate(data, 1):
            where = f"step {step}"
            start = time.perf_counter()
            model(tokens, targets)[1].backward()
            if manager is None:
                optimizer.step()
            else:
                manager.step(optimizer)
            optimizer.zero_grad()
            _synchronize(device)
            run.step_seconds.append(time.perf_counter() - start)
        run.weights = [p.detach().to("cpu", copy=True) for p in model.parameters()]
        if manager is not None:
            summary = manager.summary()
            run.summary = {
                "parameters_host_mb": summary.parameters_host_mb,
                "parameters_moved_mb": summary.parameters_moved_mb,
                "optimizer_state_host_mb": summary.optimizer_state_host_mb,
                "optimizer_state_moved_mb": summary.optimizer_state_moved_mb,
                "num_offloaded_parameters": summary.num_offloaded_parameters,
            }
    except torch.OutOfMemoryError as error:
        run.error = f"{where}: out of memory: {_first_line(error)}"
    run.memory.update(_allocator(device))
    if manager is not None:  # closed here, not at exit: the figures are read
        with warnings.catch_warnings():  # under the cap the weights and state stay home
            warnings.filterwarnings("ignore", message=".*did not fit on the device")
            manager.remove_hooks()
    del model, manager
    gc.collect()  # what the run held on the device, freed before the next
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


def floors(
    model: TinyGPT, tokens: int, *, link_gbps: float, tflops: float, bucket: float
) -> dict[str, float | int]:
    """The planner's window (the device's weights in forward and backward, and at the
    step), its link floor of one step (the weights, state and gradients' copies, the
    busier direction) and the compute's."""
    inputs = PlanInputs(
        tensors=trainable_sizes(model),
        weights=weight_layout(model),
        link_gbps=link_gbps,
        config=EngineConfig(bucket_size_mb=bucket),
    )
    weights = plan(inputs).weights
    assert weights is not None  # given a layout, the plan has the weights column
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "planned_window_bytes": weights.window_bytes,
        "planned_step_bytes": weights.step_bytes,
        "link_floor_s": weights.link_seconds,
        "compute_floor_s": 6 * parameters * tokens / (tflops * 1e12),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda, emu (or emulated: the emulated device, gradient_cache.testing) or cpu",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--link-gbps", type=float, default=50.0)
    parser.add_argument("--tflops", type=float, default=0.4 * 989)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's CPU threads while it runs (default: 1 off CUDA, where the cache's copy "
        "threads share the cores with torch's: with 2 on 2 cores the cache's step took 20 "
        "times longer; CUDA: as they are)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        if args.threads is not None or args.device.split(":")[0] != "cuda":
            torch.set_num_threads(args.threads or 1)
        return _main(args)
    finally:
        torch.set_num_threads(threads)  # as it was, for a caller in the same process


def _main(args: argparse.Namespace) -> dict[str, Any]:
    config = SIZES[args.size]
    emulated = args.device in EMULATED
    if emulated:
        from gradient_cache.testing import emulated_device  # for the whole process

        device = emulated_device(capacity_bytes=None)  # uncapped for plain's reference
    else:
        device = torch.device(args.device)
    weights = weight_bytes(config)
    cap = int(weights * CAP_SHARE)
    bucket = bucket_mb(cap)
    meta = make_meta(config)
    report: dict[str, Any] = {
        "device": "emu (emulated on the CPU)" if emulated else str(device),
        "size": args.size,
        "parameters": sum(p.numel() for p in meta.parameters()),
        "weight_bytes": weights,
        "cap_bytes": cap,
        "cap_enforced": device.type != "cpu",
        "bucket_size_mb": bucket,
        "torch_threads": torch.get_num_threads(),
        **floors(
            meta,
            args.batch * config.seq_len,
            link_gbps=args.link_gbps,
            tflops=args.tflops,
            bucket=bucket,
        ),
        "runs_finished": [],
    }
    write(args.json, report)
    data = batches(config, args.batch, args.steps, device)

    plain = train(config, data, device)
    finished(report, PLAIN, plain, args.json)
    if device.type == "cpu":
        report[PLAIN_UNDER_CAP] = "not enforced on a CPU"
    else:
        if emulated:
            emulated_device(capacity_bytes=cap)
        else:
            _hold_cuda_cap(device, cap)
        capped = train(config, data, device)
        report[PLAIN_UNDER_CAP] = capped.error or "fit"
        finished(report, PLAIN_UNDER_CAP, capped, args.json)
    cached = train(config, data, device, bucket=bucket)
    finished(report, CACHE, cached, args.json)
    report["bit_for_bit"] = (
        cached.weights is not None
        and plain.weights is not None
        and all(torch.equal(a, b) for a, b in zip(plain.weights, cached.weights, strict=True))
    )
    report["step_time_ratio"] = _ratio(report["cache_step_s"], report["plain_step_s"])
    if device.type == "cpu":
        report["note"] = "no allocator caps a CPU: the cap is not enforced, no allocator figures"
    print(json.dumps(report, indent=1))
    write(args.json, report)
    return report


def make_meta(config: GPTConfig) -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(config)


def finished(report: dict[str, Any], name: str, run: Run, path: Path | None) -> None:
    """``run``'s figures into ``report`` (``name``-prefixed), and the file rewritten."""
    if name != PLAIN_UNDER_CAP:
        report[f"{name}_error"] = run.error
        report[f"{name}_step_s"] = _median(run.step_seconds)
    for key, value in run.memory.items():
        report[f"{name}_{key}"] = value
    if run.summary:
        report[f"{name}_summary"] = run.summary
    report["runs_finished"].append(name)
    print(f"{name}: {run.error or 'done'}", flush=True)
    write(path, report)


def write(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def _hold_cuda_cap(device: torch.device, cap_bytes: int) -> None:
    """Cap what this process's CUDA allocator may reserve on ``device`` at ``cap_bytes``
    (its cached blocks returned first, so the cap counts what is in use)."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)


def _median(seconds: list[float]) -> float | None:
    return statistics.median(seconds[1:] or seconds) if seconds else None  # the first warms up


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _first_line(error: BaseException) -> str:
    """An error's message up to its first line's end (CUDA's runs on with advice)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _allocated(device: torch.device) -> int | None:
    return None if device.type == "cpu" else torch.accelerator.memory_allocated(device)


def _allocator(device: torch.device) -> dict[str, int | None]:
    """The allocator's peaks since the last reset, and its retries and out-of-memory
    errors since the run began (None on the CPU, where no allocator is asked)."""
    if device.type == "cpu":
        return {"peak_bytes": None, "reserved_peak_bytes": None, "alloc_retries": None}
    stats = torch.accelerator.memory_stats(device)
    return {
        "peak_bytes": torch.accelerator.max_memory_allocated(device),
        "reserved_peak_bytes": torch.accelerator.max_memory_reserved(device),
        "alloc_retries": stats.get("num_alloc_retries"),
        "ooms": stats.get("num_ooms"),
    }


def _reset_peak(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)


def _reset_accumulated(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_accumulated_memory_stats(device)


if __name__ == "__main__":
    main()
