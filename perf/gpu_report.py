"""One-shot GPU report: memory, step time, hidden work, encode throughput, largest batch.

    python perf/gpu_report.py [--json perf/results/gpu_report.json] [--quick]

Builds a GPT-2-small-shaped TinyGPT (124M parameters) in code and prints markdown tables:

* peak device memory: plain vs cache at ratio 1 and 100, with `apply_gradients()` and with
  the fused `step()`, and the fused step with the optimizer state on the host
  (`offload_optimizer_state`), with and without 4-micro-batch gradient accumulation;
* step time against plain (the state-on-host row beside the planner's link floor: its
  gradients and state to the device at 50 GB/s), and the share of encode and copy time
  hidden under backward (CUDA events recorded by wrappers this report puts around the
  backend's `encoding` and `store`: each bucket's span from encode start to copy end; the
  engine has no timing code);
* encode throughput of the threshold selection, `torch.topk` and a device memcpy;
* the largest batch that trains under a fixed memory cap, plain vs cache.

Each section catches its own failure and reports it, so one broken section still leaves the
others' figures. Needs CUDA; `--quick` shrinks everything for a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import statistics
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import gradient_cache
from gradient_cache.codecs import TopKSelector, keep_count
from gradient_cache.demo.models import GPTConfig, TinyGPT
from gradient_cache.demo.training import micro_batches, train_step
from gradient_cache.engine.units import MIB
from gradient_cache.planner import DEFAULT_LINK_GBPS

GPT2_SMALL = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12)
QUICK = GPTConfig(vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=4)


def make_model(config: GPTConfig) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(config).cuda()


def batch(config: GPTConfig, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(config.vocab_size, (size, seq + 1), device="cuda")
    return tokens[:, :-1], tokens[:, 1:]


def build(
    config: GPTConfig, ratio: float | None, *, state_on_host: bool = False
) -> tuple[TinyGPT, gradient_cache.GradientCacheHookManager | None, torch.optim.Optimizer]:
    """A fresh model, its cache (None for plain PyTorch) and AdamW."""
    model = make_model(config)
    manager = (
        gradient_cache.create_gradient_cache(
            model, compression_ratio=ratio, offload_optimizer_state=state_on_host
        )
        if ratio
        else None
    )
    return model, manager, torch.optim.AdamW(model.parameters(), lr=1e-4)


# The variant with the optimizer state in host memory (offload_optimizer_state).
STATE_ON_HOST = "cache r=1 fused, state on host"


def variants() -> list[tuple[str, float | None, bool]]:
    return [
        ("plain", None, False),
        ("cache r=1 apply", 1, False),
        ("cache r=1 fused", 1, True),
        ("cache r=100 apply", 100, False),
        ("cache r=100 fused", 100, True),
        (STATE_ON_HOST, 1, True),
    ]


def peak_memory(config: GPTConfig, size: int, seq: int) -> list[dict[str, Any]]:
    rows = []
    for count in (1, 4):
        for name, ratio, fused in variants():
            model, manager, optimizer = build(config, ratio, state_on_host=name == STATE_ON_HOST)
            batches = micro_batches(*batch(config, size, seq), count)
            train_step(model, optimizer, manager, batches, fused=fused)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            train_step(model, optimizer, manager, batches, fused=fused)
            torch.cuda.synchronize()
            rows.append(
                {
                    "variant": name,
                    "micro_batches": count,
                    "peak_mib": torch.cuda.max_memory_allocated() / MIB,
                }
            )
            if manager is not None:
                manager.remove_hooks()
            del model, optimizer, manager
            release_device_memory()
    return rows


def release_device_memory() -> None:
    """Free what the last variant held before the next is measured.

    gc first: anything of the last variant left in a reference cycle would otherwise count
    against the next variant's peak until the next full collection.
    """
    gc.collect()
    torch.cuda.empty_cache()


def backward_only(
    model: TinyGPT,
    manager: gradient_cache.GradientCacheHookManager | None,
    data: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Forward and backward, plus the cache's drain: what the side streams must hide under."""
    model(*data)[1].backward()
    if manager is not None:
        manager.compress_and_free_gradients()
        manager.discard_gradients()  # else later repeats time merging into the store
    model.zero_grad(set_to_none=True)


