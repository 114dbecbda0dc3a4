"""What autocast without its weight cache keeps on the device with the weights on the host.

    python -m perf.autocast_window

TinyGPT (twelve blocks, d_model 64) set up from the host with ``device=`` on the emulated
accelerator, the state and the weights on the host, two AdamW steps of one micro-batch
each, in three ways: fp32, the cache's ``compute_dtype=torch.bfloat16`` (FSDP2's mixed
precision), and ``torch.autocast(dtype=torch.bfloat16, cache_enabled=False)``; each without
and with activation checkpointing, each in a process of its own. Prints the allocator's
peak over the model's fp32 weight bytes. Autocast casts each weight at each use and
autograd saves the bf16 cast for that block's backward, so without checkpointing each
block's casts stay on the device from its forward until backward reaches it: the peak is
above the fp32 run's and more than twice the compute dtype's (docs/options.md, ``autocast``).
"""

from __future__ import annotations

import subprocess
import sys

MODES = ("fp32", "compute_dtype", "autocast_no_cache")


def measure(mode: str, checkpointing: bool) -> tuple[int, int]:
    """(the allocator's peak, the model's fp32 weight bytes), in this process."""
    import torch

    import gradient_cache
    from gradient_cache.demo.models import GPTConfig, TinyGPT
    from gradient_cache.testing import emulated_device

    device = emulated_device()
    config = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=12, n_heads=2)
    torch.manual_seed(0)
    model = TinyGPT(config, activation_checkpointing=checkpointing)
    weights = sum(p.nbytes for p in model.parameters())
    extra = {"compute_dtype": torch.bfloat16} if mode == "compute_dtype" else {}
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=1,
        offload_optimizer_state=True,
        offload_parameters=True,
        device=device,
        **extra,
    )
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 64, (2, 16), device=device)
    torch.accelerator.reset_peak_memory_stats()
    for _ in range(2):
        with torch.autocast(
            "emu", dtype=torch.bfloat16, enabled=mode == "autocast_no_cache", cache_enabled=False
        ):
            loss = model(tokens, tokens)[1]
        loss.backward()
        manager.step(optimizer)
        optimizer.zero_grad()
    return torch.accelerator.max_memory_allocated(), weights


def main() -> None:
    if len(sys.argv) == 3:  # one measurement, in a process of its own
        peak, weights = measure(sys.argv[1], sys.argv[2] == "1")
        print(peak, weights)
        return
    print("| run | no checkpointing: peak / fp32 weights | checkpointing |")
    print("|---|---:|---:|")
    for mode in MODES:
        ratios = []
        for checkpointing in ("0", "1"):
            out = subprocess.run(
                [sys.executable, "-m", "perf.autocast_window", mode, checkpointing],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            ratios.append(f"{int(out[0]) / int(out[1]):.3f}")
        print(f"| {mode} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()
