"""What `gradient-cache demo` hands back: the printed table, report.json and report.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..stats import MIB
from .run import FINAL_LOSS_STEPS, PLAIN_UNDER_CAP, DemoResult, RunResult
from .training import PHASES

MATPLOTLIB_MISSING = (
    "gradient-cache demo draws report.png with matplotlib, which is not installed. "
    "Install it with: pip install 'gradient-cache[demo]'"
)


def check_matplotlib() -> None:
    """Raise ImportError with the install command if matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(MATPLOTLIB_MISSING) from error


def format_table(result: DemoResult) -> str:
    """A markdown table of the runs, then what the figures mean."""
    header = (
        "| run | peak device MiB | optimizer-step peak MiB | gradients offloaded MiB "
        "| host held MiB | peak RSS MiB | median step ms | train loss | val loss "
        "| max abs weight diff vs plain |"
    )
    rows = [header, "|---|" + "---:|" * 9]
    for run in result.runs:
        figures = _figures(result, run)
        difference = "-" if run.ratio is None else f"{figures['max_abs_weight_diff_vs_plain']:.3g}"
        rows.append(
            f"| {run.name} | {figures['peak_device_mb']:.1f} "
            f"| {figures['phase_peak_mb']['optimizer']:.1f} "
            f"| {figures['offloaded_gradient_mb']:.1f} | {figures['host_held_mb']:.2f} "
            f"| {figures['peak_rss_mb']:.0f} | {figures['median_step_ms']:.0f} "
            f"| {figures['final_train_loss']:.3f} | {figures['val_loss']:.3f} | {difference} |"
        )
    settings, model, plain = result.settings, result.model, result.runs[0]
    measured = [m.step for m in plain.memory]
    notes = [
        "",
        f"Scenario {model['scenario']!r}: {model['scenario_summary']}.",
        f"TinyGPT {settings.model_size!r}: {model['parameters'] / 1e6:.2f}M parameters, "
        f"{model['gradient_bytes'] / MIB:.1f} MiB of gradients; {settings.steps} steps of "
        f"batch {model['batch_size']} ({model['micro_batches']} x {model['micro_batch_size']}) "
        f"on {settings.device_label}, AdamW, buckets of {model['bucket_size_mb']:g} MiB, seed "
        f"{settings.seed}.",
        f"Device memory: {result.memory_method}"
        + ("" if len(measured) == settings.steps else f", on steps {', '.join(map(str, measured))}")
        + ".",
        "Peak below plain's: "
        + "; ".join(
            f"{run.name} {(plain.peak_device_bytes - run.peak_device_bytes) / MIB:.1f} MiB "
            f"({peak_saving_share(plain, run):.0%} of what it offloads)"
            for run in result.runs[1:]
        )
        + ". Peak device memory falls only where gradients were part of it: the cache takes "
        "them off the device during backward, and its fused step restores one bucket at a time"
        + _offload_note(result),
        lowest_peak_note(result),
        "Gradients offloaded: dense bytes taken off the device each step; host held: what "
        "they take there after the last step, error-feedback residuals and a host-held "
        "optimizer state and weights included. Peak RSS: each run's own process.",
        f"Train loss: mean of the last {min(settings.steps, FINAL_LOSS_STEPS)} steps. "
        "Step time: median over "
        + (
            "every step." if plain.timed_steps == measured else "the steps not measured for memory."
        ),
        *cap_notes(result),
    ]
    return "\n".join(rows + notes)


def _offload_note(result: DemoResult) -> str:
    """The end of the note on what lowers the peak: what the scenario's last run offloads."""
    if result.cap_bytes is not None:
        return (
            "; with the weights and the state on host, the device holds about two blocks' "
            "weights in forward and backward and two buckets' weights, gradients and AdamW "
            "state at the step (what it offloads counts all three)."
        )
    notes = []
    if any(run.offloaded_state_bytes and not run.offloaded_weight_bytes for run in result.runs):
        notes.append(
            "with the state on host, the AdamW state is in host memory too, on the device a "
            "bucket's at a time at the step"
        )
    if any(run.offloaded_weight_bytes for run in result.runs):
        notes.append(
            "with the weights and the state on host, the weights' masters as well, on the "
            "device a window of the weights at a time"
        )
    if not notes:
        return "."
    return "; " + "; ".join(notes) + " (what a run offloads counts all it keeps on the host)."


