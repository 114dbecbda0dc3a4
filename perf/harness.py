"""What the perf tests share: run mode, the rows they record, and the markdown tables.

The tests record one row per measurement with `record`; at the end of a run with
benchmarks enabled, perf/conftest.py prints the tables `render` makes from them, ready
for perf/RESULTS.md. With benchmarks disabled (the default) every test runs once on tiny
sizes as a smoke test and nothing is printed.
"""

from __future__ import annotations

import platform
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from gradient_cache.engine.units import MIB as MIB  # re-exported: perf/test_bench_step.py reads it
from perf import memory_report

GB = 1e9

ROWS: dict[str, list[dict[str, Any]]] = defaultdict(list)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def benchmarks_enabled(config: pytest.Config) -> bool:
    """pytest-benchmark's own rule: ``--benchmark-enable`` overrides ``--benchmark-disable``."""
    return not config.getoption("benchmark_disable") or config.getoption("benchmark_enable")


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    machine_busy: float  # CPU seconds of every process since boot
    own: float  # CPU seconds of this process


def cpu_snapshot() -> CpuSnapshot:
    machine, own = psutil.cpu_times(), psutil.Process().cpu_times()
    busy = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    return CpuSnapshot(time.perf_counter(), busy + machine.steal, own.user + own.system)


def others_share(start: CpuSnapshot, end: CpuSnapshot) -> float:
    """Share of the machine's CPU capacity other processes used between two snapshots.

    On a shared machine this says whether a timing was taken alone (near 0) or not.
    """
    capacity = (end.wall - start.wall) * (psutil.cpu_count() or 1)
    others = (end.machine_busy - start.machine_busy) - (end.own - start.own)
    return min(1.0, max(0.0, others / capacity)) if capacity > 0 else 0.0


def record(table: str, **row: Any) -> None:
    ROWS[table].append(row)


def render() -> str:
    """Markdown tables of everything recorded, in a fixed order."""
    parts = [renderer(ROWS[name]) for name, renderer in _RENDERERS.items() if ROWS.get(name)]
    return "\n\n".join(parts)


def _codec(rows: list[dict[str, Any]]) -> str:
    """Throughput per operation, size and ratio, with the speed-up over torch.topk."""
    topk = {(r["op"], r["numel"], r["ratio"]): r["ms"] for r in rows if r["method"] == "torch.topk"}
    lines = [
        "| op | method | elements | ratio | median ms | GB/s | vs torch.topk | others' CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        reference = topk.get((r["op"], r["numel"], r["ratio"]))
        speedup = f"{reference / r['ms']:.1f}x" if reference and r["ratio"] else ""
        ratio = r["ratio"] or ""
        lines.append(
            f"| {r['op']} | {r['method']} | {r['numel']:,} | {ratio} | {r['ms']:.2f} | "
            f"{r['gb_per_s']:.2f} | {speedup} | {r['others_cpu']:.0%} |"
        )
    return "\n".join(lines)


def _steps(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | median ms | paired plain ms | paired ratio (median) | ratio range "
        "| host store MiB | process RSS MiB | others' CPU |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['ms']:.1f} | {r['plain_ms']:.1f} | {r['ratio']:.3f}x | "
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f} | {r['host_store_mib']:.2f} | "
            f"{r['rss_mib']:.0f} | {r['others_cpu']:.0%} |"
        )
    return "\n".join(lines)


def _memory(rows: list[dict[str, Any]]) -> str:
    return memory_report.markdown([memory_report.MemoryFigures(**row) for row in rows])


_RENDERERS = {"codec": _codec, "step": _steps, "memory": _memory}
