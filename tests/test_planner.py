"""`gradient-cache plan`: its figures against what the engine itself holds, and its CLI.

tests/test_demo.py checks it against the demo's measured memory too.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest
import torch
from helpers import batches, loss_of, make_model
from stream_checker import FakeCuda, StreamChecker

import gradient_cache
from gradient_cache import Ladder, TopK, cli
from gradient_cache.engine.config import EngineConfig
from gradient_cache.engine.factory import build_cuda_backend
from gradient_cache.engine.route import planner
from gradient_cache.planner import (
    GRADIENTS_AT_STEP,
    GRADIENTS_IN_BACKWARD,
    WAYS,
    PlanInputs,
    plan,
    tensors_of_count,
    tensors_of_factory,
)

ROOT = Path(__file__).resolve().parents[1]


def sizes(model: torch.nn.Module) -> list[int]:
    return [p.numel() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize(
    ("ratio", "codec"),
    [(1, None), (100, "topk"), (4, None), (100, None), (1, "q2"), (1, "int8")],
    ids=["lossless", "top-k with error feedback", "default", "ladder at 100", "q2", "int8"],
)
def test_host_figures_are_what_a_manager_holds_after_a_step(ratio: float, codec: str) -> None:
    """The planner and the engine share each parameter's route: their bytes agree to the
    byte (exact selection keeps exactly keep_count entries)."""
    exact = {None: Ladder(selection="exact"), "topk": TopK(selection="exact")}.get(codec, codec)
    config = EngineConfig(min_compress_numel=1024, codec=exact)
    model = make_model()
    figures = plan(PlanInputs(tensors=sizes(model), compression_ratio=ratio, config=config))
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=ratio, config=config)
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    manager.step(torch.optim.SGD(model.parameters(), lr=0.1))
    summary = manager.get_compression_summary()
    manager.remove_hooks()
    assert figures.host["stored gradients"] == sum(
        layer["stored_bytes"] for layer in summary["layers"].values()
    )
    assert figures.host["error-feedback residual"] == summary["residual_mb"] * 2**20
    assert (figures.host["error-feedback residual"] > 0) == (codec == "topk")


@pytest.mark.parametrize("ratio", [1, 100])
def test_pinned_pool_is_the_cuda_backends_pool(ratio: float) -> None:
    model = make_model()
    config = EngineConfig(min_compress_numel=1024)
    cuda = FakeCuda(StreamChecker())
    params = list(model.parameters())
    backend = build_cuda_backend(
        params,
        config,
        torch.device("cpu"),
        plan=planner(params, config, ratio=ratio),
        cuda=cuda,
        allocate=cuda.allocate_pinned,
    )
    figures = plan(PlanInputs(tensors=sizes(model), compression_ratio=ratio, config=config))
    assert figures.host["pinned pool (CUDA)"] == backend.pool.capacity_bytes


def test_device_figures_follow_the_engines_bounds() -> None:
    tensors = tensors_of_count(10_000_000, largest=1_000_000)
    assert sum(tensors) == 10_000_000 and max(tensors) == 1_000_000
    figures = plan(PlanInputs(tensors=tensors, optimizer_state_bytes=8, optimizer_tensor_bytes=0))
    grads, bucket = 40_000_000, 4 * 2**20 + 4_000_000
    plain, apply, fused, on_host = (figures.device[way] for way in WAYS)
    assert plain["parameters"] == grads and plain["optimizer state"] == 2 * grads
    assert plain[GRADIENTS_IN_BACKWARD] == plain[GRADIENTS_AT_STEP] == grads
    assert apply[GRADIENTS_IN_BACKWARD] == fused[GRADIENTS_IN_BACKWARD] == 2 * bucket
    assert apply[GRADIENTS_AT_STEP] == grads  # everything comes back before the step
    assert fused[GRADIENTS_AT_STEP] == on_host[GRADIENTS_AT_STEP] == 2 * bucket
    assert figures.compute_seconds is None
    # State on host: two buckets' Adam state (8 bytes an entry, 4 a gradient) at the step;
    # the whole state on the host, crossing each way every step.
    assert on_host["optimizer state"] == 2 * (2 * bucket)
    assert figures.host["optimizer state (state on host)"] == 2 * grads
    assert figures.state_bytes_per_step == 2 * grads
    assert figures.state_step_seconds == pytest.approx((grads + 2 * grads) / 50e9)


def test_the_state_on_the_host_is_what_a_manager_holds_after_a_step() -> None:
    """offload_optimizer_state: the planner's host state (AdamW: 8 bytes a parameter) is
    what the engine's host copies take after a step, less their 64-byte alignment; what a
    step moves is that state each way."""
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, offload_optimizer_state=True, bucket_size_mb=0.004
    )
    optimizer = torch.optim.AdamW(model.parameters())
    for tokens, targets in batches(2):
        loss_of(model, tokens, targets).backward()
        manager.step(optimizer)
    figures = plan(PlanInputs(tensors=sizes(model), optimizer_state_bytes=8))
    planned = figures.host["optimizer state (state on host)"]
    summary = manager.summary()
    held = summary.optimizer_state_host_mb * 2**20
    assert planned <= held <= planned + 2 * 64 * len(sizes(model))
    assert summary.optimizer_state_moved_mb * 2**20 == 2 * figures.state_bytes_per_step


def test_time_floor_compares_the_restore_with_the_compute() -> None:
    figures = plan(PlanInputs(tensors=[10**9], tokens_per_step=1000, flops=6e12, link_gbps=4.0))
    assert figures.restore_seconds == pytest.approx(4e9 / 4e9)  # 4 GB of fp32 at 4 GB/s
    assert figures.compute_seconds == pytest.approx(6 * 10**9 * 1000 / 6e12)


def test_a_factory_is_built_on_the_meta_device() -> None:
    """1.3B fp32 parameters would take 5 GB: built on meta, the process does not grow."""
    rss_before = psutil.Process().memory_info().rss
    tensors = tensors_of_factory("examples.plan_gpt:gpt_1b")
    assert sum(tensors) > 1.3e9
    assert psutil.Process().memory_info().rss - rss_before < 500 * 2**20


def test_plan_command_prints_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(
        [
            "plan",
            "--model",
            "gradient_cache.demo.models:medium",
            "--ratio",
            "100",
            "--tokens",
            "512",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "| **held at the optimizer step** |" in out
    assert "error-feedback residual" in out and "Compute of the step" in out


def test_plan_help_documents_every_input(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for option in (
        "--model",
        "--params",
        "--optimizer",
        "--micro-batches",
        "--bucket-size-mb",
        "--ratio",
        "--tokens",
        "--tflops",
        "--link-gbps",
        "--memory-budget",
        "--device-gib",
        "--activations-mib",
        "meta",
    ):
        assert option in help_text, option


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "nowhere"], "package.module:function"),
        (["--model", "no_such_module:f"], "No module named"),
        (["--params", "10", "--optimizer", "lion?"], "--optimizer"),
        (["--params", "10", "--memory-budget", "80%"], "--device-gib"),
        (["--params", "10", "--memory-budget", "120%"], "Invalid memory_budget"),
    ],
)
def test_bad_plan_arguments_name_the_option(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *args])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_plan_shows_what_a_memory_budget_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    """Room for everything keeps everything (no link bytes); a tighter budget keeps the state
    before the gradients; one below the offloaded step says by how much, exit status 1."""
    base = ["plan", "--model", "examples.plan_gpt:gpt_1b", "--activations-mib", "8000"]
    assert cli.main([*base, "--memory-budget", "80%", "--device-gib", "139"]) == 0
    out = capsys.readouterr().out
    assert "kept on the device 292 of 292 gradients and 292 of 292 optimizer states" in out
    assert "0.0 MiB cross the link a step" in out
    assert cli.main([*base, "--memory-budget", "20GiB"]) == 0
    kept = re.search(
        r"kept on the device (\d+) of 292 gradients and (\d+) of 292", capsys.readouterr().out
    )
    assert kept and int(kept.group(1)) < int(kept.group(2)) < 292
    assert cli.main([*base, "--memory-budget", "8GiB"]) == 1
    assert "MiB over" in capsys.readouterr().out
