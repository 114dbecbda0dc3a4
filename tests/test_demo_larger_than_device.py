"""`gradient-cache demo --scenario larger-than-device --device emulated`: on the emulated
device, its allocator capped at half the model's fp32 weights, plain PyTorch cannot place
the model and the cache, set up from the host with the weights and the optimizer state
there, trains under the cap, bit for bit with plain PyTorch uncapped.

Its own file so pytest-xdist (one file per worker) runs it beside the other demo runs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from test_demo import run_in_process

from gradient_cache import cli
from gradient_cache.demo import run as demo_run
from gradient_cache.demo.models import GPT_SIZES, TinyGPT
from gradient_cache.engine.units import MIB
from gradient_cache.testing import EmulatedDeviceError

# Both steps are measured (the tracker beside the allocator; the allocator holds the cap on
# every step); the second has the optimizer state from the first.
STEPS = 2


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str, str]:
    """The scenario as shipped on the emulated device, only the step count lowered, by the
    command's ``main`` in this process (test_demo.py runs the console script itself). Each
    run installs the device in its own process (this one never does)."""
    out = tmp_path_factory.mktemp("larger_than_device")
    return run_in_process(
        out, "--scenario", "larger-than-device", "--device", "emulated", "--steps", str(STEPS)
    )


def blocks_and_rest(size: str) -> tuple[int, int]:
    """(the largest block's fp32 bytes, the bytes of the weights outside the blocks)."""
    with torch.device("meta"):
        model = TinyGPT(GPT_SIZES[size])
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    everything = sum(p.numel() * 4 for p in model.parameters())
    return block, everything - sum(p.numel() * 4 for p in model.blocks.parameters())


def test_plain_is_refused_at_placement_and_the_cache_trains_under_the_cap(
    capped: tuple,
) -> None:
    report, out, stdout, _ = capped
    assert report["scenario"] == "larger-than-device"
    assert report["machine"]["device"] == "emu"
    plain, cache = report["runs"]
    assert (plain["name"], cache["name"]) == ("plain", demo_run.WEIGHTS_RUN)
    cap = report["device_cap"]
    weights = report["model"]["gradient_bytes"]
    assert weights == cap["weights_bytes"] == 4 * report["model"]["parameters"]  # fp32
    assert 0 < cap["bytes"] <= weights // 2
    assert cap["enforced_by"] == "emulated device's allocator"
    # Plain PyTorch: model.to(device) raised the allocator's out-of-memory error; nothing ran.
    assert cap["plain_under_cap_refused_at_placement"] is True
    assert cap["plain_under_cap_out_of_memory"].startswith("placement: Emulated device out of")
    assert cap["plain_under_cap_steps_completed"] == 0
    # Uncapped, the allocator held its weights, gradients and AdamW's two moments at once.
    assert plain["peak_device_bytes"] >= 4 * weights
    # The cache: the allocator's peak within the cap (which it also enforced, on every step
    # and at set-up), and the tensor accounting's beside it, within it too.
    assert cache["peak_device_bytes"] <= cap["bytes"]
    accounted = cache["peak_accounted_device_bytes"]
    assert accounted is not None and 0 < accounted <= cap["bytes"]
    assert len(cache["losses"]) == STEPS
    assert cap["peak_over_cap"] == {
        run["name"]: run["peak_device_bytes"] / cap["bytes"] for run in (plain, cache)
    }
    # Lossless: bit for bit with plain PyTorch run without the cap, or with a second plain
    # run where the first left the common path (perf/RESULTS.md, "Determinism").
    assert cli.check_lossless(report["lossless_max_abs_weight_diff"], report["plain_again"]) == 0
    if report["plain_again"] is None:
        assert report["lossless_max_abs_weight_diff"] == 0
        assert cache["losses"] == plain["losses"]
    else:
        assert report["plain_again"]["max_abs_weight_diff_vs_lossless"] == 0
    assert cli.check_device_cap(cap) == 0
    # The report names the cap and says that the weights alone did not fit.
    assert f"Device cap: {cap['mb']:.1f} MiB, half the model's fp32 weights" in stdout
    assert (
        f"{demo_run.PLAIN_UNDER_CAP}: refused at placement: its fp32 weights "
        f"({weights / MIB:.1f} MiB) exceed the cap ({cap['mb']:.1f} MiB) (model.to(device) "
        "raised torch.OutOfMemoryError: Emulated device out of memory" in stdout
    )
    assert "would not fit." in stdout and "by tensor accounting), " in stdout
    assert "of the cap: fits." in stdout
    assert "plain PyTorch was refused at placement" in stdout
    assert "the cache trained under it" in stdout
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_the_device_holds_a_window_of_blocks_not_the_weights(capped: tuple) -> None:
    """The tensor tracker (beside the allocator) counts the weights the device holds: in
    forward and backward the rest (embeddings, final norm) and a few blocks, far below the
    whole model's; the state and the weights are in host memory (what the run reports it
    holds there)."""
    report, _, _, _ = capped
    if report["machine"]["device"] not in ("cpu", "emu"):
        pytest.skip("the categories come from the tensor tracker")
    _, cache = report["runs"]
    block, rest = blocks_and_rest(report["model"]["size"])
    for phase in ("forward", "backward", "optimizer"):
        held = max(
            m["phases"][phase]["peak_by_category_bytes"]["parameters"] for m in cache["memory"]
        )
        assert 0 < held <= rest + 3 * block, (phase, held / MIB)
    weights = report["model"]["gradient_bytes"]
    assert cache["offloaded_state_bytes"] >= 2 * weights
    assert cache["host_held_mb"] * MIB >= 4 * weights  # gradients, two moments, masters


def run_result(
    variant: demo_run.Variant, *, out_of_memory: str | None = None
) -> demo_run.RunResult:
    return demo_run.RunResult(
        name=variant.name, ratio=variant.ratio, losses=[], step_seconds=[], timed_steps=[],
        memory=[], val_loss=0.0, process_rss_mb=0.0, peak_rss_mb=0.0, summary=None,
        weights={"w": torch.zeros(2)}, out_of_memory=out_of_memory,
    )  # fmt: skip


def test_the_runs_of_the_scenario_and_a_cache_out_of_memory_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The processes are stood in for (their training is tested above): plain under the
    cap first, then plain and the cache; a cache run that ran out of memory under the cap
    fails the demo, naming the run and where."""
    started = []

    def in_process(function, variant: demo_run.Variant, settings) -> demo_run.RunResult:
        started.append(variant)
        if variant.ratio:
            return run_result(variant, out_of_memory="step 2, backward: over")
        return run_result(variant, out_of_memory="placement: over" if variant.capped else None)

    monkeypatch.setattr(demo_run, "fresh_processes", lambda: contextlib.nullcontext(in_process))
    settings = demo_run.DemoSettings(
        steps=2, ratio=3.0, model_size="bytes", device=torch.device("cpu"), seed=0,
        scenario="larger-than-device",
    )  # fmt: skip
    with pytest.raises(
        demo_run.DeviceCapExceeded,
        match=r"'cache r=1, weights and state on host' ran out of memory .* at step 2, backward",
    ):
        demo_run.run_demo(settings)
    assert [(v.name, v.capped, v.weights_on_host) for v in started] == [
        (demo_run.PLAIN_UNDER_CAP, True, False),
        ("plain", False, False),
        (demo_run.WEIGHTS_RUN, True, True),
    ]
    assert started[2].state_on_host and started[2].ratio == 1


@pytest.mark.parametrize(
    ("out_of_memory", "placement", "plain", "cache", "status", "says"),
    [
        ("placement: over", True, 8.3, 0.65, 0, "at placement, its fp32 weights 2.0x the cap,"),
        ("step 1, forward: over", False, 8.3, 0.65, 0, "plain PyTorch ran out of memory"),
        (None, False, 8.3, 0.65, 1, "plain PyTorch trained under the"),
        ("placement: over", True, 8.3, 1.2, 1, "the cache's peak was 1.20x"),
    ],
)
def test_the_cap_check_fails_where_the_scenario_shows_nothing(
    out_of_memory: str | None,
    placement: bool,
    plain: float,
    cache: float,
    status: int,
    says: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cap = {
        "mb": 13.7,
        "bytes": 14_359_296,
        "weights_bytes": 28_718_592,
        "plain_under_cap_out_of_memory": out_of_memory,
        "plain_under_cap_refused_at_placement": placement,
        "peak_over_cap": {"plain": plain, demo_run.WEIGHTS_RUN: cache},
    }
    assert cli.check_device_cap(cap) == status
    captured = capsys.readouterr()
    assert says in captured.out + captured.err


def test_on_the_cpu_stand_in_placement_is_refused_by_arithmetic() -> None:
    """Without the emulated device (--device cpu) no allocator holds the cap: placing plain
    PyTorch's model is refused where its weights' bytes exceed the cap, and says how."""
    model = TinyGPT(GPT_SIZES["tiny"])
    weights = sum(p.numel() * 4 for p in model.parameters())
    cpu = torch.device("cpu")
    with pytest.raises(torch.OutOfMemoryError, match="by arithmetic on the CPU stand-in"):
        demo_run.place(model, cpu, weights // 2)
    assert demo_run.place(model, cpu, weights) is model
    assert demo_run.place(model, cpu, None) is model


def test_on_cuda_the_cap_is_held_before_anything_is_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capped run's device: CUDA's cap set before the model or the cache touch it; the
    uncapped run's left alone. torch.cuda is not touched: this machine has no GPU."""
    held: list[tuple[torch.device, int]] = []
    monkeypatch.setattr(demo_run, "hold_cuda_cap", lambda device, cap: held.append((device, cap)))
    device = torch.device("cuda", 0)
    settings = demo_run.DemoSettings(
        steps=1, ratio=3.0, model_size="bytes-xl", device=device, seed=0,
        scenario="larger-than-device",
    )  # fmt: skip
    assert demo_run.run_device(settings, None) == device and held == []
    assert demo_run.run_device(settings, 123) == device and held == [(device, 123)]


def test_the_emulated_device_runs_this_scenario_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--device", "emulated", "--scenario", "activations"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "'emulated' runs --scenario larger-than-device only" in message


def test_the_default_model_is_the_devices(capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU's allocator needs a cap of a GiB (its workspace, its 20 MiB segments): the
    scenario's model on CUDA is the larger one."""
    scenario = demo_run.SCENARIOS["larger-than-device"]
    assert scenario.default_model_size(torch.device("cpu")) == "bytes"
    assert scenario.default_model_size(torch.device("cuda", 0)) == "bytes-xl"
    assert (
        demo_run.SCENARIOS["memory-bound"].default_model_size(torch.device("cuda", 0)) == "medium"
    )


def test_on_cuda_the_cap_is_the_allocators_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA cap is the share of the device the cap is, set after the allocator returned
    its cached blocks, so it counts what is in use. torch.cuda is stood in for: this machine
    has no GPU; the demo's run on one is the real test."""
    calls: list[tuple[str, object]] = []

    class Properties:
        total_memory = 100 * MIB

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache", None)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, device: calls.append(("fraction", (fraction, device))),
    )
    device = torch.device("cuda", 1)
    demo_run.hold_cuda_cap(device, 25 * MIB)
    assert calls == [("empty_cache", None), ("fraction", (0.25, device))]


def test_an_emulated_device_that_cannot_be_built_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The device is built in the first run's process; its error (no compiler, say) reaches
    the command line as the one line it is, with exit status 1."""

    def unbuildable(settings: demo_run.DemoSettings) -> None:
        assert settings.emulated and settings.device == torch.device("cpu")
        raise EmulatedDeviceError("needs a C++ compiler")

    monkeypatch.setattr(cli, "run_demo", unbuildable)
    argv = ["demo", "--scenario", "larger-than-device", "--device", "emulated"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 1
    assert "gradient-cache: error: needs a C++ compiler" in capsys.readouterr().err
