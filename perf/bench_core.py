"""Core CPU benchmarks: top-k selection throughput and training-step overhead.

    python perf/bench_core.py            # full run (about a minute or two on 2 cores)
    python perf/bench_core.py --quick    # tiny sizes, a few seconds: a smoke test
    python perf/bench_core.py --json out.json

Prints markdown tables. Training variants are timed round robin (one step of each per
round, the order rotated every round) so that drift in the machine's speed hits every
variant alike; the median per variant is reported.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import gradient_cache
from gradient_cache import create_gradient_cache
from gradient_cache.codecs import TopKSelector, keep_count
from gradient_cache.demo.models import GPT_SIZES, GPTConfig, TinyGPT, make_batches

SEED = 0


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Sizes of one run; `--quick` swaps in tiny ones."""

    select_numel: int
    select_ratio: int
    select_repeats: int
    model: str
    batch_size: int
    warmup_rounds: int
    rounds: int


FULL = Settings(
    select_numel=16 * 2**20,
    select_ratio=100,
    select_repeats=5,
    model="small",
    batch_size=8,
    warmup_rounds=2,
    rounds=9,
)
QUICK = Settings(
    select_numel=2**20,
    select_ratio=100,
    select_repeats=3,
    model="tiny",
    batch_size=2,
    warmup_rounds=1,
    rounds=2,
)


@dataclass(frozen=True, kw_only=True)
class VariantSpec:
    """One way of training; ``ratio=None`` means plain PyTorch."""

    name: str
    ratio: float | None = None
    fused: bool = False
    options: dict[str, Any] = field(default_factory=dict)


VARIANTS = (
    VariantSpec(name="plain"),
    VariantSpec(name="cache r=1", ratio=1),
    VariantSpec(name="cache r=100", ratio=100),
    VariantSpec(name="cache r=100 fused", ratio=100, fused=True),
    VariantSpec(name="cache r=100 error feedback", ratio=100, options={"error_feedback": True}),
    VariantSpec(name="cache r=100 exact", ratio=100, options={"selection": "exact"}),
)


# --- environment ------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "gradient_cache": gradient_cache.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
    }


# --- timing helpers ---------------------------------------------------------------


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- a) selection throughput ------------------------------------------------------


def bench_selection(settings: Settings) -> dict[str, Any]:
    """GB/s of each way to pick the top 1/ratio of a random fp32 tensor, and a plain copy."""
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(settings.select_numel, generator=generator)
    k = keep_count(settings.select_numel, settings.select_ratio)  # as the engine computes it
    out = torch.empty_like(x)
    threshold = TopKSelector(method="threshold", seed=SEED)
    exact = TopKSelector(method="exact", seed=SEED)
    candidates: dict[str, Callable[[], object]] = {
        'TopKSelector("threshold")': lambda: threshold.select(x, k),
        'TopKSelector("exact")': lambda: exact.select(x, k),
        "torch.topk(x.abs(), k)": lambda: torch.topk(x.abs(), k, sorted=False),
        "copy (bandwidth ceiling)": lambda: out.copy_(x),
    }
    input_bytes = x.numel() * x.element_size()
    rows = []
    for name, fn in candidates.items():
        seconds = median_seconds(fn, repeats=settings.select_repeats)
        rows.append({"method": name, "ms": seconds * 1e3, "gb_per_s": input_bytes / seconds / 1e9})
    kept = threshold.select(x, k)
    by_name = {row["method"]: row for row in rows}
    return {
        "numel": x.numel(),
        "ratio": settings.select_ratio,
        "k": k,
        "rows": rows,
        "threshold_speedup_over_topk": by_name["torch.topk(x.abs(), k)"]["ms"]
        / by_name['TopKSelector("threshold")']["ms"],
        "threshold_kept_over_k": (kept.numel() if kept is not None else float("nan")) / k,
    }


# --- b) training step time --------------------------------------------------------

Step = Callable[[torch.Tensor, torch.Tensor], None]


