"""Device memory of a training step, plain PyTorch against the gradient cache.

    python perf/memory_report.py                 # TinyGPT "small", batch 8, 4 micro-batches
    python perf/memory_report.py --json perf/results/memory_cpu.json
    python perf/memory_report.py --device cuda   # the same figures from the CUDA allocator

For each variant, one step after a warm-up step: the device peak during the first
micro-batch's backward (with the cache's drain), the device bytes left resident between
micro-batches, the peak over the later micro-batches, and the peak of the optimizer step
(apply_gradients + step, or the fused step). On the CPU the figures come from
gradient_cache.demo.accounting.TensorMemoryTracker (method and limits: perf/README.md); on CUDA
from torch.cuda.max_memory_allocated. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from gradient_cache import create_gradient_cache
from gradient_cache.demo.accounting import GRADIENTS, MIB, device_memory_meter
from gradient_cache.demo.training import Batch, PhaseWatch, train_step
from perf.steps import batch_stream, gpt


@dataclass(frozen=True, kw_only=True)
class MemoryVariant:
    """``ratio=None`` is plain PyTorch; ``fused_step`` uses the cache's step(optimizer)."""

    name: str
    ratio: float | None = None
    fused_step: bool = False
    codec: str | None = None  # EngineConfig.codec; None: the ladder picks by ``ratio``


MEMORY_VARIANTS = (
    MemoryVariant(name="plain"),
    MemoryVariant(name="cache r=1, apply + step", ratio=1),
    MemoryVariant(name="cache r=1, fused step", ratio=1, fused_step=True),
    # Top-k with its error feedback: the residual is what the host store must also hold.
    MemoryVariant(name="cache r=100, apply + step", ratio=100, codec="topk"),
    MemoryVariant(name="cache r=100, fused step", ratio=100, fused_step=True, codec="topk"),
)


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    model: str = "small"
    batch_size: int = 8
    micro_batches: int = 4
    bucket_size_mb: float = 4.0  # the most the engine sizes a bucket from the model
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.micro_batches < 2:
            raise ValueError(
                f"micro_batches={self.micro_batches}: the report compares the first "
                "micro-batch with the later ones, so it needs at least 2."
            )


@dataclass(frozen=True, kw_only=True)
class MemoryFigures:
    """Bytes; the gradient breakdowns are None where the meter cannot tell (CUDA)."""

    variant: str
    dense_gradients: int
    largest_gradient: int
    bucket: int
    backward_peak: int
    gradients_at_backward_peak: int | None
    max_gradients_in_backward: int | None
    between_micro_batches: int
    accumulation_peak: int
    step_peak: int
    host_store: int
    process_rss: int
    backward_peak_by_category: dict[str, int]
    step_peak_by_category: dict[str, int]


def measure(variant: MemoryVariant, settings: MemorySettings) -> MemoryFigures:
    """One warm-up step, then one measured step of ``variant``."""
    model = gpt(settings.model).to(settings.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    cache = None
    if variant.ratio is not None:
        cache = create_gradient_cache(
            model,
            compression_ratio=variant.ratio,
            bucket_size_mb=settings.bucket_size_mb,
            codec=variant.codec,
        )
    next_batch = batch_stream(model, batch_size=settings.batch_size)

    def draw() -> list[Batch]:
        return [
            (x.to(settings.device), y.to(settings.device))
            for x, y in (next_batch() for _ in range(settings.micro_batches))
        ]

    # A warm-up step makes the optimizer state and the engine's scratch.
    train_step(model, optimizer, cache, draw(), fused=variant.fused_step)
    batches = draw()  # before the meter: each batch counts from its forward on
    meter = device_memory_meter(model, optimizer=optimizer, cache=cache)
    watch = PhaseWatch(meter)
    with meter:
        train_step(model, optimizer, cache, batches, fused=variant.fused_step, phase=watch)
    # The report's phases: the first micro-batch's backward (with the drain), the later
    # micro-batches (their forward and backward), the optimizer step.
    phases = watch.phases
    backwards = [r for r in phases if r.name == "backward"]
    backward = backwards[0].peak
    later = [r.peak.peak.device_bytes for r in phases[:-1] if r.micro_batch > 1]
    step_peak = phases[-1].peak  # the optimizer's
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return MemoryFigures(
        variant=variant.name,
        dense_gradients=sum(sizes),
        largest_gradient=max(sizes),
        bucket=int(settings.bucket_size_mb * MIB),
        backward_peak=backward.peak.device_bytes,
        gradients_at_backward_peak=backward.peak.by_category.get(GRADIENTS),
        max_gradients_in_backward=backward.max_by_category.get(GRADIENTS),
        # What each micro-batch but the last leaves resident for the next.
        between_micro_batches=max(r.end.device_bytes for r in backwards[:-1]),
        accumulation_peak=max(later),
        step_peak=step_peak.peak.device_bytes,
        host_store=backwards[-1].end.host_bytes,  # all of the step's gradients, stored
        process_rss=psutil.Process().memory_info().rss,
        backward_peak_by_category=backward.peak.by_category,
        step_peak_by_category=step_peak.peak.by_category,
    )


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def markdown(figures: list[MemoryFigures]) -> str:
    """The figures table, then each target against plain."""
    lines = [
        "| variant | backward peak | gradients at it | most gradients during backward "
        "| resident between micro-batches | peak over later micro-batches | step peak "
        "| host store |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in figures:
        cells = (
            f.backward_peak,
            f.gradients_at_backward_peak,
            f.max_gradients_in_backward,
            f.between_micro_batches,
            f.accumulation_peak,
            f.step_peak,
            f.host_store,
        )
        lines.append(f"| {f.variant} | " + " | ".join(map(_mib, cells)) + " |")
    plain = figures[0]
    dense = plain.dense_gradients
    bound = 2 * plain.bucket + plain.largest_gradient
    lines += [
        "",
        f"MiB. Dense gradients {_mib(dense)} MiB; largest gradient "
        f"{_mib(plain.largest_gradient)} MiB; bucket {_mib(plain.bucket)} MiB, so two buckets "
        f"plus the largest gradient is {_mib(bound)} MiB.",
        "",
        "| variant | most gradients during backward, % of dense | saving vs plain, % of "
        "dense: between micro-batches | later micro-batches | step |",
        "|---|---:|---:|---:|---:|",
    ]
    for f in figures[1:]:
        most = f.max_gradients_in_backward
        share = "n/a" if most is None else f"{100 * most / dense:.1f}%"
        savings = (
            plain.between_micro_batches - f.between_micro_batches,
            plain.accumulation_peak - f.accumulation_peak,
            plain.step_peak - f.step_peak,
        )
        lines.append(
            f"| {f.variant} | {share} | " + " | ".join(f"{100 * s / dense:.1f}%" for s in savings)
        )
        lines[-1] += " |"
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--bucket-size-mb", type=float, default=4.0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    settings = MemorySettings(
        model=args.model,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        bucket_size_mb=args.bucket_size_mb,
        device=args.device,
    )
    figures = [measure(variant, settings) for variant in MEMORY_VARIANTS]
    print(
        f"## Device memory: TinyGPT {settings.model!r}, batch {settings.batch_size}, "
        f"{settings.micro_batches} micro-batches, Adam, {settings.device}\n"
    )
    print(markdown(figures))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"settings": asdict(settings), "figures": [asdict(f) for f in figures]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
