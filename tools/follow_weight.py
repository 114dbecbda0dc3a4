"""Follow one weight through a training step at run time: which files does a reader go through?

    python tools/follow_weight.py [--max-files N] [--max-returns M]      (project root)

Issue 50 measures how hard the weights' life is to follow as the files one weight (a
block's ``Parameter``) enters from the model's forward through the optimizer's step, and
the returns that hand a reader back to a file. This replays that walk on a real CPU step
with `tools/follow_optimizer.py`'s tracer: a *followed frame* is a frame of the package
that holds the parameter itself among its arguments; *files* are the distinct files
entered; *returns* are the "back from" hand-overs (a followed frame returning to a
followed caller in another file). A frame given a list, tuple, set or dict holding the
weight counts as holding it (a block's weights travel as lists). Both rules are printed:
every call, and a first pass (each function read once).

Scenarios, each the second step of a TinyGPT (four blocks) after a warm one, following
``blocks[1].mlp.fc.weight``: the weights on the host (``offload_parameters=True``), and the
same parameter with only the optimizer state on the host. ``--max-files`` /
``--max-returns`` make it a check (the every-call figures of the first scenario): exit
status 1 past either bound.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from types import FrameType

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import follow_optimizer
from follow_optimizer import Trace, Walk, report, trace

import gradient_cache
from gradient_cache.demo.models import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)
BUCKET_SIZE_MB = 0.02  # a few buckets: the step's loop runs more than once


def _holds(frame: FrameType, target: object) -> bool:
    """`follow_optimizer._holds`, and also an argument that is a list, tuple, set or dict
    holding the weight (a block's parameters travel as lists): a frame given the block's
    weights is given this one."""
    if HOLDS(frame, target):
        return True
    code, local = frame.f_code, frame.f_locals
    for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
        value = local.get(name)
        if isinstance(value, dict):
            value = [*value.keys(), *value.values()]
        if isinstance(value, (list, tuple, set, frozenset)) and any(v is target for v in value):
            return True
    return False


HOLDS = follow_optimizer._holds
follow_optimizer._holds = _holds  # trace() looks it up at each call


def returns(walk: Walk) -> int:
    return sum(entry.how.startswith("back from") for entry in walk.sequence)


def walk_one_step(name: str, **options: object) -> Trace:
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, bucket_size_mb=BUCKET_SIZE_MB, **options
    )
    generator = torch.Generator().manual_seed(1)

    def one_step() -> None:
        tokens = torch.randint(64, (4, 16), generator=generator)
        model(tokens, tokens)[1].backward()
        manager.step(optimizer, max_grad_norm=1.0)
        optimizer.zero_grad()

    one_step()  # warm: the state's first allocation and the forward order
    followed = model.blocks[1].mlp.fc.weight
    result = trace(name, followed, one_step)
    manager.remove_hooks()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-files", type=int, default=None, metavar="N")
    parser.add_argument("--max-returns", type=int, default=None, metavar="M")
    args = parser.parse_args(argv)
    results = [
        walk_one_step(
            "the weights on the host",
            offload_optimizer_state=True,
            offload_parameters=True,
        ),
        walk_one_step("the optimizer state on the host only", offload_optimizer_state=True),
    ]
    for result in results:
        print(report(result))
        for label, walk in (("every call", result.every), ("first pass", result.first)):
            print(f"   {label}: returns {returns(walk)}")
        print()
    main_walk = results[0].every
    files, back = len(main_walk.entries()), returns(main_walk)
    over = (args.max_files is not None and files > args.max_files) or (
        args.max_returns is not None and back > args.max_returns
    )
    if over:
        print(
            f"BREACH files {files} (max {args.max_files}), returns {back} (max {args.max_returns})"
        )
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