def make_step(spec: VariantSpec, model: TinyGPT, keep_alive: list[object]) -> Step:
    """A closure doing one full training step of ``model`` the way ``spec`` says."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if spec.ratio is None:

        def plain_step(x: torch.Tensor, y: torch.Tensor) -> None:
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return plain_step

    manager = create_gradient_cache(model, compression_ratio=spec.ratio, **spec.options)
    keep_alive.append(manager)  # hooks stay attached for the script's life

    def cache_step(x: torch.Tensor, y: torch.Tensor) -> None:
        _, loss = model(x, y)
        loss.backward()
        if spec.fused:
            manager.step(optimizer)
        else:
            manager.compress_and_free_gradients()
            manager.apply_gradients()
            optimizer.step()
        optimizer.zero_grad()

    return cache_step


def bench_training(settings: Settings) -> dict[str, Any]:
    """Median step time per variant, measured round robin on identical model copies."""
    torch.manual_seed(SEED)
    config: GPTConfig = GPT_SIZES[settings.model]
    base = TinyGPT(config)
    keep_alive: list[object] = []
    steps = {spec.name: make_step(spec, copy.deepcopy(base), keep_alive) for spec in VARIANTS}
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(config.vocab_size, (64 * config.seq_len,), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(settings.warmup_rounds + settings.rounds):
        # Every variant sees the same batch in a round; the starting variant rotates.
        x, y = make_batches(
            tokens, batch_size=settings.batch_size, seq_len=config.seq_len, generator=generator
        )
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps[name](x, y)
            if round_index >= settings.warmup_rounds:
                times[name].append(time.perf_counter() - start)
    plain_ms = statistics.median(times["plain"]) * 1e3
    rows = []
    for name, samples in times.items():
        ms = statistics.median(samples) * 1e3
        rows.append(
            {
                "variant": name,
                "median_ms": ms,
                "min_ms": min(samples) * 1e3,
                "max_ms": max(samples) * 1e3,
                "ratio_to_plain": ms / plain_ms,
            }
        )
    return {
        "model": settings.model,
        "parameters": base.num_parameters(),
        "batch_size": settings.batch_size,
        "seq_len": config.seq_len,
        "rounds": settings.rounds,
        "warmup_rounds": settings.warmup_rounds,
        "rows": rows,
    }


# --- output -----------------------------------------------------------------------


def print_header(env: dict[str, Any]) -> None:
    print("# gradient-cache core benchmarks\n")
    print(
        f"- date: {env['date']}\n- torch {env['torch']}, gradient-cache "
        f"{env['gradient_cache']}, Python {env['python']}\n- CPU: {env['cpu']}, "
        f"torch threads: {env['threads']}\n"
    )


def print_selection(result: dict[str, Any]) -> None:
    print(
        f"## Selection: top 1/{result['ratio']} of {result['numel']:,} fp32 (k = {result['k']:,})\n"
    )
    print("| method | median ms | GB/s (fp32 input) |")
    print("|---|---:|---:|")
    for row in result["rows"]:
        print(f"| {row['method']} | {row['ms']:.2f} | {row['gb_per_s']:.2f} |")
    print(
        f"\nthreshold vs torch.topk: {result['threshold_speedup_over_topk']:.1f}x faster; "
        f"threshold kept / k = {result['threshold_kept_over_k']:.3f}\n"
    )


def print_training(result: dict[str, Any]) -> None:
    print(
        f"## Training step: TinyGPT {result['model']!r} ({result['parameters'] / 1e6:.2f}M "
        f"parameters), batch {result['batch_size']} x seq {result['seq_len']}, Adam; "
        f"median of {result['rounds']} interleaved rounds after {result['warmup_rounds']} "
        "warm-up\n"
    )
    # min and max show the run-to-run spread: ratios closer to 1 than it are noise.
    print("| variant | median step ms | min ms | max ms | median vs plain |")
    print("|---|---:|---:|---:|---:|")
    for row in result["rows"]:
        print(
            f"| {row['variant']} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | "
            f"{row['max_ms']:.1f} | {row['ratio_to_plain']:.2f}x |"
        )
    print()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    env = environment()
    print_header(env)
    selection = bench_selection(settings)
    print_selection(selection)
    training = bench_training(settings)
    print_training(training)
    if args.json is not None:
        report = {
            "environment": env,
            "settings": asdict(settings),
            "selection": selection,
            "training": training,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