def lowest_peak_run(result: DemoResult) -> RunResult:
    """The run whose peak device memory is the lowest (the first of equals)."""
    return min(result.runs, key=lambda run: run.peak_device_bytes)


def lowest_peak_note(result: DemoResult) -> str:
    """Which run has the lowest peak, and how it compares with plain's."""
    plain, best = result.runs[0], lowest_peak_run(result)
    if best is plain:
        peak = plain.peak_device_bytes / MIB
        return f"Lowest peak: plain's, {peak:.1f} MiB (no cache run's is lower)."
    return (
        f"Lowest peak: {best.name}, {best.peak_device_bytes / MIB:.1f} MiB, "
        f"{best.peak_device_bytes / plain.peak_device_bytes:.0%} of plain's "
        f"{plain.peak_device_bytes / MIB:.1f} MiB."
    )


def cap_notes(result: DemoResult) -> list[str]:
    """What the runs did against the scenario's device cap (none without one)."""
    if result.cap_bytes is None:
        return []
    cap = result.cap_bytes
    weights = result.model["gradient_bytes"]  # fp32: the weights' bytes
    plain, cache = result.runs[0], result.runs[-1]
    if result.settings.emulated:
        where = (
            "the emulated device's allocator: torch.OutOfMemoryError past it, on every step, "
            "at placement too"
        )
    elif result.settings.device.type == "cuda":
        where = "torch.cuda.set_per_process_memory_fraction"
    else:
        where = (
            "on a CPU the device is accounted, not real: on the steps it measures, the "
            "tracker raises out-of-memory past the cap, as a GPU's allocator would; at "
            "placement, by arithmetic, the weights' bytes against the cap"
        )
    return [
        f"Device cap: {cap / MIB:.1f} MiB, half the model's fp32 weights "
        f"({weights / MIB:.1f} MiB), before anything is placed on the device ({where}).",
        f"{PLAIN_UNDER_CAP}: {plain_under_cap_outcome(result)}",
        f"{plain.name} (uncapped): peak {plain.peak_device_bytes / MIB:.1f} MiB, "
        f"{plain.peak_device_bytes / cap:.1f}x the cap: "
        + ("would not fit." if plain.peak_device_bytes > cap else "fits."),
        f"{cache.name}: peak {cache.peak_device_bytes / MIB:.1f} MiB{_accounted(cache)}, "
        f"{cache.peak_device_bytes / cap:.0%} of the cap: "
        + ("fits." if cache.peak_device_bytes <= cap else "would not fit."),
    ]


def plain_under_cap_outcome(result: DemoResult) -> str:
    """What plain PyTorch did under the device cap, in a sentence."""
    assert result.cap_bytes is not None  # called only with a cap
    under = result.plain_under_cap
    if under is None or under.out_of_memory is None:
        return "trained to the end: it did not run out of memory."
    if under.refused_at_placement:
        error = under.out_of_memory.split(": ", 1)[1]
        how = (
            error  # `place`: the CPU stand-in has no allocator to refuse it
            if result.settings.device.type == "cpu" and not result.settings.emulated
            else f"model.to(device) raised torch.OutOfMemoryError: {error}"
        )
        return (
            f"refused at placement: its fp32 weights ({result.model['gradient_bytes'] / MIB:.1f} "
            f"MiB) exceed the cap ({result.cap_bytes / MIB:.1f} MiB) ({how.rstrip('.')})."
        )
    return f"out of memory at {under.out_of_memory}."


def _accounted(run: RunResult) -> str:
    """Beside an allocator's peak, the tensor tracker's (the emulated device)."""
    accounted = run.peak_accounted_bytes
    if accounted is None:
        return ""
    return f" by the allocator ({accounted / MIB:.1f} MiB by tensor accounting)"


