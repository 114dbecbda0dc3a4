"""`gradient-cache demo --scenario larger-than-device`: under a device cap of the model's
fp32 weights, plain PyTorch runs out of memory and the cache, with the weights and the
optimizer state on the host, trains under it, bit for bit with plain PyTorch uncapped.

Its own file so pytest-xdist (one file per worker) runs it beside the other demo runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_demo import run_console_script

from gradient_cache import cli
from gradient_cache.demo import run as demo_run
from gradient_cache.demo.models import GPT_SIZES, TinyGPT
from gradient_cache.engine.units import MIB

# Both steps are measured (every step of a run under the cap is); the second has the
# optimizer state from the first.
STEPS = 2


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str, str]:
    """The scenario as shipped, only the step count lowered."""
    out = tmp_path_factory.mktemp("larger_than_device")
    return run_console_script(out, "--scenario", "larger-than-device", "--steps", str(STEPS))


def blocks_and_rest(size: str) -> tuple[int, int]:
    """(the largest block's fp32 bytes, the bytes of the weights outside the blocks)."""
    with torch.device("meta"):
        model = TinyGPT(GPT_SIZES[size])
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    everything = sum(p.numel() * 4 for p in model.parameters())
    return block, everything - sum(p.numel() * 4 for p in model.blocks.parameters())


def test_plain_runs_out_of_memory_under_the_cap_and_the_cache_trains_under_it(
    capped: tuple,
) -> None:
    report, out, stdout, _ = capped
    assert report["scenario"] == "larger-than-device"
    plain, cache = report["runs"]
    assert (plain["name"], cache["name"]) == ("plain", demo_run.WEIGHTS_RUN)
    cap = report["device_cap"]
    # The cap is the model's fp32 weights: plain's weights, gradients and AdamW's two
    # moments are four times it, and its measured peak at least three times.
    assert cap["bytes"] == report["model"]["gradient_bytes"] == 4 * report["model"]["parameters"]
    assert plain["peak_device_bytes"] >= 3 * cap["bytes"]
    assert cap["plain_under_cap_out_of_memory"].startswith("step 1, ")
    assert cap["plain_under_cap_steps_completed"] == 0
    assert cache["peak_device_bytes"] <= cap["bytes"]
    assert len(cache["losses"]) == STEPS
    assert cap["peak_over_cap"] == {
        run["name"]: run["peak_device_bytes"] / cap["bytes"] for run in (plain, cache)
    }
    # Lossless: bit for bit with plain PyTorch run without the cap (or a second plain run
    # referees, as in every scenario: perf/RESULTS.md, "Determinism").
    assert cli.check_lossless(report["lossless_max_abs_weight_diff"], report["plain_again"]) == 0
    if report["lossless_max_abs_weight_diff"] == 0:
        assert cache["losses"] == plain["losses"]
    assert cli.check_device_cap(cap) == 0
    assert "would not fit." in stdout and "of the cap: fits." in stdout
    assert "on a CPU the device is accounted, not real" in stdout
    assert "the cache trained under it" in stdout
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_the_device_holds_a_window_of_blocks_not_the_weights(capped: tuple) -> None:
    """The CPU tracker counts the weights the device holds: in forward and backward the
    rest (embeddings, final norm) and a few blocks, far below the whole model's; the
    state and the weights are in host memory (what the run reports it holds there)."""
    report, _, _, _ = capped
    if report["machine"]["device"] != "cpu":
        pytest.skip("the categories come from the CPU tracker")
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
        return run_result(
            variant, out_of_memory="step 2, backward: over" if variant.ratio else None
        )

    monkeypatch.setattr(demo_run, "_in_fresh_process", in_process)
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
    ("out_of_memory", "plain", "cache", "status", "says"),
    [
        ("step 1, forward: over", 4.2, 0.46, 0, "the cache trained under it"),
        (None, 4.2, 0.46, 1, "plain PyTorch trained under the"),
        ("step 1, forward: over", 4.2, 1.2, 1, "the cache's peak was 1.20x"),
    ],
)
def test_the_cap_check_fails_where_the_scenario_shows_nothing(
    out_of_memory: str | None,
    plain: float,
    cache: float,
    status: int,
    says: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cap = {
        "mb": 24.4,
        "plain_under_cap_out_of_memory": out_of_memory,
        "peak_over_cap": {"plain": plain, demo_run.WEIGHTS_RUN: cache},
    }
    assert cli.check_device_cap(cap) == status
    captured = capsys.readouterr()
    assert says in captured.out + captured.err


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
    its cached blocks (the weights the cache just took off the device). torch.cuda is stood
    in for: this machine has no GPU; the demo's run on one is the real test."""
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
