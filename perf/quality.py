"""Training quality of compression recipes, judged on validation loss *and* bytes.

    python -m perf.quality                        # AdamW table in perf/RESULTS.md (27 runs, ~1 h)
    python -m perf.quality --optimizers sgd --settings plain r10-topk r10-ef-int8 \
        r100-topk r100-ef-int8 int8               # the SGD table (18 runs)
    python -m perf.quality --summarize perf/results/quality_*.json   # re-print saved runs
    python -m perf.quality --settings r100-ef-int8 --optimizers adamw --seeds 0 1
    python -m perf.quality --time                 # step-time ratios, alone on the machine

Trains a byte-level transformer LM (TinyGPT "tiny", 0.83M parameters) on a pinned list of
standard-library files, plain PyTorch and the cache with each setting, from the same seed
and the same batches, and reports per setting and optimizer:

* the relative validation-loss gap to plain, paired by seed (mean and standard deviation);
* host bytes held (the CUDA backend's pinned pool: payload slots and host residuals) and
  bytes crossing PCIe per step (payloads out and back, residuals out and in), each also
  as a fraction of lossless offload's; device bytes kept between steps (a device
  residual). Bytes are what the CUDA backend would hold and move for this model, counted
  from the engine's own slot layout (`engine.route`), at the steady state after any warm-up.

Runs go ``--jobs`` at a time, one thread each. Writes ``--out`` (JSON, every run) and
prints a markdown table. Step times (``--time``) are measured in one process, settings
interleaved, and must not run beside anything else.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from gradient_cache import EngineConfig, GradientCacheHookManager, create_gradient_cache
from gradient_cache.codecs import BLOCK_CODECS
from gradient_cache.demo import training
from gradient_cache.demo.models import GPTConfig, TinyGPT, make_batches
from gradient_cache.engine.route import plan_params

# Standard-library sources, as Python 3.11.7 ships them. The hash pins their content:
# another Python's files differ, and the table would silently measure another task.
TRAIN_FILES = (
    "typing.py",
    "inspect.py",
    "argparse.py",
    "dataclasses.py",
    "enum.py",
    "functools.py",
    "pathlib.py",
    "collections/__init__.py",
    "subprocess.py",
    "tarfile.py",
    "shutil.py",
    "zipfile.py",
    "configparser.py",
    "logging/__init__.py",
)
VAL_FILES = ("difflib.py", "statistics.py", "fractions.py")
CORPUS_SHA256 = "48ff98d30f80d06c6e99903e2b6b99513010d15ce0647348b3080597a0176d8d"

MODELS = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4),
    # The second model that checks a ranking: 4.8M parameters, longer context, deeper.
    "wide": GPTConfig(vocab_size=256, seq_len=128, d_model=256, n_layers=6, n_heads=8),
}
MODEL = MODELS["tiny"]
BATCH_SIZE = 16
VAL_BATCHES = 32
VAL_SEED = 1234
STEPS = 1500
EVAL_EVERY = 500
# Tuned for plain PyTorch (`--optimizers` with the plain setting and `--lr`), then used
# for every setting: perf/RESULTS-archive.md, "Compression recipes: screening at 1,000 steps".
LEARNING_RATES = {"adamw": 1e-3, "sgd": 0.03}

# Settings: None is plain PyTorch; otherwise `create_gradient_cache` options.
SETTINGS: dict[str, dict | None] = {
    "plain": None,
    "r1": {"compression_ratio": 1},
    "r10-topk": {"compression_ratio": 10, "codec": "topk", "error_feedback": False},
    "r100-topk": {"compression_ratio": 100, "codec": "topk", "error_feedback": False},
    "r100-ef-fp32": {"compression_ratio": 100, "codec": "topk", "error_feedback": True},
    "r100-ef-bf16": {
        "compression_ratio": 100,
        "codec": "topk",
        "error_feedback": True,
        "residual_dtype": "bfloat16",
    },
    "r100-ef-int8": {
        "compression_ratio": 100,
        "codec": "topk",
        "error_feedback": True,
        "residual_dtype": "int8",
    },
    "r100-ef-int8-warm150": {
        "compression_ratio": 100,
        "codec": "topk",
        "error_feedback": True,
        "residual_dtype": "int8",
        "warmup_steps": 150,
    },
    "r100-ef-int8-warm300": {
        "compression_ratio": 100,
        "codec": "topk",
        "error_feedback": True,
        "residual_dtype": "int8",
        "warmup_steps": 300,
    },
    "r100-ef-int8-warm150-dense32k": {
        "compression_ratio": 100,
        "codec": "topk",
        "error_feedback": True,
        "residual_dtype": "int8",
        "warmup_steps": 150,
        "min_compress_numel": 32769,
    },
    "r100-ef-int8-dense64k": {
        "compression_ratio": 100,
        "codec": "topk",
        "error_feedback": True,
        "residual_dtype": "int8",
        "min_compress_numel": 65536,
    },
    "r10-ef-int8": {
        "compression_ratio": 10,
        "codec": "topk",
        "error_feedback": True,
        "residual_dtype": "int8",
    },
    "r10-ef-int8-warm150": {
        "compression_ratio": 10,
        "codec": "topk",
        "error_feedback": True,
        "residual_dtype": "int8",
        "warmup_steps": 150,
    },
    "int8": {"compression_ratio": 1, "value_dtype": "int8"},
    # The block codecs (issue 22): every tensor of at least one 128-entry block encoded.
    **{
        codec: {"compression_ratio": 1, "codec": codec, "min_compress_numel": 128}
        for codec in BLOCK_CODECS
    },
    # compression_ratio alone: each tensor takes the ladder's best codec for the budget.
    "r100": {"compression_ratio": 100},
    "r10": {"compression_ratio": 10},
    "r4": {"compression_ratio": 4},
}
# The table `python -m perf.quality` prints: lossless, top-k alone, today's defaults (error
# feedback with an int8 residual) and the best screened recipes (perf/RESULTS.md,
# "Compression recipes").
DEFAULT_SETTINGS = (
    "plain",
    "r1",
    "r10-topk",
    "r10-ef-int8",
    "r10-ef-int8-warm150",
    "r100-topk",
    "r100-ef-int8",
    "r100-ef-int8-warm300",
    "int8",
)


def corpus(*, check_hash: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens of the pinned files: (train, validation)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, val = (
        b"\n".join((stdlib / name).read_bytes() for name in names)
        for names in (TRAIN_FILES, VAL_FILES)
    )
    digest = hashlib.sha256(train + b"\0" + val).hexdigest()
    if check_hash and digest != CORPUS_SHA256:
        raise SystemExit(
            f"The corpus differs from the pinned one (sha256 {digest}, expected "
            f"{CORPUS_SHA256}): this Python ({platform.python_version()}) ships other "
            "versions of the files, so its numbers are not comparable with perf/RESULTS.md. "
            "Use Python 3.11.7, or pass --any-corpus to measure anyway."
        )
    return (torch.frombuffer(bytearray(data), dtype=torch.uint8).long() for data in (train, val))


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def validation_loss(model: TinyGPT, val: torch.Tensor, batches: int = VAL_BATCHES) -> float:
    generator = torch.Generator().manual_seed(VAL_SEED)
    with torch.no_grad():
        return statistics.fmean(
            model(
                *make_batches(
                    val, batch_size=BATCH_SIZE, seq_len=model.config.seq_len, generator=generator
                )
            )[1].item()
            for _ in range(batches)
        )


def train_step(
    model: TinyGPT,
    manager: GradientCacheHookManager | None,
    optimizer: torch.optim.Optimizer,
    train: torch.Tensor,
    generator: torch.Generator,
) -> None:
    """One step on the next batch, ``apply_gradients()`` then ``optimizer.step()`` (the
    shared step, not fused): plain when ``manager`` is None."""
    batch = make_batches(
        train, batch_size=BATCH_SIZE, seq_len=model.config.seq_len, generator=generator
    )
    training.train_step(model, optimizer, manager, [batch])


def train_run(job: dict) -> dict:
    """One training run; ``job``: setting, optimizer, seed, steps, lr, check_hash."""
    torch.set_num_threads(1)
    train, val = corpus(check_hash=job["check_hash"])
    options = SETTINGS[job["setting"]]
    torch.manual_seed(job["seed"])
    model = TinyGPT(MODELS[job.get("model", "tiny")])
    manager = None if options is None else create_gradient_cache(model, **options)
    optimizer = make_optimizer(job["optimizer"], model.parameters(), job["lr"])
    generator = torch.Generator().manual_seed(job["seed"])
    curve = {}
    started = time.perf_counter()
    for step in range(1, job["steps"] + 1):
        train_step(model, manager, optimizer, train, generator)
        if step % EVAL_EVERY == 0 or step == job["steps"]:
            curve[step] = validation_loss(model, val, job.get("val_batches", VAL_BATCHES))
    if manager is not None:
        manager.remove_hooks()
    return {
        **job,
        "val_loss": curve[job["steps"]],
        "curve": curve,
        "seconds": time.perf_counter() - started,
    }


def offload_bytes(setting: str, model_name: str = "tiny") -> dict[str, float]:
    """What the CUDA backend holds and moves for ``setting`` on that model, at steady state."""
    model = TinyGPT(MODELS[model_name])
    params = list(model.parameters())
    dense = sum(p.numel() * p.element_size() for p in params)
    if SETTINGS[setting] is None:
        return {
            "host_bytes": 0,
            "host_peak_bytes": 0,
            "pcie_bytes": 0,
            "device_bytes": 0,
            "dense_bytes": dense,
        }
    options = dict(SETTINGS[setting])
    ratio = float(options.pop("compression_ratio", 1))
    config = EngineConfig.from_options(options, compression_ratio=ratio)
    steady = plan_params(params, config, ratio=ratio, selection="exact", steps=config.warmup_steps)
    start = plan_params(params, config, ratio=ratio, selection="exact", steps=0)
    pool = sum(route.slot.nbytes for route in steady.values())
    warmup_pool = sum(route.slot.nbytes for route in start.values())
    # The steady-state payload: the dense gradient, or kept values and indices.
    payload = sum(route.payload_bytes for route in steady.values())
    residual = sum(route.residual_bytes for route in steady.values())
    host_kept = residual if config.residual_options.residual_location == "host" else 0
    return {
        "host_bytes": pool,
        # During warm-up the pool has room for dense payloads; it shrinks afterwards.
        "host_peak_bytes": warmup_pool if config.warmup_steps else pool,
        # Per step, one micro-batch: the payload out and back, a host residual in and out.
        "pcie_bytes": 2 * payload + 2 * host_kept,
        "device_bytes": residual - host_kept,
        "dense_bytes": dense,
        "payload_bytes": payload,
    }


def summarize(runs: list[dict]) -> list[dict]:
    """Per (optimizer, setting): the val-loss gap to plain, paired by seed, and the bytes."""
    plain = {(r["optimizer"], r["seed"]): r["val_loss"] for r in runs if r["setting"] == "plain"}
    rows = []
    for optimizer in dict.fromkeys(r["optimizer"] for r in runs):
        for setting in dict.fromkeys(r["setting"] for r in runs):
            mine = [r for r in runs if r["optimizer"] == optimizer and r["setting"] == setting]
            paired = [r for r in mine if (optimizer, r["seed"]) in plain]
            if not mine:
                continue
            gaps = [r["val_loss"] / plain[(optimizer, r["seed"])] - 1 for r in paired]
            rows.append(
                {
                    "optimizer": optimizer,
                    "setting": setting,
                    "seeds": sorted(r["seed"] for r in mine),
                    "val_loss": statistics.fmean(r["val_loss"] for r in mine),
                    "gap_mean": statistics.fmean(gaps) if gaps else None,
                    "gap_std": statistics.stdev(gaps) if len(gaps) > 1 else None,
                    **offload_bytes(setting, mine[0].get("model", "tiny")),
                }
            )
    return rows


def markdown(rows: list[dict], steps: int) -> str:
    lines = [
        f"| optimizer | setting | val loss ({steps} steps) | gap vs plain, mean ± sd | "
        "host bytes (of lossless) | PCIe bytes per step (of lossless) | device bytes kept |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        gap = "-" if row["gap_mean"] is None else f"{100 * row['gap_mean']:+.2f}%"
        if row["gap_std"] is not None:
            gap += f" ± {100 * row['gap_std']:.2f}"
        lossless = row["dense_bytes"]
        host = pcie = "-"
        if SETTINGS[row["setting"]] is not None:
            host = f"{row['host_bytes'] / 2**20:.2f} MiB ({row['host_bytes'] / lossless:.1%})"
            if row["host_peak_bytes"] > row["host_bytes"]:
                host += f"; warm-up {row['host_peak_bytes'] / lossless:.0%}"
            pcie = f"{row['pcie_bytes'] / 2**20:.2f} MiB ({row['pcie_bytes'] / (2 * lossless):.1%})"
        lines.append(
            f"| {row['optimizer']} | {row['setting']} | {row['val_loss']:.4f} | {gap} | {host} | "
            f"{pcie} | {row['device_bytes'] / 2**20:.2f} MiB |"
        )
    return "\n".join(lines)


def time_steps(settings: list[str], *, rounds: int, steps: int) -> dict[str, float]:
    """Median step time of each setting over ``rounds`` interleaved rounds, AdamW, 2 threads."""
    train, _ = corpus(check_hash=False)
    timings: dict[str, list[float]] = {s: [] for s in settings}
    runners = {}
    for setting in settings:
        torch.manual_seed(0)
        model = TinyGPT(MODEL)
        options = SETTINGS[setting]
        manager = None if options is None else create_gradient_cache(model, **options)
        runners[setting] = (model, manager, torch.optim.AdamW(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(0)
    for round_index in range(rounds + 1):  # round 0 warms up
        for setting, (model, manager, optimizer) in runners.items():
            started = time.perf_counter()
            for _ in range(steps):
                train_step(model, manager, optimizer, train, generator)
            if round_index:
                timings[setting].append((time.perf_counter() - started) / steps)
    return {s: statistics.median(t) for s, t in timings.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings", nargs="+", choices=sorted(SETTINGS), default=list(DEFAULT_SETTINGS)
    )
    parser.add_argument(
        "--optimizers", nargs="+", choices=sorted(LEARNING_RATES), default=["adamw"]
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--lr", type=float, help="override the tuned learning rate")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument(
        "--val-batches",
        type=int,
        default=VAL_BATCHES,
        help=f"validation batches of {BATCH_SIZE} each loss averages (default {VAL_BATCHES})",
    )
    parser.add_argument("--out", type=Path, default=Path("quality.json"))
    parser.add_argument(
        "--without-plain",
        action="store_true",
        help="skip plain's runs (their seeds' runs from an earlier --out pair with these in "
        "--summarize: plain's code did not change)",
    )
    parser.add_argument(
        "--any-corpus",
        action="store_true",
        help="measure even if this Python's files differ from the pinned ones",
    )
    parser.add_argument(
        "--time",
        action="store_true",
        help="measure step-time ratios instead (nothing else may run)",
    )
    parser.add_argument(
        "--summarize",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print the table of runs saved by --out (e.g. perf/results/quality_*.json); "
        "a later file's run replaces an earlier file's of the same optimizer, setting and seed",
    )
    parser.add_argument("--rounds", type=int, default=5, help="--time: interleaved rounds")
    parser.add_argument("--time-steps", type=int, default=20, help="--time: steps per round")
    args = parser.parse_args(argv)
    if args.summarize:
        saved = [json.loads(path.read_text()) for path in args.summarize]
        # A re-measured run (a codec's fix) supersedes the one saved before it.
        latest = {
            (run["optimizer"], run["setting"], run["seed"]): run
            for report in saved
            for run in report["runs"]
        }
        print(markdown(summarize(list(latest.values())), saved[0]["steps"]))
        return
    if args.time:
        medians = time_steps(args.settings, rounds=args.rounds, steps=args.time_steps)
        base = medians.get("plain")
        print("| setting | ms per step | vs plain |\n|---|---:|---:|")
        for setting, seconds in medians.items():
            ratio = "-" if base is None else f"{seconds / base:.3f}x"
            print(f"| {setting} | {1000 * seconds:.1f} | {ratio} |")
        return
    corpus(check_hash=not args.any_corpus)  # fail before starting any run
    settings = list(dict.fromkeys([*([] if args.without_plain else ["plain"]), *args.settings]))
    jobs = [
        {
            "setting": s,
            "optimizer": o,
            "seed": seed,
            "steps": args.steps,
            "model": args.model,
            "lr": args.lr or LEARNING_RATES[o],
            "val_batches": args.val_batches,
            "check_hash": not args.any_corpus,
        }
        for o in args.optimizers
        for seed in args.seeds
        for s in settings
    ]
    runs = []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        for run in pool.map(train_run, jobs):
            runs.append(run)
            print(
                f"{run['optimizer']} {run['setting']} seed {run['seed']}: "
                f"{run['val_loss']:.4f} ({run['seconds']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    rows = summarize(runs)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "steps": args.steps,
                "runs": runs,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(markdown(rows, args.steps))


if __name__ == "__main__":
    main()