def report_dict(result: DemoResult, *, args: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the demo, JSON-ready."""
    lossless = result.runs[1]
    return {
        "args": args,
        "machine": result.machine,
        "model": result.model,
        "memory_method": result.memory_method,
        "scenario": result.settings.scenario,
        "phases": list(PHASES),
        "lossless_max_abs_weight_diff": result.weight_difference(lossless),
        "lowest_peak_run": lowest_peak_run(result).name,
        "plain_again": None
        if result.plain_again is None
        else {
            "max_abs_weight_diff_vs_plain": result.weight_difference(result.plain_again),
            "max_abs_weight_diff_vs_lossless": result.weight_difference(
                lossless, plain=result.plain_again
            ),
        },
        "wall_seconds": result.wall_seconds,
        "runs": [_figures(result, run) | _series(run) for run in result.runs],
    } | ({} if result.cap_bytes is None else {"device_cap": _cap_figures(result)})


def _cap_figures(result: DemoResult) -> dict[str, Any]:
    assert result.cap_bytes is not None  # called only with a cap
    under = result.plain_under_cap
    return {
        "bytes": result.cap_bytes,
        "mb": result.cap_bytes / MIB,
        "weights_bytes": result.model["gradient_bytes"],
        "enforced_by": "emulated device's allocator"
        if result.settings.emulated
        else "torch.cuda.set_per_process_memory_fraction"
        if result.settings.device.type == "cuda"
        else "tensor accounting (steps measured) and arithmetic (placement)",
        "plain_under_cap_out_of_memory": None if under is None else under.out_of_memory,
        "plain_under_cap_refused_at_placement": under is not None and under.refused_at_placement,
        "plain_under_cap_outcome": plain_under_cap_outcome(result),
        "plain_under_cap_steps_completed": None if under is None else len(under.losses),
        "peak_over_cap": {
            run.name: run.peak_device_bytes / result.cap_bytes for run in result.runs
        },
        # Beside the allocator's peaks (the emulated device), the tensor tracker's; else None.
        "accounted_peak_over_cap": {
            run.name: None
            if run.peak_accounted_bytes is None
            else run.peak_accounted_bytes / result.cap_bytes
            for run in result.runs
        },
    }


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_plot(result: DemoResult, path: Path) -> None:
    """report.png: device memory over one step per run (left) and the loss curves (right)."""
    check_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # Agg, without touching pyplot's global backend
    memory_axes, loss_axes = figure.subplots(1, 2)
    for index, phase in enumerate(PHASES):
        memory_axes.axvspan(index, index + 1, color=f"C{7 + index % 2}", alpha=0.08, lw=0)
        memory_axes.text(
            index + 0.5, 0.4, phase, ha="center", transform=memory_axes.get_xaxis_transform()
        )
    # Lossless training repeats plain's curves exactly: distinct styles keep both visible.
    styles: tuple[dict[str, Any], ...] = (
        {"lw": 4, "alpha": 0.5},
        {"lw": 1.5, "ls": "--"},
        {"lw": 1.5},
        {"lw": 1.5, "ls": ":"},
        {"lw": 1.5, "ls": "-."},
    )
    for run, style in zip(result.runs, styles[: len(result.runs)], strict=True):
        step = run.memory[-1]  # the last measured step: optimizer state exists by then
        xs, ys = [0.0], [step.start_bytes / MIB]
        for index, phase in enumerate(PHASES):
            xs += [index + 0.5, index + 1.0]
            ys += [step.phases[phase].peak_bytes / MIB, step.phases[phase].end_bytes / MIB]
        line = memory_axes.plot(xs, ys, marker="o", **style)  # the loss plot's legend names it
        color = line[0].get_color()
        loss_axes.plot(range(1, len(run.losses) + 1), run.losses, label=run.name, **style)
        loss_axes.scatter(  # plain's circle stays visible around the lossless run's cross
            [len(run.losses) * 1.03 + 0.5],  # just right of the curves' ends
            [run.val_loss],
            s=80,
            **(
                {"marker": "o", "facecolors": "none", "edgecolors": color}
                if run.ratio is None
                else {"marker": "x", "color": color}
            ),
        )
    plain = result.runs[0]
    memory_axes.axhline(plain.peak_device_bytes / MIB, color="C0", lw=0.8, ls=":")
    if result.cap_bytes is not None:
        memory_axes.axhline(result.cap_bytes / MIB, color="C3", lw=1.5, ls="-.")
        memory_axes.annotate(
            f"device cap {result.cap_bytes / MIB:.1f} MiB",
            (0.02, result.cap_bytes / MIB),
            xytext=(0, 3),
            textcoords="offset points",
            color="C3",
            fontsize=9,
        )
    savings = [
        f"{run.name}: peak {(plain.peak_device_bytes - run.peak_device_bytes) / MIB:.1f} MiB "
        f"below plain's ({peak_saving_share(plain, run):.0%} of what it offloads)"
        for run in result.runs[1:]
    ]
    if result.cap_bytes is not None:
        savings += [
            f"{run.name}: peak {run.peak_device_bytes / result.cap_bytes:.2f}x the cap"
            for run in result.runs
        ]
        under = result.plain_under_cap
        if under is not None and under.refused_at_placement:
            savings.append(f"{under.name}: refused at placement (weights > cap)")
        elif under is not None and under.out_of_memory is not None:
            savings.append(f"{under.name}: out of memory ({under.out_of_memory.split(':')[0]})")
    memory_axes.text(
        0.5,
        0.98,
        "\n".join(savings),
        ha="center",
        va="top",
        fontsize=9,
        transform=memory_axes.transAxes,
        bbox={"facecolor": "white", "alpha": 0.8},
    )
    where = (
        "the emulated device's allocator"
        if result.settings.emulated
        else "CUDA allocator"
        if result.settings.device.type == "cuda"
        else "accounted on the CPU"
    )
    memory_axes.set(
        title=f"Device memory over step {result.runs[0].memory[-1].step} ({where})",
        xticks=[i / 2 for i in range(2 * len(PHASES) + 1)],
        xticklabels=["start", *["peak", "end"] * len(PHASES)],
        ylabel="MiB",
        xlim=(0, len(PHASES)),
    )
    # Head room above the highest peak for the savings' box (twice the lines with a cap);
    # a little more per line past three (the memory-bound scenario's five runs).
    head_room = 1.5 if result.cap_bytes is not None else max(1.3, 1.1 + 0.06 * len(savings))
    memory_axes.set_ylim(0, head_room * max(run.peak_device_bytes for run in result.runs) / MIB)
    loss_axes.set(
        title="Training loss per step (marker: validation loss at the end)",
        xlabel="step",
        ylabel="cross-entropy",
    )
    loss_axes.legend()
    figure.suptitle(
        f"gradient-cache demo, scenario {result.settings.scenario!r}: TinyGPT "
        f"{result.settings.model_size!r}, {result.settings.steps} steps on "
        f"{result.settings.device_label}"
    )
    figure.savefig(path)


def peak_saving_share(plain: RunResult, run: RunResult) -> float:
    """How far ``run``'s peak is below plain's, as a share of the bytes it offloads (its
    gradients, and its optimizer state where it keeps that on the host)."""
    if not run.offloaded_bytes:
        return 0.0
    return (plain.peak_device_bytes - run.peak_device_bytes) / run.offloaded_bytes


def _figures(result: DemoResult, run: RunResult) -> dict[str, Any]:
    summary = run.summary or {}
    return {
        "name": run.name,
        "compression_ratio": run.ratio,
        "peak_device_bytes": run.peak_device_bytes,
        "peak_device_mb": run.peak_device_bytes / MIB,
        # Beside an allocator's peak (the emulated device), the tensor tracker's; else None.
        "peak_accounted_device_bytes": run.peak_accounted_bytes,
        "phase_peak_bytes": {p: run.phase_peak_bytes(p) for p in PHASES},
        "phase_peak_mb": {p: run.phase_peak_bytes(p) / MIB for p in PHASES},
        "offloaded_gradient_bytes": run.offloaded_gradient_bytes,
        "offloaded_gradient_mb": summary.get("memory_saved_mb", 0.0),
        "offloaded_state_bytes": run.offloaded_state_bytes,
        "stored_gradient_mb": summary.get("stored_gradient_mb", 0.0),
        "host_held_mb": summary.get("host_held_mb", 0.0)
        + summary.get("optimizer_state_host_mb", 0.0)
        + summary.get("parameters_host_mb", 0.0),
        "process_rss_mb": run.process_rss_mb,
        "peak_rss_mb": run.peak_rss_mb,
        "median_step_ms": run.median_step_ms,
        "final_train_loss": run.final_train_loss,
        "val_loss": run.val_loss,
        "max_abs_weight_diff_vs_plain": result.weight_difference(run),
        "peak_saving_share_of_offloaded": peak_saving_share(result.runs[0], run),
    }


def _series(run: RunResult) -> dict[str, Any]:
    return {
        "losses": run.losses,
        "step_ms": [s * 1e3 for s in run.step_seconds],
        "timed_steps": run.timed_steps,
        "memory": [
            {
                "step": m.step,
                "start_bytes": m.start_bytes,
                "phases": {
                    name: {
                        "peak_bytes": p.peak_bytes,
                        "end_bytes": p.end_bytes,
                        "peak_by_category_bytes": p.peak_by_category,
                    }
                    for name, p in m.phases.items()
                },
            }
            for m in run.memory
        ],
        "compression_summary": run.summary,
    }
