"""Train a tiny GPT on bytes three ways: plain PyTorch, gradient cache at r=1 and at r=3 (int8).

    python examples/train_small.py [--steps 100] [--batch-size 8] [--fused]

The text is the source code of a few standard-library modules, read with
`inspect.getsource`, so nothing is downloaded. Every run starts from the same seed and
sees the same batches, so the lossless cache (r=1) must end with the same weights as
plain PyTorch; the script exits with status 1 if it does not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

# MKL's sgemm on some Intel CPUs picks its code path by the operands' memory alignment, so
# plain and cached runs (whose tensors sit at other addresses) differed by 5.5e-4 after 5
# AdamW steps in one run of six; its strict reproducibility mode removes that (0 in 12).
# MKL reads it at its first call, so it must be set before any matrix product.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch

from gradient_cache import GradientCacheHookManager, create_gradient_cache
from gradient_cache.demo.models import GPT_SIZES, TinyGPT, byte_corpus, make_batches

VAL_BATCHES = 8
# r=1 moves the very same gradient tensors, so the weights should match bit for bit.
R1_TOLERANCE = 1e-6


@dataclass
class RunResult:
    name: str
    model: TinyGPT
    train_loss: float
    val_loss: float
    step_ms: float
    summary: dict[str, Any] | None


@torch.no_grad()
def evaluate(model: TinyGPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy over fixed held-out batches (no_grad: no gradient hooks fire)."""
    model.eval()
    losses = [model(x, y)[1].item() for x, y in batches]
    model.train()
    return statistics.fmean(losses)


def update(
    manager: GradientCacheHookManager | None, optimizer: torch.optim.Optimizer, *, fused: bool
) -> None:
    """The optimizer half of a step, with or without the cache."""
    if manager is None:
        optimizer.step()
    elif fused:
        manager.step(optimizer)  # restore and step bucket by bucket
    else:
        manager.compress_and_free_gradients()
        manager.apply_gradients()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train(
    name: str,
    *,
    ratio: float | None,
    train_tokens: torch.Tensor,
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
) -> RunResult:
    """One training run from ``args.seed``; ``ratio=None`` trains without the cache."""
    config = GPT_SIZES["tiny"]
    torch.manual_seed(args.seed)
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    manager = None if ratio is None else create_gradient_cache(model, compression_ratio=ratio)
    generator = torch.Generator().manual_seed(args.seed)  # same batches in every run
    losses, times = [], []
    for _ in range(args.steps):
        x, y = make_batches(
            train_tokens, batch_size=args.batch_size, seq_len=config.seq_len, generator=generator
        )
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        update(manager, optimizer, fused=args.fused)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    summary = None
    if manager is not None:
        summary = manager.get_compression_summary()
        manager.remove_hooks()
    return RunResult(
        name=name,
        model=model,
        train_loss=statistics.fmean(losses[-10:]),
        val_loss=evaluate(model, val_batches),
        step_ms=statistics.median(times) * 1e3,
        summary=summary,
    )


def max_weight_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


def print_results(results: list[RunResult]) -> None:
    print(
        "| run | train loss (last 10) | val loss | median step ms "
        "| overall compression | memory saved MiB | kept fraction |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r.summary is None:
            cache_columns = "- | - | -"
        else:
            s = r.summary
            cache_columns = (
                f"{s['overall_compression_ratio']:.1f}x | {s['memory_saved_mb']:.2f} | "
                f"{s['kept_fraction']:.4f}"
            )
        print(
            f"| {r.name} | {r.train_loss:.4f} | {r.val_loss:.4f} | {r.step_ms:.1f} | "
            f"{cache_columns} |"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fused", action="store_true", help="cache runs use manager.step(optimizer)"
    )
    args = parser.parse_args()
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    train_tokens, val_tokens = byte_corpus()
    val_generator = torch.Generator().manual_seed(args.seed + 1)
    seq_len = GPT_SIZES["tiny"].seq_len
    val_batches = [
        make_batches(val_tokens, batch_size=16, seq_len=seq_len, generator=val_generator)
        for _ in range(VAL_BATCHES)
    ]
    print(
        f"corpus: {train_tokens.numel():,} train / {val_tokens.numel():,} val bytes; "
        f"{args.steps} steps of batch {args.batch_size} x seq {seq_len}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )
    # r=3: the library's default, int8 (top-k at r=100 trains poorly under AdamW).
    runs = (("plain", None), ("cache r=1", 1), ("cache r=3", 3))
    results = [
        train(name, ratio=ratio, train_tokens=train_tokens, val_batches=val_batches, args=args)
        for name, ratio in runs
    ]
    print(f"TinyGPT 'tiny': {results[0].model.num_parameters():,} parameters\n")
    print_results(results)
    difference = max_weight_difference(results[0].model, results[1].model)
    print(f"\nmax |weight(plain) - weight(cache r=1)| = {difference:.3g}")
    if difference > R1_TOLERANCE:
        print(f"FAIL: the lossless cache should match plain PyTorch within {R1_TOLERANCE}.")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