def cuda_ms(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextlib.contextmanager
def side_stream_spans(backend: Any) -> Iterator[list[tuple[torch.cuda.Event, torch.cuda.Event]]]:
    """(encode start, copy end) CUDA events of each bucket launched inside the block.

    Wraps the backend's `encoding` and `store` on the instance: the start is recorded on
    the encode stream after its waits, the end on the copy stream after the copies. None
    (plain PyTorch) records nothing.
    """
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    if backend is None:
        yield spans
        return
    starts: list[torch.cuda.Event] = []
    encoding, store = backend.encoding, backend.store

    @contextlib.contextmanager
    def timed_encoding(params):
        with encoding(params):  # the encode stream is current in here
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            starts.append(start)
            yield

    def timed_store(encoded, grads):
        payloads = store(encoded, grads)
        end = torch.cuda.Event(enable_timing=True)
        end.record(backend.copy_stream)
        spans.append((starts.pop(0), end))
        return payloads

    backend.encoding, backend.store = timed_encoding, timed_store
    try:
        yield spans
    finally:
        del backend.encoding, backend.store  # the class's methods again
        torch.cuda.synchronize()


def step_time(config: GPTConfig, size: int, seq: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    plain_backward = None
    for name, ratio, fused in variants():
        model, manager, optimizer = build(config, ratio, state_on_host=name == STATE_ON_HOST)
        data = batch(config, size, seq)

        step = functools.partial(train_step, model, optimizer, manager, [data], fused=fused)
        backward = functools.partial(backward_only, model, manager, data)

        for _ in range(3):
            step()
        step_ms = cuda_ms(step, repeats)
        row: dict[str, Any] = {"variant": name, "step_ms": step_ms}
        if name == STATE_ON_HOST:
            # The planner's floor: gradients and AdamW's state (12 bytes a parameter) to
            # the device at its assumed link rate (perf.gpu_link measures the real one).
            params = sum(p.numel() for p in model.parameters())
            row["link_floor_ms"] = 12 * params / (DEFAULT_LINK_GBPS * 1e9) * 1e3
        backend = manager.engine.backend if manager is not None else None
        with side_stream_spans(backend) as spans:
            backward_ms = cuda_ms(backward, repeats)
        row["forward_backward_ms"] = backward_ms
        if plain_backward is None:
            plain_backward = backward_ms
        if spans:
            side_ms = sum(start.elapsed_time(end) for start, end in spans) / repeats
            exposed = max(0.0, backward_ms - plain_backward)
            row["encode_copy_ms"] = side_ms
            row["hidden_share"] = 1 - min(1.0, exposed / side_ms) if side_ms else None
        rows.append(row)
        if manager is not None:
            manager.remove_hooks()
        del model, optimizer, manager
        release_device_memory()
    plain = rows[0]["step_ms"]
    for row in rows:
        row["vs_plain"] = row["step_ms"] / plain
    return rows


def encode_throughput(numel: int, repeats: int) -> list[dict[str, Any]]:
    x = torch.randn(numel, device="cuda")
    k = keep_count(numel, 100)
    out = torch.empty_like(x)
    gigabytes = numel * 4 / 1e9
    cases = {
        "threshold selection": lambda: TopKSelector(method="threshold").select(x, k),
        "exact (torch.topk of |x|)": lambda: TopKSelector(method="exact").select(x, k),
        "torch.topk(x.abs(), k)": lambda: torch.topk(x.abs(), k, sorted=False),
        "device memcpy": lambda: out.copy_(x),
    }
    rows = []
    for name, fn in cases.items():
        fn()
        ms = cuda_ms(fn, repeats)
        rows.append({"method": name, "ms": ms, "gb_per_s": gigabytes / (ms / 1e3)})
    return rows


def largest_batch(config: GPTConfig, seq: int, cap_fraction: float, limit: int) -> dict[str, Any]:
    torch.cuda.set_per_process_memory_fraction(cap_fraction)
    try:
        found = {}
        for name, ratio, fused in (("plain", None, False), ("cache r=100 fused", 100, True)):
            best = 0
            size = 1
            while size <= limit:
                model, manager, optimizer = build(config, ratio)
                try:
                    for _ in range(2):
                        train_step(
                            model, optimizer, manager, [batch(config, size, seq)], fused=fused
                        )
                    torch.cuda.synchronize()
                    best = size
                    size *= 2
                except torch.cuda.OutOfMemoryError:
                    break
                finally:
                    if manager is not None:
                        manager.remove_hooks()
                    del model, optimizer, manager
                    release_device_memory()
            found[name] = best
        return {"cap_fraction": cap_fraction, "largest_batch_power_of_two": found}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def section(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    try:
        report[name] = fn()
    except Exception:  # a broken section must not hide the others' figures
        report[name] = {"error": traceback.format_exc()}
    print(f"\n## {name}\n")
    print(to_markdown(report[name]), flush=True)


def to_markdown(figures: Any) -> str:
    if isinstance(figures, dict) and "error" in figures:
        return "```\n" + figures["error"] + "```"
    rows = figures if isinstance(figures, list) else [figures]
    keys = list(dict.fromkeys(key for row in rows for key in row))  # rows differ in keys
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        values = [row.get(key, "") for key in keys]
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in values]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("perf/results/gpu_report.json"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_report.py needs a CUDA device.")
        return 2
    config, size, seq = (QUICK, 4, 128) if args.quick else (GPT2_SMALL, 8, 1024)
    repeats = 3 if args.quick else 10
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gradient_cache": gradient_cache.__version__,
        "model_parameters": TinyGPT(config).num_parameters(),
        "batch": [size, seq],
    }
    print(f"# gradient-cache GPU report\n\n{json.dumps(report, indent=1)}")
    section(report, "peak device memory", lambda: peak_memory(config, size, seq))
    section(report, "step time", lambda: step_time(config, size, seq, repeats))
    section(
        report,
        "encode throughput (16M fp32, ratio 100)",
        lambda: encode_throughput(1 << 24 if not args.quick else 1 << 20, repeats),
    )
    section(
        report,
        "largest batch under a memory cap",
        lambda: largest_batch(config, seq, 0.25, 4 if args.quick else 256),
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
