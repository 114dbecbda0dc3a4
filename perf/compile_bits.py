"""torch.compile with the weights on the host: which compiled runs keep plain's bits.

    python -m perf.compile_bits            # TinyGPT (tests' size), 3 AdamW steps, inductor

For each way of compiling (each block on its own, ``block.compile()``; the whole model,
``torch.compile(model)``) it trains plain PyTorch compiled the same way and the cache with
``offload_parameters=True``, on one seed and the same batches, and prints the largest
weight difference after the steps and how many block parameters received their gradient
while their weights were on the host (the cache's warning). Compiling takes a minute or so
on 2 cores.
"""

from __future__ import annotations

import sys
import warnings

import torch

import gradient_cache
from gradient_cache.demo.models import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)
STREAMED = {"compression_ratio": 1, "offload_optimizer_state": True, "offload_parameters": True}


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CONFIG)


def train(called: torch.nn.Module, params: TinyGPT, manager=None) -> None:
    optimizer = torch.optim.AdamW(params.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(64, (4, 16), generator=generator)
        called(tokens, tokens)[1].backward()
        if manager is None:
            optimizer.step()
        else:
            manager.step(optimizer)
        optimizer.zero_grad()


def compiled(module: TinyGPT, way: str) -> torch.nn.Module:
    if way == "blocks":
        for block in module.blocks:
            block.compile()
        return module
    return torch.compile(module)


def main() -> int:
    print("| compiled | max weight difference from plain compiled alike | warned of |")
    print("|---|---:|---|")
    for way in ("blocks", "model"):
        plain, cached = model(), model()
        train(compiled(plain, way), plain)
        called = compiled(cached, way)
        manager = gradient_cache.create_gradient_cache(called, **STREAMED)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(called, cached, manager)
        warned = [w for w in caught if "received their gradients" in str(w.message)]
        difference = max(
            (a - b).abs().max().item()
            for a, b in zip(plain.parameters(), cached.parameters(), strict=True)
        )
        print(f"| {way} | {difference:.3g} | {'yes' if warned else 'no'} |")
        manager.remove_hooks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
