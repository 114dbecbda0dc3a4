"""The cache against its peers: other ways to train with less device memory, side by side.

    python -m perf.peers                       # CPU: every contender, S1 and S2
    python -m perf.peers --device cuda         # the same on a GPU, plus the CPU-offload peers
    python -m perf.peers --contenders plain cache-fused --no-search --steps 2   # a quick look

Trains the demo's TinyGPT "medium" (22.9M parameters, activation checkpointing per block,
AdamW's settings) a few steps per contender, each contender in a fresh process, from the
same seed on the same batches, in two scenarios: S1, one micro-batch of 4 and no clipping;
S2, two micro-batches of 2 and clipping at 1.0. Contenders (perf/peers_contenders.py):
plain AdamW; PyTorch's optimizer step in backward (one AdamW per parameter, stepped in its
post-accumulate-grad hook); bitsandbytes' and torchao's AdamW8bit; the cache lossless with
apply_gradients() and with the fused step, at the default ratio (fused), and its fused step
with bitsandbytes' AdamW8bit; the fused step with the optimizer state on the host
(offload_optimizer_state), alone and with bitsandbytes' AdamW8bit; on CUDA also torchao's
CPUOffloadOptimizer (with and without offload_gradients) and FSDP2's CPUOffloadPolicy at
world size 1. A contender that cannot
run a scenario says why in its row.

Per contender and scenario: device bytes by component when backward ends and at the
optimizer step's peak, each phase's peak and the overall one (on a CPU counted by
gradient_cache.demo.accounting, on CUDA by torch.cuda.max_memory_allocated per phase),
host bytes, the step time over plain AdamW's (paired and interleaved in the same process,
so slow drift of the machine hits both), the loss after the steps, and the largest
weight difference from plain and, for exact contenders, from the run they must equal bit
for bit. Then the largest S1 batch whose peak fits plain's peak at S1's batch, with and
without activation checkpointing, found by measured probes (perf/peers_search.py).

Prints markdown tables and writes every figure to ``--json`` (default
perf/results/peers_<device>.json) after each contender. The batch search is the slowest
part (``--no-search``, ``--max-batch``). Time only on an otherwise idle machine: under load
the ratios scatter widely.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from gradient_cache import __version__
from gradient_cache.demo.models import GPT_SIZES
from perf.harness import cpu_model, cpu_snapshot, others_share
from perf.peers_contenders import CONTENDERS, DEFAULT_CONTENDERS, SCENARIOS
from perf.peers_run import PeerSettings, run_contender
from perf.peers_table import markdown

DEFAULT_STEPS = 3
DEFAULT_ROUNDS = 3
DEFAULT_MAX_BATCH = 32  # 8 times S1's batch; each probe costs in proportion


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.summarize is not None:
        print(markdown(json.loads(args.summarize.read_text())))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here.", file=sys.stderr)
        return 2
    keys = run_order(args.contenders)
    started, load = time.perf_counter(), cpu_snapshot()
    json_path = args.json or Path("perf/results") / f"peers_{args.device}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python -m perf.peers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(args.device),
        "model": {"size": args.model, "config": vars(GPT_SIZES[args.model])},
        "scenarios": {name: asdict(s) for name, s in SCENARIOS.items()},
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="peers-") as reference_dir:
        settings = PeerSettings(
            model_size=args.model,
            steps=args.steps,
            rounds=args.rounds,
            seed=args.seed,
            device=args.device,
            threads=args.threads,
            search=not args.no_search,
            max_batch=args.max_batch,
            reference_dir=reference_dir,
        )
        report["settings"] = {k: v for k, v in asdict(settings).items() if k != "reference_dir"}
        budgets = None
        for key in keys:
            run = _in_fresh_process(key, settings, budgets)
            if key == "plain" and "batch_search" in run:
                budgets = {name: found["budget"] for name, found in run["batch_search"].items()}
            report["runs"].append(run)
            report["wall_seconds"] = time.perf_counter() - started
            report["others_cpu_share"] = others_share(load, cpu_snapshot())
            # Written after every contender: a run cut short keeps what it measured.
            json_path.write_text(json.dumps(report, indent=1) + "\n")
            print(f"{key}: {report['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
    print(markdown(report))
    print(f"\nWrote {json_path}.", file=sys.stderr)
    return 1 if any("error" in run for run in report["runs"]) else 0


def run_order(contenders: list[str]) -> list[str]:
    """``contenders`` in the order given (a run cut short keeps the first ones), plain
    first (its peak is the search's budget, its weights the reference) and each exact
    reference before the contenders compared with it."""
    order: list[str] = []
    for key in ["plain", *contenders]:
        reference = CONTENDERS[key].exact_reference
        for each in (reference, key):
            if each in (key, *contenders) and each not in order:
                order.append(each)
    return order


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m perf.peers", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=sorted(CONTENDERS),
        default=list(DEFAULT_CONTENDERS),
        help="which to run, in this order (plain always first, a reference before those "
        "compared with it); default: all but cache-fused-torchao, which compiles torchao's "
        "step once more",
    )
    parser.add_argument("--model", choices=sorted(GPT_SIZES), default="medium")
    parser.add_argument(
        "--steps",
        type=_at_least(2),
        default=DEFAULT_STEPS,
        help=f"training steps per contender and scenario, the last measured "
        f"(default {DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--rounds",
        type=_at_least(1),
        default=DEFAULT_ROUNDS,
        help=f"timed rounds against plain, after one warm-up round (default {DEFAULT_ROUNDS})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-search", action="store_true", help="skip the largest-batch search (its slowest part)"
    )
    parser.add_argument(
        "--max-batch",
        type=_at_least(1),
        default=DEFAULT_MAX_BATCH,
        help=f"the largest batch the search tries (default {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--threads",
        type=_at_least(1),
        default=torch.get_num_threads(),
        help="intra-op threads of every run (default: this process's)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="where the figures go")
    parser.add_argument(
        "--summarize",
        type=Path,
        metavar="JSON",
        help="print the tables of a saved --json (also of a run cut short) and exit",
    )
    return parser


def _at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lowest - 1
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {lowest}")
        return value

    return parse


def _in_fresh_process(
    key: str, settings: PeerSettings, budgets: dict[str, int] | None
) -> dict[str, Any]:
    """``run_contender`` in a new process (its own allocator figures, hooks and compiled
    code); a failure becomes the row's error, so the other contenders still run."""
    contender, device = CONTENDERS[key], torch.device(settings.device)
    refusals = {name: contender.refusal(s, device) for name, s in SCENARIOS.items()}
    if all(refusals.values()):  # nothing to run: no process to start
        rows = {name: {"supported": False, "reason": r} for name, r in refusals.items()}
        search = {"supported": False, "reason": refusals["S1"]}
        return {"key": key, "label": contender.label, "scenarios": rows, "batch_search": search}
    # spawn, not fork: CUDA and OpenMP thread pools do not survive a fork.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        try:
            return pool.submit(run_contender, key, settings, budgets).result()
        except Exception as error:  # the traceback goes to stderr, the row keeps one line
            traceback.print_exc()
            error_line = f"{type(error).__name__}: {error}"
            return {"key": key, "label": contender.label, "error": error_line}


def _machine(device: str) -> dict[str, Any]:
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradient_cache": __version__,
        "torch_threads": torch.get_num_threads(),
        "packages": {name: _version(name) for name in ("torchao", "bitsandbytes")},
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
