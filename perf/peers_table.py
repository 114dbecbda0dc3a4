"""The markdown tables of `perf.peers`: one per scenario, then the largest batches."""

from __future__ import annotations

from typing import Any

from gradient_cache.demo.accounting import GRADIENTS, MIB, OPTIMIZER_STATE, OTHER, PARAMETERS
from perf.peers_contenders import CONTENDERS, SCENARIOS

SCENARIO_HEADER = (
    "| contender | params | opt state | grads, end of backward | backward peak "
    "| activations and other at it | step peak | grads at it | peak | host "
    "| step time vs plain | loss | max abs Δw vs plain | max abs Δw vs its reference |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)
COLUMNS = SCENARIO_HEADER.splitlines()[0].count("|") - 2


def markdown(report: dict[str, Any]) -> str:
    """Every table of a `perf.peers` report."""
    ranks = {key: rank for rank, key in enumerate(CONTENDERS)}  # rows in a fixed order
    report = {**report, "runs": sorted(report["runs"], key=lambda run: ranks[run["key"]])}
    parts = []
    for name, scenario in SCENARIOS.items():
        lines = [
            f"### {name}: {scenario.summary}",
            "",
            "Device MiB at the last of the steps: parameters and optimizer state when backward "
            "ends, the gradients then, each phase's peak and what it held there, the overall "
            "peak (phase); host MiB when backward ends. The step in backward steps inside "
            "backward: its step shows in the backward peak.",
            "",
            SCENARIO_HEADER,
        ]
        lines += [_scenario_row(run, name) for run in report["runs"]]
        parts.append("\n".join(lines))
    parts.append(_batch_table(report))
    notes = _notes(report)
    if notes:
        parts.append("\n".join(notes))
    return "\n\n".join(parts)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _scenario_row(run: dict[str, Any], scenario: str) -> str:
    label = run["label"]
    if "error" in run:
        return f"| {label} | failed: {run['error']} |" + " |" * (COLUMNS - 1)
    row = run["scenarios"][scenario]
    if not row["supported"]:
        return f"| {label} | {row['reason']} |" + " |" * (COLUMNS - 1)
    end, phases = row["end_of_backward"], row["phases"]
    backward, step = phases["backward"], phases["optimizer"]
    timing = row["step_time"]
    diffs = row["weights"]["max_abs_diff"]
    reference = row["weights"]["exact_reference"]
    exact = "-"
    if reference is not None and reference in diffs:
        exact = f"{diffs[reference]:.3g} ({reference}; exact: 0)"
    cells = [
        _mib(end.get(PARAMETERS)),
        _mib(end.get(OPTIMIZER_STATE)),
        _mib(end.get(GRADIENTS)),
        _mib(backward["total"]),
        _mib(backward.get(OTHER)),
        _mib(step["total"]),
        _mib(step.get(GRADIENTS)),
        f"**{_mib(row['peak'])}** ({row['peak_phase']})",
        _mib(row["host_bytes"]),
        f"{timing['ratio']:.2f}x ({timing['ratio_min']:.2f}-{timing['ratio_max']:.2f})",
        f"{row['loss']:.4f}",
        f"{diffs['plain']:.3g}" if "plain" in diffs else "-",
        exact,
    ]
    return f"| {label} | " + " | ".join(cells) + " |"


def _batch_table(report: dict[str, Any]) -> str:
    lines = [
        "### Largest S1 batch within the budget (plain's peak at S1's batch of 4)",
        "",
        "| contender | with checkpointing | without checkpointing | probes (batch: peak MiB) |",
        "|---|---:|---:|---|",
    ]
    for run in report["runs"]:
        search = run.get("batch_search")
        if search is None:
            continue
        if "supported" in search:  # the contender did not run S1
            lines.append(f"| {run['label']} | {search['reason']} | | |")
            continue
        cells, probes = [], []
        for name, found in search.items():
            capped = "≥ " if found["capped"] else ""
            cells.append(f"{capped}{found['largest']} (budget {_mib(found['budget'])})")
            probed = sorted((int(b), p) for b, p in found["probes"].items())  # JSON keys: text
            shown = ", ".join(f"{b}: {_mib(p)}" for b, p in probed)
            probes.append(f"{name}: {shown}")
        lines.append(f"| {run['label']} | " + " | ".join(cells) + " | " + "; ".join(probes) + " |")
    return "\n".join(lines)


def _notes(report: dict[str, Any]) -> list[str]:
    """What a reader must know besides the cells: compilation time, the machine's load."""
    notes = []
    for run in report["runs"]:
        if CONTENDERS[run["key"]].optimizer != "torchao":
            continue
        firsts = [
            f"{name} {row['first_step_seconds']:.0f} s"
            for name, row in run.get("scenarios", {}).items()
            if row.get("first_step_seconds") is not None
        ]
        if firsts:
            notes.append(
                f"* {run['label']}: first step {', '.join(firsts)}: torch.compile of the "
                "optimizer step, per tensor shape, in a process's first step (S1's); the "
                "step-time ratios are taken after it."
            )
    share = report.get("others_cpu_share")
    if share is not None:
        notes.append(f"* Other processes used {share:.0%} of the machine's CPU during the run.")
    return notes
