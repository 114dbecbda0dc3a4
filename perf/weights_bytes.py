"""Bytes per parameter of the weights on the host: over the link by phase, and in host RAM.

    python -m perf.weights_bytes [--model small] [--vocab-size N]

For TinyGPT ``--model`` with ``offload_parameters=True`` and the optimizer state on the host
(AdamW, lossless gradients), one micro-batch a step, with fp32 compute and with
``compute_dtype=torch.bfloat16``, counts what the cache itself reports: the weights' bytes
moved in forward, in backward and in the step (`HostWeights.moved_bytes` between phases,
the step's from `summary().parameters_moved_mb`), and the host bytes of the weights'
slabs (masters, and wires with bf16), the optimizer state's and the gradient store's (what
the last step stored: its payloads' bytes; on CUDA the pinned pool keeps a slot sized for
an fp32 gradient whatever a payload takes of it, `summary().host_pool`), each divided by
the parameter count. The gradients' link bytes are
what backward stored (out, device to host) and the step's restore brought back (in): one
micro-batch's, in bf16 as it came with a bf16 compute dtype. Padding (each weight at an
aligned place in its unit) is counted where it crosses. ``--vocab-size`` replaces the
model's (a larger share of the weights outside the blocks, which stay on the device through
a pass: brought once a forward, not again in backward). The last line: the weights' bytes a
step moves with bf16 compute over those with fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime

import torch

import gradient_cache
from gradient_cache.demo.models import GPT_SIZES, TinyGPT
from perf.harness import cpu_model

MIB = 2**20


def measure(
    model_name: str, compute_dtype: torch.dtype | None, vocab_size: int | None = None
) -> dict[str, float]:
    torch.manual_seed(0)
    config = GPT_SIZES[model_name]
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    model = TinyGPT(config)
    count = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=1,
        offload_optimizer_state=True,
        offload_parameters=True,
        compute_dtype=compute_dtype,
    )
    assert manager.engine is not None and manager.engine.weights is not None
    weights = manager.engine.weights
    tokens = torch.randint(config.vocab_size, (4, config.seq_len))
    for _ in range(2):  # the second step: the state exists, its moves are steady
        before = weights.moved_bytes
        _, loss = model(tokens, tokens)
        forward = weights.moved_bytes - before
        loss.backward()
        backward = weights.moved_bytes - before - forward
        manager.compress_and_free_gradients()
        gradients = manager.summary().stored_gradient_mb * MIB  # out in backward, back at the step
        manager.step(optimizer, max_grad_norm=1.0)
        optimizer.zero_grad()
    summary = manager.summary()
    step = summary.parameters_moved_mb * MIB - forward - backward
    return {
        "forward": forward / count,
        "backward": backward / count,
        "step": step / count,
        "gradients": gradients / count,
        "weights_host": summary.parameters_host_mb * MIB / count,
        "state_host": summary.optimizer_state_host_mb * MIB / count,
        "gradients_host": summary.stored_gradient_mb * MIB / count,
        "params": count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(GPT_SIZES))
    parser.add_argument("--vocab-size", type=int, default=None)
    args = parser.parse_args()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}")
    vocab = "" if args.vocab_size is None else f", vocabulary {args.vocab_size}"
    print(f"# torch {torch.__version__}, TinyGPT {args.model!r}{vocab}, AdamW, lossless gradients")
    print(
        "compute   params  weights' link B/param: forward  backward  step (both ways)"
        "   gradients' link B/param: each way   host B/param: weights  optimizer state"
        "  gradients stored"
    )
    moved = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        row = measure(args.model, dtype, args.vocab_size)
        moved[name] = row["forward"] + row["backward"] + row["step"]
        print(
            f"{name:8s} {row['params']:8d}  {row['forward']:30.3f}  {row['backward']:8.3f}"
            f"  {row['step']:15.3f}   {row['gradients']:32.3f}   {row['weights_host']:21.3f}"
            f"  {row['state_host']:15.3f}  {row['gradients_host']:9.3f}"
        )
    print(f"weights' bytes a step, bf16 over fp32: {moved['bf16'] / moved['fp32']:.3f}")


if __name__ == "__main__":
    main()
