"""What guarding the weights at rest from a backward's end costs a clip answered from the cache.

    git worktree add /tmp/before 04c2102
    python perf/guard_window.py /tmp/before && python perf/guard_window.py .

Run it for each tree to compare, alternating, several times: it imports the package from the
root given. TinyGPT (12 blocks) with the weights on the host in bf16 compute on the CPU, one
thread; per step, `clip_grad_norm_` between the backward and the fused step (answered from
the cache, reading every parameter), then `hook_manager.step`: the medians of 20 steps after
4. Since 5a02af9 the weights at rest are guarded (`at_rest.GuardedAtRest`, a Python call for
each read of them) from a backward's end until the next forward or the step, which undresses
them first; before, from the forward's end to the backward's begin only.
"""

from __future__ import annotations

import sys
import time


def main(root: str) -> None:
    sys.path.insert(0, root)
    import torch

    import gradient_cache
    from gradient_cache.demo.models import GPTConfig, TinyGPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=12, n_heads=4))
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=1,
        offload_optimizer_state=True,
        offload_parameters=True,
        compute_dtype=torch.bfloat16,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    data = [tuple(torch.randint(256, (4, 64), generator=generator) for _ in range(2))] * 4
    steps, clips = [], []
    for i in range(24):
        tokens, targets = data[i % 4]
        model(tokens, targets)[1].backward()
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        clipped = time.perf_counter()
        manager.step(optimizer)
        optimizer.zero_grad()
        if i >= 4:
            clips.append(clipped - start)
            steps.append(time.perf_counter() - clipped)
    manager.remove_hooks()
    clips.sort()
    steps.sort()
    print(
        f"{gradient_cache.__file__}: median clip {clips[10] * 1e3:.2f} ms, "
        f"step {steps[10] * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
