"""Train a tiny GPT sharded with FSDP2 on several processes: plain, and with the cache.

    torchrun --nproc-per-node 2 examples/train_fsdp.py [--steps 20] [--ratio 3]

On GPUs each process takes the GPU of its local rank and nccl; without GPUs the processes
run on the CPU with gloo. The model is `fully_shard`-ed block by block; each rank caches
its own shards of the gradients and steps them with the cache's fused step (clipping
included, the norm reduced across ranks). Three runs from the same seed on the same data:
plain FSDP2, the cache at ratio 1 (must end with plain's weights: exit status 1 if not)
and at ``--ratio``. Rank 0 prints one row per run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from gradient_cache import create_gradient_cache
from gradient_cache.demo.models import GPT_SIZES, TinyGPT, byte_corpus, make_batches

MAX_GRAD_NORM = 1.0


def setup() -> torch.device:
    """Join the process group torchrun describes; the device this rank trains on."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def sharded_model(seed: int, device: torch.device) -> TinyGPT:
    torch.manual_seed(seed)
    model = TinyGPT(GPT_SIZES["tiny"]).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the embeddings, the final norm and the head
    return model


def train(ratio: float | None, tokens: torch.Tensor, device: torch.device, args) -> dict:
    """One run; ``ratio=None`` is plain FSDP2 with clip_grad_norm_."""
    model = sharded_model(args.seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    cache = None if ratio is None else create_gradient_cache(model, compression_ratio=ratio)
    # Each rank its own batches, the same in every run.
    generator = torch.Generator().manual_seed(args.seed + dist.get_rank())
    losses, times = [], []
    for _ in range(args.steps):
        x, y = make_batches(
            tokens, batch_size=args.batch_size, seq_len=model.config.seq_len, generator=generator
        )
        start = time.perf_counter()
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        if cache is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
        else:
            cache.step(optimizer, max_grad_norm=MAX_GRAD_NORM)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    summary = None
    if cache is not None:
        summary = cache.get_compression_summary()
        cache.remove_hooks()
    return {
        "weights": [p.full_tensor() for p in model.parameters()],
        "loss": statistics.fmean(losses[-5:]),
        "step_ms": statistics.median(times) * 1e3,
        "summary": summary,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ratio", type=float, default=3)  # the default codec, int8
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = setup()
    tokens, _ = byte_corpus()
    runs = {
        "plain FSDP2": train(None, tokens, device, args),
        "cache r=1": train(1, tokens, device, args),
        f"cache r={args.ratio:g}": train(args.ratio, tokens, device, args),
    }
    plain = runs["plain FSDP2"]["weights"]
    gap = max(
        (a - b).abs().max().item() for a, b in zip(plain, runs["cache r=1"]["weights"], strict=True)
    )
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"{world} processes on {device.type}, {args.steps} steps, fused step, clip 1.0")
        print("| run | loss (last 5) | median step ms | rank 0's gradients offloaded MiB |")
        print("|---|---:|---:|---:|")
        for name, run in runs.items():
            saved = "-" if run["summary"] is None else f"{run['summary']['memory_saved_mb']:.2f}"
            print(f"| {name} | {run['loss']:.4f} | {run['step_ms']:.1f} | {saved} |")
        print(f"cache r=1 against plain FSDP2: max weight difference {gap:.3g}")
    dist.destroy_process_group()
    return 0 if gap == 0.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
