"""Soak: a long run leaves nothing behind and does not grow.

    python -m perf.soak                      # 2,000 steps: plain, ratio 1, the default, ratio 100
    python -m perf.soak --steps 10000 --settings plain r1 default --runs 2   # the slope table
    python -m perf.soak --steps 20 --warmup 5   # the CI smoke run

Trains perf.quality's model (TinyGPT "tiny", 0.83M parameters, AdamW) with the cache for
``--steps`` steps per setting, each setting in its own process (``--jobs`` at a time, one
thread each), the user's loop of backward, ``apply_gradients()`` and ``optimizer.step()``.
Before the cache is created (after one plain step, so the optimizer's state exists) and
after ``remove_hooks()`` it counts live tensors (gc), threads and hooks (the parameters'
post-accumulate-grad hooks, the model's forward pre-hooks, PyTorch's global module and
optimizer hooks): the end must equal the start. It also reports the process's RSS after
``--warmup`` steps and its largest value after that (sampled every 25 steps): the growth
between them, to compare with plain PyTorch's in the same table. Every ``--sample-every``
steps it records RSS and the live tensor count (the curve), and fits RSS's slope after the
warm-up by least squares: MiB per 1,000 steps, and as a share of the RSS after warm-up. A
peak can be allocator noise; a slope that stays above plain's over 10,000 steps is a leak.
``--runs`` repeats each setting (in its own process) for the spread. Writes ``--out``
(JSON, with the curves) and prints a markdown table, then the verdict: each setting's mean
slope over its runs (with their range) against plain's mean plus ``TARGET_SHARE`` of RSS per
1,000 steps. ``--png`` draws the curves; ``--summarize JSON`` prints (and draws) a saved run
again without training. Exits 1 if any count did not return to its start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import multiprocessing
import platform
import sys
import threading
import warnings
from pathlib import Path

import psutil
import torch
from torch.nn.modules.module import _global_forward_pre_hooks
from torch.optim.optimizer import _global_optimizer_pre_hooks

from gradient_cache import create_gradient_cache
from perf.quality import LEARNING_RATES, MODEL, TinyGPT, corpus, train_step

# None: plain PyTorch, the baseline for RSS growth (the allocator's own drift).
SETTINGS = {
    "plain": None,
    "r1": {"compression_ratio": 1},
    "default": {},
    "r100": {"compression_ratio": 100, "codec": "topk"},
}
RSS_EVERY = 25
# The largest slope (share of RSS per 1,000 steps) above plain's that is not called a leak:
# 0.05% per 1,000 steps is 5% over a 100,000-step run.
TARGET_SHARE = 0.0005


def slope_per_thousand(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (step, value) points, per 1,000 steps (0 for fewer than 2)."""
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return 1000 * sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def counts(model: torch.nn.Module) -> dict[str, int]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated names warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return {
        "tensors": tensors,
        "threads": threading.active_count(),
        "hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
        + sum(len(m._forward_pre_hooks) for m in model.modules())
        + len(_global_forward_pre_hooks)
        + len(_global_optimizer_pre_hooks),
    }


def soak(job: dict) -> dict:
    """One setting's run; ``job``: setting, run, steps, warmup, sample_every, check_hash."""
    torch.set_num_threads(1)
    train, _ = corpus(check_hash=job["check_hash"])
    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATES["adamw"])
    generator = torch.Generator().manual_seed(0)
    train_step(model, None, optimizer, train, generator)  # the optimizer's state exists now
    start = counts(model)
    options = SETTINGS[job["setting"]]
    manager = None if options is None else create_gradient_cache(model, **options)
    process = psutil.Process()
    rss_after_warmup = rss_peak = 0
    curve = []  # (step, RSS MiB, live tensors)
    for step in range(1, job["steps"] + 1):
        train_step(model, manager, optimizer, train, generator)
        if step == job["warmup"]:
            rss_after_warmup = rss_peak = process.memory_info().rss
        elif step > job["warmup"] and (step % RSS_EVERY == 0 or step == job["steps"]):
            rss_peak = max(rss_peak, process.memory_info().rss)
        if step % job["sample_every"] == 0 or step == job["steps"]:
            curve.append((step, process.memory_info().rss / 2**20, counts(model)["tensors"]))
    if manager is not None:
        manager.remove_hooks()
    del manager
    end = counts(model)
    after_warmup = [(step, rss) for step, rss, _ in curve if step >= job["warmup"]]
    slope = slope_per_thousand(after_warmup)
    return {
        **job,
        "start": start,
        "end": end,
        "rss_after_warmup_mib": rss_after_warmup / 2**20,
        "rss_peak_mib": rss_peak / 2**20,
        "rss_growth": rss_peak / rss_after_warmup - 1,
        "rss_slope_mib_per_1000": slope,
        "rss_slope_share_per_1000": slope / (rss_after_warmup / 2**20),
        "tensors_slope_per_1000": slope_per_thousand(
            [(step, tensors) for step, _, tensors in curve if step >= job["warmup"]]
        ),
        "curve": curve,
    }


