"""Each rank's device-resident gradient bytes under FSDP2, plain against the cache.

    python perf/fsdp_memory.py                    # TinyGPT "small", 2 CPU processes (gloo)
    python perf/fsdp_memory.py --model tiny --json perf/results/fsdp_memory.json

The model is ``fully_shard``-ed block by block (the embeddings, final norm and head in the
root group). For each variant, one measured step after a warm-up step, on each rank:

* backward peak: the most sharded-gradient bytes resident at once during backward,
  sampled after every post-accumulate-grad hook (so after the cache took the gradient):
  the distinct storages behind ``param.grad`` (FSDP2's reduce-scatter buffers, whole)
  plus the gradients waiting in the cache's open bucket;
* step peak: the most gradient bytes set on parameters as the optimizer's update starts,
  sampled in the optimizer's own ``step`` (a subclass's: the fused step runs it once per
  bucket, where its step hooks fire once for the whole step, before the first bucket);
* host held: the cache's ``host_held_mb`` (stored gradients and residuals).

On a GPU the cache adds, during backward, up to ``staging_depth`` launched buckets whose
device-to-host copies are in flight (bounded by ``staging_depth x (bucket_size_mb +
largest gradient)``); on the CPU backend encoding is inline and the payloads are host
memory, so those buckets do not appear here. Unsharded gradients, which FSDP2 frees right
after each reduce-scatter, are the same with and without the cache and are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from gradient_cache import create_gradient_cache
from gradient_cache.demo.models import GPT_SIZES, TinyGPT, make_batches
from gradient_cache.demo.training import train_step
from gradient_cache.engine.units import MIB

VARIANTS = (
    ("plain FSDP2", None, False),
    ("cache r=1, apply + step", 1, False),
    ("cache r=1, fused step", 1, True),
    ("cache r=100, fused step", 100, True),
)


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view keeps its whole buffer)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gradients(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad.to_local() for p in params if p.grad is not None]


def measure(model_size: str, ratio: float | None, fused: bool, batch_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(GPT_SIZES[model_size])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    # The sharded parameters (FSDP2 swaps in unsharded ones between forward and backward).
    sharded = list(model.parameters())
    peaks = {"backward": 0, "step": 0}
    measuring = False

    class SampledAdamW(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            if measuring:
                peaks["step"] = max(peaks["step"], _resident_bytes(_gradients(sharded)))
            return super().step(closure)

    optimizer = SampledAdamW(model.parameters(), lr=1e-3)
    cache = None if ratio is None else create_gradient_cache(model, compression_ratio=ratio)

    def waiting() -> list[torch.Tensor]:
        # The gradients in the cache's open bucket: still device tensors on a GPU.
        return [] if cache is None else list(cache.cache_tensors().waiting)

    def after_hook(param: torch.nn.Parameter) -> None:
        if measuring:
            resident = _resident_bytes(_gradients(sharded) + waiting())
            peaks["backward"] = max(peaks["backward"], resident)

    # Registered after the cache's hooks, so they run after it took each gradient.
    handles = [p.register_post_accumulate_grad_hook(after_hook) for p in sharded]
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(GPT_SIZES[model_size].vocab_size, (10_000,), generator=generator)
    for step in range(2):  # a warm-up step (optimizer state), then the measured one
        measuring = step == 1
        x, y = make_batches(
            tokens,
            batch_size=batch_size,
            seq_len=GPT_SIZES[model_size].seq_len,
            generator=generator,
        )
        train_step(model, optimizer, cache, [(x, y)], fused=fused)
    for handle in handles:
        handle.remove()
    dense = sum(p.to_local().numel() * p.element_size() for p in sharded)
    host = 0.0
    if cache is not None:
        host = cache.get_compression_summary()["host_held_mb"]
        cache.remove_hooks()
    return {
        "gradient_mib": dense / MIB,
        "backward_peak_mib": peaks["backward"] / MIB,
        "step_peak_mib": peaks["step"] / MIB,
        "host_held_mib": host,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for name, ratio, fused in VARIANTS:
        rows.append({"variant": name, "rank": rank} | measure(args.model, ratio, fused, args.batch))
    torch.save(rows, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(GPT_SIZES), default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(args.world, port, args, out), nprocs=args.world)
        rows = [row for r in range(args.world) for row in torch.load(Path(out) / f"rank{r}.pt")]
    rows.sort(key=lambda row: (row["rank"], [v[0] for v in VARIANTS].index(row["variant"])))
    print(f"TinyGPT {args.model}, {args.world} ranks (gloo, CPU), batch {args.batch}")
    print(
        "| variant | rank | sharded gradients MiB | backward peak MiB | step peak MiB "
        "| host held MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['rank']} | {row['gradient_mib']:.2f} | "
            f"{row['backward_peak_mib']:.2f} | {row['step_peak_mib']:.2f} | "
            f"{row['host_held_mib']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
