"""Paired CPU step time of the weights on the host with a bf16 compute dtype, two trees.

    python -m perf.bf16_step_pair [--old REV] [--rounds 6] [--steps 8] [--model small]

Issue 51 asks that forward and backward bring each unit's bf16 wires (cast on the host) in
place of the fp32 masters cast on the device, and that this host-side work not make the
CPU step slower than before by more than its noise. This times the same training (TinyGPT
``--model``, ``offload_parameters=True``, ``compute_dtype=torch.bfloat16``, AdamW, one
micro-batch a step) in fresh processes alternating between this checkout and ``--old``
(a git revision, checked out into a temporary worktree), ``--rounds`` pairs, and prints
each round's median step time, the medians of the rounds and their ratio, with the
spread of the per-round ratios as the noise. A quiet machine only: nothing else running.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from perf.harness import cpu_model

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Run in a fresh interpreter with the tree to time first on sys.path.
CHILD = """
import json, sys, time
import torch
import gradient_cache
from gradient_cache.demo.models import GPT_SIZES, TinyGPT
torch.manual_seed(0)
model = TinyGPT(GPT_SIZES[{model!r}])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
manager = gradient_cache.create_gradient_cache(
    model, compression_ratio=1, offload_optimizer_state=True, offload_parameters=True,
    compute_dtype=torch.bfloat16,
)
config = GPT_SIZES[{model!r}]
generator = torch.Generator().manual_seed(1)
times = []
for i in range({steps} + 2):
    tokens = torch.randint(config.vocab_size, (8, config.seq_len), generator=generator)
    start = time.perf_counter()
    _, loss = model(tokens, tokens)
    loss.backward()
    manager.step(optimizer, max_grad_norm=1.0)
    optimizer.zero_grad()
    if i >= 2:  # two warm-up steps
        times.append(time.perf_counter() - start)
moved = manager.summary().parameters_moved_mb
print(json.dumps({{"times": times, "moved_mb": moved, "file": gradient_cache.__file__}}))
"""


def time_tree(tree: pathlib.Path, *, model: str, steps: int) -> dict:
    code = CHILD.format(model=model, steps=steps)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default="47e165e", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="small")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        old = pathlib.Path(work) / "old"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(old), args.old],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            rows = []
            for _ in range(args.rounds):
                pair = {}
                for name, tree in (("old", old), ("new", ROOT)):
                    run = time_tree(tree, model=args.model, steps=args.steps)
                    assert run["file"].startswith(str(tree)), run["file"]
                    pair[name] = (statistics.median(run["times"]), run["moved_mb"])
                rows.append(pair)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}")
    print(f"# model {args.model}, {args.steps} timed steps a run, old = {args.old}")
    print("round  old step s  new step s  new/old")
    ratios = []
    for i, pair in enumerate(rows):
        ratio = pair["new"][0] / pair["old"][0]
        ratios.append(ratio)
        print(f"{i:5d}  {pair['old'][0]:10.4f}  {pair['new'][0]:10.4f}  {ratio:7.3f}")
    old_median = statistics.median(p["old"][0] for p in rows)
    new_median = statistics.median(p["new"][0] for p in rows)
    print(
        f"median {old_median:10.4f}  {new_median:10.4f}  {new_median / old_median:7.3f}"
        f"  (per-round ratios {min(ratios):.3f} to {max(ratios):.3f})"
    )
    print(
        f"weights moved a step: old {rows[0]['old'][1]:.2f} MiB, new {rows[0]['new'][1]:.2f} MiB"
        f" ({rows[0]['new'][1] / rows[0]['old'][1]:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