def markdown(results: list[dict]) -> str:
    lines = [
        "| setting | run | steps | tensors start → end | threads | hooks | RSS after warm-up "
        "MiB | RSS peak after MiB | growth | RSS slope, MiB per 1,000 steps | of RSS | live "
        "tensors per 1,000 steps |",
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        start, end = r["start"], r["end"]
        cells = [f"{start[k]} → {end[k]}" for k in ("tensors", "threads", "hooks")]
        lines.append(
            f"| {r['setting']} | {r['run']} | {r['steps']} | {' | '.join(cells)} | "
            f"{r['rss_after_warmup_mib']:.1f} | {r['rss_peak_mib']:.1f} | "
            f"{100 * r['rss_growth']:+.2f}% | {r['rss_slope_mib_per_1000']:+.3f} | "
            f"{100 * r['rss_slope_share_per_1000']:+.3f}% | "
            f"{r['tensors_slope_per_1000']:+.2f} |"
        )
    return "\n".join(lines)


def verdict(results: list[dict]) -> list[dict]:
    """Per setting: mean, lowest and highest slope share over its runs, and whether the mean
    is within plain's mean plus ``TARGET_SHARE`` (None without a plain run to compare)."""
    shares: dict[str, list[float]] = {}
    for r in results:
        shares.setdefault(r["setting"], []).append(r["rss_slope_share_per_1000"])
    means = {setting: sum(v) / len(v) for setting, v in shares.items()}
    limit = means["plain"] + TARGET_SHARE if "plain" in means else None
    return [
        {
            "setting": setting,
            "runs": len(v),
            "mean": means[setting],
            "low": min(v),
            "high": max(v),
            "limit": limit,
            "meets": None if limit is None or setting == "plain" else means[setting] <= limit,
        }
        for setting, v in shares.items()
    ]


def verdict_markdown(rows: list[dict]) -> str:
    lines = [
        "| setting | runs | mean slope, of RSS per 1,000 steps | lowest run | highest run | "
        "target: at most plain's mean + 0.05% |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if row["meets"] is None:
            outcome = "(the baseline)" if row["setting"] == "plain" else "(no plain run)"
        else:
            outcome = f"{'met' if row['meets'] else 'missed'} (≤ {100 * row['limit']:+.3f}%)"
        lines.append(
            f"| {row['setting']} | {row['runs']} | {100 * row['mean']:+.3f}% | "
            f"{100 * row['low']:+.3f}% | {100 * row['high']:+.3f}% | {outcome} |"
        )
    return "\n".join(lines)


def write_png(results: list[dict], path: Path) -> None:
    """RSS minus its value at the warm-up, per setting and run, against the step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    axes = figure.add_subplot()
    for r in results:
        points = [(step, rss) for step, rss, _ in r["curve"] if step >= r["warmup"]]
        base = r["rss_after_warmup_mib"]
        axes.plot(
            [step for step, _ in points],
            [rss - base for _, rss in points],
            label=f"{r['setting']}, run {r['run']} ({r['rss_slope_mib_per_1000']:+.3f} MiB/1k)",
        )
    axes.set_xlabel("step")
    axes.set_ylabel("RSS minus RSS after warm-up, MiB")
    axes.set_title("perf.soak: RSS after warm-up (least-squares slope in the legend)")
    axes.legend(fontsize="small")
    FigureCanvasAgg(figure).print_png(str(path))


def report(results: list[dict], png: Path | None) -> None:
    print(markdown(results))
    print()
    print(verdict_markdown(verdict(results)))
    if png is not None:
        write_png(results, png)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200, help="steps before the RSS baseline")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--runs", type=int, default=1, help="runs of each setting")
    parser.add_argument(
        "--sample-every", type=int, default=100, help="steps between RSS and tensor samples"
    )
    parser.add_argument("--out", type=Path, default=Path("soak.json"))
    parser.add_argument("--any-corpus", action="store_true", help="see perf.quality")
    parser.add_argument("--png", type=Path, help="draw the RSS curves here (needs matplotlib)")
    parser.add_argument(
        "--summarize", type=Path, metavar="JSON", help="print a saved run's tables; no training"
    )
    args = parser.parse_args(argv)
    if args.png is not None:
        try:
            import matplotlib  # noqa: F401  (before the run, not after hours of it)
        except ImportError:
            parser.error(f"--png {args.png} needs matplotlib: pip install matplotlib")
    if args.summarize is not None:
        report(json.loads(args.summarize.read_text())["results"], args.png)
        return
    if not 0 < args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be between 0 and --steps {args.steps}")
    if args.runs < 1 or args.sample_every < 1:
        parser.error("--runs and --sample-every must be at least 1")
    jobs = [
        {
            "setting": s,
            "run": run,
            "steps": args.steps,
            "warmup": args.warmup,
            "sample_every": args.sample_every,
            "check_hash": not args.any_corpus,
        }
        for run in range(1, args.runs + 1)
        for s in args.settings
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        results = []
        for result in pool.map(soak, jobs):  # in job order; saved as each arrives
            results.append(result)
            args.out.write_text(
                json.dumps(
                    {
                        "command": " ".join(sys.argv),
                        "python": platform.python_version(),
                        "torch": torch.__version__,
                        "results": results,
                    },
                    indent=1,
                )
            )
    report(results, args.png)
    if any(r["start"] != r["end"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
