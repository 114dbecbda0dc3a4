"""A model four times larger than its device cap, trained with the weights on the host.

    python -m perf.larger_than_device --device cuda --json perf/results/gpu/larger.json
    python -m perf.larger_than_device --device cpu --size tiny   # the CPU stand-in

On CUDA: plain PyTorch (fp32 AdamW, activation checkpointing) trains a few steps uncapped,
and its allocator peak sets the cap, a quarter of it
(``torch.cuda.set_per_process_memory_fraction``). Plain under the cap runs out of memory
(caught and reported); the cache (lossless, ``offload_optimizer_state=True``,
``offload_parameters=True``) trains under it, and its weights are compared with the
uncapped plain run's, bit for bit. The step time is set against the planner's floor for
the same model (`planner.plan`'s weights column: the busier direction of the link at
``--link-gbps``) and the compute's (6 x parameters x tokens at ``--tflops``).

On a CPU there is no allocator to cap: the same runs, the cap reported as not enforced,
and the step time against the same floor (copies within RAM: not a link's figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import gradient_cache
from gradient_cache.demo.models import GPTConfig, TinyGPT
from gradient_cache.planner import PlanInputs, plan, trainable_sizes, weight_layout

SIZES = {
    # About 109M parameters: 1.7 GiB of weights, gradients and AdamW state in fp32.
    "gpu": GPTConfig(vocab_size=8192, seq_len=256, d_model=1024, n_layers=8, n_heads=16),
    "tiny": GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2),
}
CAP_SHARE = 0.25  # of plain's uncapped peak


@dataclass
class Run:
    step_seconds: list[float]
    peak_bytes: int | None
    weights: list[torch.Tensor] | None  # None: ran out of memory
    error: str = ""


def make(config: GPTConfig, device: torch.device) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(config, activation_checkpointing=True).to(device)


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


def train(config: GPTConfig, data: list[Any], device: torch.device, *, cached: bool) -> Run:
    """``data``'s steps, plain or with the weights on the host; out of memory is reported."""
    times: list[float] = []
    try:
        model = make(config, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        manager = None
        if cached:
            manager = gradient_cache.create_gradient_cache(
                model, compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
            )
        for tokens, targets in data:
            start = time.perf_counter()
            model(tokens, targets)[1].backward()
            if manager is None:
                optimizer.step()
            else:
                manager.step(optimizer)
            optimizer.zero_grad()
            _synchronize(device)
            times.append(time.perf_counter() - start)
        weights = [p.detach().to("cpu", copy=True) for p in model.parameters()]
        return Run(times, _peak(device), weights)
    except torch.OutOfMemoryError as error:
        return Run(times, _peak(device), None, f"out of memory: {str(error).splitlines()[0]}")


def floors(model: TinyGPT, tokens: int, *, link_gbps: float, tflops: float) -> dict[str, float]:
    """The planner's link floor of one step (the weights, state and gradients' copies,
    the busier direction) and the compute's."""
    inputs = PlanInputs(
        tensors=trainable_sizes(model), weights=weight_layout(model), link_gbps=link_gbps
    )
    weights = plan(inputs).weights
    assert weights is not None  # given a layout, the plan has the weights column
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "link_floor_s": weights.link_seconds,
        "compute_floor_s": 6 * parameters * tokens / (tflops * 1e12),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--link-gbps", type=float, default=50.0)
    parser.add_argument("--tflops", type=float, default=0.4 * 989)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device, config = torch.device(args.device), SIZES[args.size]
    data = batches(config, args.batch, args.steps, device)
    plain = train(config, data, device, cached=False)
    cap = None
    if device.type == "cuda" and plain.peak_bytes:
        cap = int(plain.peak_bytes * CAP_SHARE)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        torch.cuda.empty_cache()
    capped = train(config, data, device, cached=False) if cap else None
    _reset_peak(device)
    cached = train(config, data, device, cached=True)
    report = {
        "device": str(device),
        "parameters": sum(p.numel() for p in make(config, torch.device("meta")).parameters()),
        "plain_peak_bytes": plain.peak_bytes,
        "cap_bytes": cap,
        "plain_under_cap": "not enforced on a CPU" if cap is None else capped.error or "fit",
        "cache_peak_bytes": cached.peak_bytes,
        "cache_error": cached.error,
        "bit_for_bit": cached.weights is not None
        and all(
            torch.equal(a, b) for a, b in zip(plain.weights or [], cached.weights, strict=True)
        ),
        "plain_step_s": _median(plain.step_seconds),
        "cache_step_s": _median(cached.step_seconds),
        **floors(
            make(config, torch.device("meta")),
            args.batch * config.seq_len,
            link_gbps=args.link_gbps,
            tflops=args.tflops,
        ),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return report


def _median(seconds: list[float]) -> float | None:
    return statistics.median(seconds[1:] or seconds) if seconds else None  # the first warms up


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


if __name__ == "__main__":
    main()
