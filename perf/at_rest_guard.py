"""The at-rest guard (engine/weights/at_rest.py) on the emulated device: its refusals and its cost.

    python -m perf.at_rest_guard [--trials 40] [--rounds 4]

Refusals: TinyGPT (four blocks) with the weights on the host, set up with ``device=`` on
the emulated accelerator, adds a penalty over ``model.parameters()`` to its loss after the
forward and calls backward, ``--trials`` times: how many raised the guard's error naming
the weights, the gradient's tensor hook's, or anything else (autograd's device mismatch);
and how many closes (``remove_hooks()`` right after) raised (the failed backward's last
hook, still running on autograd's device thread, brought a weight back during the close:
two runs at once, to load the machine, showed it 2 times in 180 before the close ended
that backward first).

Cost: the 24-block model of tests/emulated/test_larger_than_device.py (activation
checkpointing, AdamW), three steps a round, timed as shipped (guarded from the forward's
end to the backward's begin) and guarded through the step too (`OwnTensors.guarding` set
again after each backward, as the first version guarded at all times), alternating within
one process, ``--rounds`` rounds; one thread. The CPU's timing noise applies: compare the
ratio, and rerun. Since 5a02af9 the shipped window runs from a backward's end too and the
step undresses the weights first, so the two variants time the same code
(`perf/guard_window.py` measures what the longer window costs).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import time

import torch

import gradient_cache
from gradient_cache.demo.models import GPTConfig, TinyGPT
from gradient_cache.testing import emulated_device
from perf.harness import cpu_model

OPTIONS = {"compression_ratio": 1, "offload_optimizer_state": True, "offload_parameters": True}
SMALL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)
DEEP = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=24, n_heads=2)


def refusals(trials: int, device: torch.device) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    tokens = torch.randint(64, (4, 16), device=device)
    for _ in range(trials):
        torch.manual_seed(0)
        model = TinyGPT(SMALL)
        manager = gradient_cache.create_gradient_cache(model, **OPTIONS, device=device)
        _, loss = model(tokens, tokens)
        penalty = sum(p.square().sum() for p in model.parameters())
        try:
            (loss + 1e-4 * penalty).backward()
            counts["trained"] += 1
        except RuntimeError as error:
            message = str(error)
            if "were used outside their block's forward" in message:
                counts["the guard's, by name"] += 1
            elif "received a gradient computed on the" in message:
                counts["the tensor hook's, by name"] += 1
            else:
                counts[f"other: {message[:60]}"] += 1
        try:  # right after the failed backward, whose device thread may still be in a hook
            manager.remove_hooks()
        except AssertionError:
            counts["the close after it raised"] += 1
    return counts


def step_seconds(device: torch.device, rounds: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = TinyGPT(DEEP, activation_checkpointing=True)
    manager = gradient_cache.create_gradient_cache(
        model, **OPTIONS, bucket_size_mb=0.1, device=device
    )
    placement = manager.engine.weights.placement
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(64, (2, 16), device=device)
    times: dict[str, list[float]] = {"shipped": [], "guarded through the step": []}

    def step(through: bool) -> None:
        _, loss = model(tokens, tokens)
        loss.backward()
        if through:
            placement.guarding(True)
        manager.step(optimizer, max_grad_norm=0.5)
        optimizer.zero_grad()

    step(False)  # the state exists
    for _ in range(rounds):
        for name in times:
            start = time.perf_counter()
            for _ in range(3):
                step(name != "shipped")
            times[name].append((time.perf_counter() - start) / 3)
    manager.remove_hooks()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = emulated_device()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}")
    print(f"# torch {torch.__version__}, the emulated device")
    for kind, count in sorted(refusals(args.trials, device).items()):
        print(f"refused: {kind}: {count} of {args.trials}")
    times = step_seconds(device, args.rounds)
    for name, seconds in times.items():
        print(f"step, {name}: " + ", ".join(f"{s:.3f}" for s in seconds) + " s")
    ratios = [b / a for a, b in zip(*times.values(), strict=True)]
    print("guarded through the step / shipped, per round: " + ", ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()
