"""What the cache saves during backward, eager against torch.compile, measured by RSS on a CPU.

    MALLOC_MMAP_THRESHOLD_=65536 python -m perf.compile_memory

Four Linear(4096, 4096) layers (64 MiB of fp32 gradient each, so glibc maps every gradient
on its own and gives it back when it is freed; the environment variable keeps that
threshold fixed). Per variant, the largest rise of the process's RSS over its value before
backward, sampled in every post-accumulate-grad hook (where the cache takes a gradient, and
where gradients are most numerous), is reported with the gradients' total. The cache runs
at ratio 100 without error feedback, so each gradient is replaced by a 2% payload and freed
as soon as it is taken. Eager, gradients arrive one at a time; compiled, the backward graph
returns them all before the first hook fires.
"""

from __future__ import annotations

import gc

import psutil
import torch

import gradient_cache
from gradient_cache.engine.units import MIB

WIDTH, DEPTH, BATCH = 4096, 4, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def backward_rise(*, cached: bool, compiled: bool) -> float:
    """MiB: the largest RSS rise seen in a hook during the last of three backwards."""
    model = make_model()
    manager = None
    if cached:
        # The ladder (its codecs keep no residual; this once passed error_feedback=False,
        # which did nothing here).
        manager = gradient_cache.create_gradient_cache(model, compression_ratio=100)
    samples: list[int] = []
    process = psutil.Process()
    for param in model.parameters():  # after the cache's hooks: sees what it left behind
        param.register_post_accumulate_grad_hook(
            lambda p: samples.append(process.memory_info().rss)
        )
    run = torch.compile(model) if compiled else model
    x = torch.randn(BATCH, WIDTH)
    rise = 0.0
    for _ in range(3):  # the first compiles; later ones show the steady state
        loss = run(x).square().mean()
        gc.collect()
        samples.clear()
        before = process.memory_info().rss
        loss.backward()
        rise = (max(samples) - before) / MIB
        if manager is not None:
            manager.discard_gradients()
        model.zero_grad()
    if manager is not None:
        manager.remove_hooks()
    return rise


def main() -> None:
    torch.set_num_threads(2)
    gradients = DEPTH * WIDTH * WIDTH * 4 / MIB
    print(f"gradients: {gradients:.0f} MiB in {DEPTH} tensors\n")
    print("| variant | RSS rise during backward, MiB | of the gradients |\n|---|---:|---:|")
    for compiled in (False, True):
        for cached in (False, True):
            rise = backward_rise(cached=cached, compiled=compiled)
            name = f"{'compiled' if compiled else 'eager'}, {'cache r=100' if cached else 'plain'}"
            print(f"| {name} | {rise:.0f} | {rise / gradients:.0%} |")


if __name__ == "__main__":
    main()
