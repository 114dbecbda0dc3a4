"""`gradient-cache plan`: its figures against what the engine itself holds, and its CLI.

tests/test_demo.py checks it against the demo's measured memory too.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import psutil
import pytest
import torch
from helpers import batches, loss_of, make_model
from stream_checker import FakeAccelerator, StreamChecker

import gradient_cache
from gradient_cache import Ladder, TopK, cli
from gradient_cache.demo.models import GPT_SIZES, TinyGPT
from gradient_cache.engine.config import EngineConfig
from gradient_cache.engine.factory import build_accelerator_backend
from gradient_cache.engine.route import planner
from gradient_cache.engine.weights.blocks import weight_units
from gradient_cache.planner import (
    EIGHT_BIT_ADAM_BYTES,
    EIGHT_BIT_ADAM_TENSOR_BYTES,
    GRADIENTS_AT_STEP,
    GRADIENTS_IN_BACKWARD,
    PARAMETERS_AT_STEP,
    STATE_ON_HOST,
    WAYS,
    WEIGHTS_ON_HOST,
    HostLayout,
    PlanInputs,
    WeightLayout,
    WeightsOnHost,
    binding_phase,
    format_plan,
    host_allowance,
    peak_bytes,
    plan,
    tensors_of_count,
    tensors_of_factory,
    weight_layout,
    weight_layout_of_count,
)

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
MEDIUM = ["--model", "gradient_cache.demo.models:medium"]


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
    accelerator = FakeAccelerator(StreamChecker())
    params = list(model.parameters())
    backend = build_accelerator_backend(
        params,
        config,
        torch.device("cpu"),
        plan=planner(params, config, ratio=ratio),
        streams=accelerator,
        allocate=accelerator.allocate_pinned,
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


def test_the_state_on_host_columns_buckets_are_the_ones_the_cache_sizes() -> None:
    """With the state on the host the cache sizes a bucket from the model (an eighth of its
    gradients, a small model's under 4 MiB): the column's step figures follow that bucket,
    not the other columns' 4 MiB (a probe found them 6x the measured for a small model)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))  # 2 MiB
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, offload_optimizer_state=True
    )
    capacity = manager.engine.assembler.capacity_bytes
    manager.remove_hooks()
    tensors = sizes(model)
    figures = plan(PlanInputs(tensors=tensors, optimizer_state_bytes=8, optimizer_tensor_bytes=0))
    grads, bucket = 4 * sum(tensors), capacity + 4 * max(tensors)
    assert capacity < 4 * 2**20 and 2 * bucket < grads
    on_host = figures.device[STATE_ON_HOST]
    assert on_host[GRADIENTS_AT_STEP] == 2 * bucket
    assert on_host["optimizer state"] == 2 * (2 * bucket)


class ManyBlocks(torch.nn.Module):
    """64 blocks of 66 KiB each (4.1 MiB of fp32 weights): several tensors to a bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(128, 128) for _ in range(64))


def test_the_weights_on_host_columns_buckets_are_the_ones_the_cache_sizes() -> None:
    """With the weights on the host too the cache's automatic bucket is a 32nd of the
    gradients (an eighth made the step's two buckets of weights, gradients and AdamW state
    the whole fp32 weights, and a model larger than the device ran out of memory): the
    weights column's step figures follow that bucket, the state column's still an eighth."""
    model = ManyBlocks()
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
    )
    capacity = manager.engine.assembler.capacity_bytes
    manager.remove_hooks()
    tensors = sizes(model)
    grads = 4 * sum(tensors)
    assert capacity == grads // 32
    inputs = PlanInputs(
        tensors=tensors,
        optimizer_state_bytes=8,
        optimizer_tensor_bytes=0,
        weights=weight_layout(model),
    )
    figures = plan(inputs)
    bucket = capacity + 4 * max(tensors)
    column = figures.device[WEIGHTS_ON_HOST]
    assert column[GRADIENTS_AT_STEP] == column[PARAMETERS_AT_STEP] == 2 * bucket
    assert column["optimizer state"] == 2 * (2 * bucket)
    at_step = column[GRADIENTS_AT_STEP] + column[PARAMETERS_AT_STEP] + column["optimizer state"]
    assert at_step < grads // 2  # the fp32 weights' bytes are the gradients'
    state_bucket = grads // 8 + 4 * max(tensors)
    assert figures.device[STATE_ON_HOST][GRADIENTS_AT_STEP] == 2 * state_bucket
    assert f"{capacity / MIB:.3g} MiB with the weights there too" in format_plan(figures, inputs)


def test_the_automatic_bucket_with_the_weights_on_the_host_keeps_its_bounds() -> None:
    """A 32nd of the gradients with the weights on the host, within 64 KiB and 4 MiB; an
    eighth with only the state there; 4 MiB with neither; a set size whatever the rest."""
    both = EngineConfig(offload_optimizer_state=True, offload_parameters=True)
    state = EngineConfig(offload_optimizer_state=True)
    assert both.bucket_bytes(32 * MIB) == MIB and state.bucket_bytes(32 * MIB) == 4 * MIB
    assert both.bucket_bytes(MIB) == state.bucket_bytes(MIB // 4) == 64 * 1024
    assert both.bucket_bytes(2**30) == 4 * MIB == EngineConfig().bucket_bytes(32 * MIB)
    assert both.bucket_bytes(None) == 4 * MIB
    set_size = EngineConfig(offload_optimizer_state=True, offload_parameters=True, bucket_size_mb=1)
    assert set_size.bucket_bytes(2**30) == MIB


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


def test_plan_with_a_bf16_compute_dtype_counts_the_wires(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--compute-dtype bf16: forward and backward bring 2 bytes an entry (the wires)."""
    args = ["plan", "--params", "7000000000", "--blocks", "32", "--offload-parameters"]
    assert cli.main([*args, "--host-gib", "512"]) == 0
    fp32 = capsys.readouterr().out
    assert cli.main([*args, "--host-gib", "512", "--compute-dtype", "bf16"]) == 0
    bf16 = capsys.readouterr().out
    assert "the weights at 4 bytes an entry" in fp32
    assert "the weights at 2 bytes an entry (weight_copy_bytes)" in bf16


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
        "--offload-parameters",
        "--parameter-blocks",
        "--blocks",
        "--host-gib",
        "--host-memory-fraction",
        "--compute-dtype",
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
        (["--params", "10", "--blocks", "8"], "add --offload-parameters"),
        (["--params", "10", "--offload-parameters", "--blocks", "1"], "give 2 or more"),
        (["--params", "10", "--offload-parameters", "--parameter-blocks", "h"], "--blocks"),
        (
            [*MEDIUM, "--offload-parameters", "--blocks", "8"],
            "--parameter-blocks",
        ),
        (
            ["--model", "torch.nn:PReLU", "--offload-parameters"],
            "argument --model: offload_parameters=True found no blocks",
        ),
        (
            ["--model", "torch.nn:Identity"],
            "argument --model: 'torch.nn:Identity' built a Identity with no trainable parameters",
        ),
        (
            ["--model", "torch.nn:Identity", "--offload-parameters"],
            "with no trainable parameters",
        ),
        (
            ["--params", "10", "--tokens", "100", "--tflops", "0"],
            "argument --tflops: '0' is not a finite number > 0",
        ),
        (["--params", "10", "--tflops", "-1"], "argument --tflops: '-1' is not a finite number"),
        (["--params", "10", "--tflops", "nan"], "argument --tflops: 'nan' is not a finite number"),
        (
            ["--params", "10", "--bucket-size-mb", "0"],
            "argument --bucket-size-mb: '0' is not a finite number > 0",
        ),
        (["--params", "10", "--bucket-size-mb", "nan"], "argument --bucket-size-mb: 'nan'"),
        (
            ["--params", "10", "--memory-budget", "1GiB", "--activations-mib", "-100"],
            "argument --activations-mib: '-100' is not a finite number >= 0",
        ),
        (
            [*MEDIUM, "--offload-parameters", "--parameter-blocks", "transformer.h"],
            "argument --parameter-blocks: parameter_blocks='transformer.h' names no module",
        ),
        (
            ["--params", "10", "--offload-parameters", "--host-gib", "-1"],
            "argument --host-gib: '-1' is not a finite number of GiB of a byte or more",
        ),
        (["--params", "10", "--host-gib", "64"], "add --offload-parameters"),
        (
            ["--params", "1000", "--offload-parameters", "--host-gib", "1e-12"],
            "argument --host-gib: '1e-12' is not a finite number of GiB of a byte or more",
        ),
        (
            ["--params", "1000", "--optimizer", "inf"],
            "argument --optimizer: 'inf' is not one of",
        ),
        (
            ["--params", "1000", "--compute-dtype", "bf16"],
            "argument --compute-dtype: bf16 is the weights' copies over the link",
        ),
        (
            [
                "--params",
                "1000",
                "--offload-parameters",
                "--compute-dtype",
                "bf16",
                "--memory-budget",
                "50%",
                "--device-gib",
                "1",
            ],
            "argument --memory-budget: '50%' cannot be combined with --compute-dtype bf16",
        ),
        (
            ["--params", "100", "--largest", "500"],
            "argument --largest: 500 entries is more than --params 100",
        ),
        (
            ["--params", "10", "--offload-parameters", "--host-memory-fraction", "0"],
            "argument --host-memory-fraction: '0' is not a share of the host's RAM in (0, 1]",
        ),
    ],
)
def test_bad_plan_arguments_name_the_option(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *args])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"flops": 0.0}, "flops=0.0: give a finite rate > 0"),
        ({"link_gbps": math.nan}, "link_gbps=nan: give a finite rate > 0"),
        ({"micro_batches": 0}, "micro_batches=0: give a whole number >= 1"),
        ({"tokens_per_step": 0}, "tokens_per_step=0: give a whole number >= 1"),
        ({"compression_ratio": 0.5}, "compression_ratio=0.5: give a finite number, 1"),
        ({"host_bytes": 0}, "host_bytes=0: give the host RAM in bytes"),
        ({"tensors": []}, "tensors=[]: give the trainable parameters' sizes"),
    ],
)
def test_plan_inputs_through_python_refuse_what_the_cli_refuses(
    options: dict[str, object], expected: str
) -> None:
    """`PlanInputs(flops=0)` planned a time floor of inf; no tensors, a bare max() error."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        PlanInputs(**{"tensors": [1000], **options})  # type: ignore[arg-type]


def test_plan_refuses_a_model_whose_parameters_are_all_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It raised a bare ValueError of max() over no sizes."""
    (tmp_path / "plan_frozen_factory.py").write_text(
        "import torch\n\n\ndef frozen():\n    return torch.nn.Linear(4, 4).requires_grad_(False)\n"
    )
    monkeypatch.chdir(tmp_path)  # the factory's module is found in the current folder
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", "plan_frozen_factory:frozen"])
    assert exit_info.value.code == 2
    assert (
        "argument --model: 'plan_frozen_factory:frozen' built a Linear with no trainable "
        "parameters" in capsys.readouterr().err
    )


def test_plan_help_says_a_models_dtype_is_not_read(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a --model's own dtype is not read: for a bf16 model give 2 here" in help_text


def test_a_budget_with_nothing_to_keep_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """SGD keeps no state and top-k's gradients keep their residual: no candidate. It read
    "kept on the device  (0.0 MiB)"."""
    args = ["plan", "--params", "100000000", "--optimizer", "sgd", "--codec", "topk"]
    assert cli.main([*args, "--ratio", "10", "--memory-budget", "10GiB"]) == 0
    out = capsys.readouterr().out
    assert "kept on the device nothing: it keeps no gradient compressed with error" in out
    assert "0.0 MiB cross the link a step" in out


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


def test_plan_with_the_weights_on_the_host_shows_the_units_a_budget_keeps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With --offload-parameters the budget keeps units of weights: measured from the
    weights-on-host column, room for two blocks of 24 equal ones (and not the rest, the
    largest tensor) keeps two, and the link bytes left are the other units' copies (four a
    step, three for the rest and the last block), as `budget.unit_candidates` counts them
    for a live model."""
    base = ["plan", "--params", "1000000000", "--blocks", "24", "--offload-parameters"]
    tensors = tensors_of_count(10**9, largest=None)
    layout = weight_layout_of_count(tensors, blocks=24)
    block, rest = layout.blocks[0] * 4, layout.rest * 4
    assert cli.main([*base, "--memory-budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "kept on the device 25 of 25 units of weights" in out
    peak = float(re.search(r"measured peak ([\d.]+) MiB", out).group(1))
    budget = peak + (2 * block + rest // 2) / MIB  # room for two blocks, not the rest too
    assert cli.main([*base, "--memory-budget", f"{budget:.1f}MiB"]) == 0
    out = capsys.readouterr().out
    assert "state and weights offloaded too" in out
    assert "kept on the device 2 of 25 units of weights" in out
    left = 21 * 4 * block + 3 * block + 3 * rest  # 21 middle blocks, the last, the rest
    assert f"{left / MIB:.1f} MiB of the weights" in out


def planned_weights_on_host(model: torch.nn.Module, **options: object) -> WeightsOnHost:
    """The planner's weights-on-host figures for a live ``model`` (its trainable sizes and
    its blocks as `weight_units` cuts them), ``options`` more of `PlanInputs`: what a
    manager with ``offload_parameters=True`` is checked against (``host_bytes`` against
    its summary's ``parameters_host_mb``)."""
    inputs = PlanInputs(tensors=sizes(model), weights=weight_layout(model), **options)  # type: ignore[arg-type]
    figures = plan(inputs).weights
    assert figures is not None
    return figures


class BlockModel(torch.nn.Module):
    """An embedding (80 entries), four blocks of unequal sizes (72, 144, 136 and 72
    entries) and a head (80): the rest is the embedding and the head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 8)
        widths = [(8, 8), (8, 16), (16, 8), (8, 8)]
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in widths)
        self.head = torch.nn.Linear(8, 10, bias=False)


def test_the_weights_on_host_column_is_the_hand_computed_one() -> None:
    """BlockModel built on meta (584 entries, fp32), AdamW (8 bytes a parameter, 4 a
    tensor), two micro-batches, buckets of 256 bytes (a bucket closes past its size: 256 +
    the largest gradient, 512 = 768 bytes), 1 GB/s, and FLOP/s such that a step's compute
    at T tokens a micro-batch takes as long as T link bytes: the hiding tokens are the
    bytes to the device a step."""
    with torch.device("meta"):
        model = BlockModel()
    rate, numel = 1e9, 584
    inputs = PlanInputs(
        tensors=sizes(model),
        micro_batches=2,
        config=EngineConfig(bucket_size_mb=256 / 2**20),
        weights=weight_layout(model),
        link_gbps=1.0,
        flops=6 * numel * 2 * rate,  # compute a step = link time a step at 1 token a byte
    )
    figures = plan(inputs)
    weights = figures.weights
    assert weights is not None
    bucket = 256 + 128 * 4
    # The device: the rest (160 entries) and blocks 2 and 3 (144 + 136) in forward and
    # backward; two buckets' weights at the step; the state-on-host column's state and
    # gradients (two buckets' AdamW state, 8 bytes an entry, and 4 bytes a tensor's step).
    column = figures.device[WEIGHTS_ON_HOST]
    assert column["parameters"] == weights.window_bytes == (160 + 144 + 136) * 4
    assert column[PARAMETERS_AT_STEP] == weights.step_bytes == 2 * bucket
    state = 2 * bucket // 4 * 8 + 4 * 10
    assert column["optimizer state"] == figures.device[STATE_ON_HOST]["optimizer state"] == state
    assert column[GRADIENTS_IN_BACKWARD] == column[GRADIENTS_AT_STEP] == 2 * bucket
    assert peak_bytes(figures, WEIGHTS_ON_HOST, GRADIENTS_IN_BACKWARD) == 1760 + state + 1536
    assert peak_bytes(figures, WEIGHTS_ON_HOST, GRADIENTS_AT_STEP) == 1536 + state + 1536
    # The host: every weight's fp32 master.
    assert weights.host_bytes == figures.host["parameters (weights on host)"] == numel * 4
    assert weights.rest_bytes == 160 * 4
    # The link a micro-batch: each block twice but the last (kept from its forward to its
    # backward) once, the rest once, 4 bytes an entry (fp32).
    streamed = (2 * (72 + 144 + 136 + 72) - 72 + 160) * 4
    assert weights.copy_bytes == 4 and weights.streamed_bytes_per_micro_batch == streamed
    # A step: the weights to the device twice a micro-batch, then every weight each way in
    # the step with its state (8 bytes) and the gradients (out each micro-batch, back for
    # the accumulation and the restore: two each way, lossless).
    to_device = 2 * streamed + numel * 4 + numel * 8 + 2 * numel * 4
    to_host = numel * 4 + numel * 8 + 2 * numel * 4
    assert weights.link_bytes_per_step == {"host to device": to_device, "device to host": to_host}
    assert weights.link_seconds == pytest.approx(to_device / rate)
    assert weights.step_seconds == pytest.approx((numel * 4 + numel * 8 + numel * 4) / rate)
    assert weights.hiding_tokens == pytest.approx(to_device)


def test_the_window_is_the_rest_and_the_two_largest_consecutive_blocks() -> None:
    """The planner's window is what `weight_units` cuts: the demo's GPT (its head tied to
    the embedding, in the rest once), and BlockModel, whose largest two blocks are not the
    first."""
    with torch.device("meta"):
        models = [make_model(), TinyGPT(GPT_SIZES["tiny"]), BlockModel()]
    for model in models:
        units = weight_units(model)
        block_bytes = [sum(p.numel() * 4 for p in params) for params in units.block_params]
        pairs = [a + b for a, b in itertools.pairwise(block_bytes)]
        window = sum(p.numel() * 4 for p in units.rest) + max(pairs)
        weights = plan(PlanInputs(tensors=sizes(model), weights=weight_layout(model))).weights
        assert weights is not None and weights.window_bytes == window
        assert weights.host_bytes == sum(p.numel() * 4 for p in model.parameters())
        # With bf16 wires the window holds them (a unit's buffer in the compute dtype); the
        # host keeps the fp32 masters (the wires beside them are the layouts table's).
        inputs = PlanInputs(tensors=sizes(model), weights=weight_layout(model), weight_copy_bytes=2)
        wired = plan(inputs).weights
        assert wired is not None and wired.window_bytes == window // 2
        assert (
            wired.rest_bytes == weights.rest_bytes // 2 and wired.host_bytes == weights.host_bytes
        )


def test_the_hiding_tokens_against_the_issues_formula() -> None:
    """Without a rest, lossless fp32 gradients (g = 4, the first micro-batch's crossing
    at c bytes, as it came: g - (g - c) / m a micro-batch), the fp32 master (p = 4), AdamW
    (s = 8), ten equal blocks (backward brings all but the last: 1.9 copies a micro-batch):
    T = (F / B) x (1.9c + g - (g - c) / m + (p + s) / m) / 6; the issue's
    (F / B) x (4 + s / m) / 6 for bf16 copies (c = 2) is that less (g - 2 / m + p / m) and
    more 0.1c: the gradients back each micro-batch and the weights to the device in the
    step, which it leaves out, and the last block, which it counts twice."""
    flops, link = 396e12, 50.0
    ratio = flops / (link * 1e9)
    for copy_bytes, micro_batches in [(4, 1), (2, 1), (2, 4)]:
        inputs = PlanInputs(
            tensors=[10**6] * 10,
            optimizer_tensor_bytes=0,
            micro_batches=micro_batches,
            flops=flops,
            link_gbps=link,
            weights=WeightLayout(blocks=(10**6,) * 10, rest=0, source="test"),
            weight_copy_bytes=copy_bytes,
        )
        weights = plan(inputs).weights
        assert weights is not None
        gradients = 4 - (4 - copy_bytes) / micro_batches
        ours = ratio * (1.9 * copy_bytes + gradients + (4 + 8) / micro_batches) / 6
        assert weights.hiding_tokens == pytest.approx(ours)
        if copy_bytes == 2:
            issue = ratio * (4 + 8 / micro_batches) / 6
            assert ours - issue == pytest.approx(ratio * (4 - 0.2 + 2 / micro_batches) / 6)


def test_a_parameter_count_takes_equal_blocks_and_its_largest_tensor_as_the_rest() -> None:
    tensors = tensors_of_count(1003, largest=100)
    layout = weight_layout_of_count(tensors, blocks=4)
    assert layout.rest == 100 and layout.blocks == (226, 226, 226, 225)
    assert layout.window() == 100 + 452
    assert sum(weight_layout_of_count(tensors).blocks) == 903  # 32 blocks by default
    with pytest.raises(ValueError, match="2 or more"):
        weight_layout_of_count(tensors, blocks=1)


def test_plan_command_prints_the_weights_column(capsys: pytest.CaptureFixture[str]) -> None:
    """Only with --offload-parameters: the column, the split parameters row, the host's
    weights, the link a step and the hiding tokens; --params says its blocks are assumed."""
    base = ["plan", "--params", "7000000000", "--tokens", "65536", "--micro-batches", "4"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert WEIGHTS_ON_HOST not in out and "| parameters |" in out
    assert cli.main([*base, "--offload-parameters", "--blocks", "40"]) == 0
    out = capsys.readouterr().out
    assert f"| {WEIGHTS_ON_HOST} |" in out
    assert "| parameters, forward and backward |" in out
    assert "| parameters, optimizer step |" in out
    assert "| parameters (weights on host) | 26702.9 |" in out  # 7e9 x 4 bytes
    assert "assumed: 40 equal blocks (--blocks)" in out
    assert "PCIe per step, weights on host, host to device" in out
    assert "tokens a micro-batch" in out and "the link sets the pace" in out
    assert cli.main(["plan", *MEDIUM, "--offload-parameters", "--parameter-blocks", "blocks"]) == 0
    assert "the blocks of 'blocks', 12 of them" in capsys.readouterr().out


@pytest.mark.parametrize("copy_bytes", [None, 2], ids=["fp32", "bf16 compute"])
@pytest.mark.parametrize("micro_batches", [1, 2, 3])
@pytest.mark.parametrize("ratio", [1, 100], ids=["lossless", "top-k, host residual"])
def test_the_phases_add_up_to_the_pooled_link_bytes(
    micro_batches: int, ratio: float, copy_bytes: int | None
) -> None:
    """Forward's and backward's bytes over the step's micro-batches and the optimizer
    step's are the weights column's link bytes a step, each direction (also with a bf16
    compute dtype, whose first two micro-batches' gradients cross in bf16); a micro-batch's
    are the step's over the micro-batches, backward's from the second on (with the stored
    gradients' accumulation) where the micro-batches differ."""
    with torch.device("meta"):
        model = BlockModel()
    config = EngineConfig(min_compress_numel=64, codec=TopK(selection="exact"))
    inputs = PlanInputs(
        tensors=sizes(model),
        micro_batches=micro_batches,
        compression_ratio=ratio,
        config=config if ratio > 1 else EngineConfig(),
        weights=weight_layout(model),
        weight_copy_bytes=copy_bytes,
    )
    figures = plan(inputs)
    weights = figures.weights
    assert weights is not None
    assert [phase.phase for phase in weights.phases] == ["forward", "backward", "optimizer step"]
    forward, backward, step = weights.phases
    for direction, pooled in weights.link_bytes_per_step.items():
        assert sum(phase.link_bytes_per_step[direction] for phase in weights.phases) == pooled
        assert (
            forward.link_bytes_per_step[direction] == micro_batches * forward.link_bytes[direction]
        )
        assert step.link_bytes_per_step[direction] == step.link_bytes[direction]
    backward_out = backward.link_bytes_per_step["device to host"]
    payload = figures.host["stored gradients"]
    if copy_bytes is not None and ratio == 1:  # carried: the first two at half the bytes
        carried = min(micro_batches, 2) * payload // 2 + max(micro_batches - 2, 0) * payload
        assert backward_out == carried
        return
    assert backward_out == micro_batches * backward.link_bytes["device to host"]
    # Backward's micro-batches from the second on bring the stored gradients back.
    first = backward.link_bytes["host to device"] - (payload if micro_batches > 1 else 0)
    assert backward.link_bytes_per_step["host to device"] == (
        micro_batches * first + (micro_batches - 1) * payload
    )
    if ratio > 1:
        assert figures.host["error-feedback residual"] > 0  # crosses each way in backward


@pytest.mark.parametrize(
    ("grad_bytes", "state_bytes", "pooled_to_device"),
    [(4, 8, 59.18e9), (2, 0, 43.18e9)],
    ids=["fp32 gradients, AdamW", "bf16 gradients, SGD"],
)
def test_forward_needs_the_tokens_its_own_compute_gives(
    grad_bytes: int, state_bytes: float, pooled_to_device: float
) -> None:
    """1e9 parameters (the rest 1e7, 24 blocks of 41.25e6), fp32 weights (c = 4), 4
    micro-batches, 400 TFLOP/s, 50 GB/s. Forward brings every weight once, 4e9 bytes in
    0.08 s, against 2 x 1e9 x T FLOPs: T = 16,000. Pooled, a step to the device: 4 x
    (2 x 0.99e9 - 41.25e6 + 1e7) x 4 weights' copies (backward keeps the last block), 4e9
    of masters and 1e9 x s of state in the step, 4 x 1e9 x g of gradients, against 6 x 1e9
    x 4 x T FLOPs. So forward's tokens are the pooled ones times 3 x m x 4e9 / pooled
    bytes: fewer with fp32 gradients and AdamW (the pooled figure counts the step's copies
    as hidden), more with bf16 gradients and SGD."""
    tensors = tensors_of_count(10**9)
    layout = WeightLayout(blocks=(41_250_000,) * 24, rest=10**7, source="by hand")
    inputs = PlanInputs(
        tensors=tensors,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=state_bytes,
        micro_batches=4,
        flops=400e12,
        link_gbps=50.0,
        weights=layout,
    )
    assert 4 * (2 * 0.99e9 - 41.25e6 + 1e7) * 4 + 4e9 + 1e9 * state_bytes + 4e9 * grad_bytes == (
        pytest.approx(pooled_to_device)
    )
    weights = plan(inputs).weights
    assert weights is not None
    forward, backward, step = weights.phases
    pooled_tokens = pooled_to_device / 50e9 / (6 * 1e9 * 4 / 400e12)
    assert weights.hiding_tokens == pytest.approx(pooled_tokens)
    assert forward.hiding_tokens["host to device"] == pytest.approx(16_000)
    assert forward.tokens_to_hide() / weights.hiding_tokens == pytest.approx(
        3 * 4 * 4e9 / pooled_to_device
    )
    # Backward: the blocks again and the gradients back for the accumulation, against
    # 4 x 1e9 x T FLOPs; out, the gradients.
    to_device = (0.99e9 - 41.25e6) * 4 + 1e9 * grad_bytes
    assert backward.hiding_tokens["host to device"] == pytest.approx(to_device / 50e9 / 1e-5)
    assert backward.hiding_tokens["device to host"] == pytest.approx(grad_bytes * 2_000)
    assert binding_phase(weights.phases) is forward
    # The optimizer step hides nothing: masters, state and the restore in; masters and state out.
    assert step.hiding_tokens == {} and step.tokens_to_hide() == float("inf")
    assert step.link_seconds["host to device"] == pytest.approx(
        (4e9 + 1e9 * state_bytes + 1e9 * grad_bytes) / 50e9
    )


def test_backward_binds_with_bf16_copies_and_accumulated_gradients() -> None:
    """With 2-byte weight copies and lossless fp32 gradients coming back for the
    accumulation, backward brings (0.99e9 - 41.25e6) x 2 + 4e9 bytes (all blocks but the
    last) against 4 x 1e9 x T FLOPs (T = 11,795 at 400 TFLOP/s, 50 GB/s), more than
    forward's 1e9 x 2 against 2 x 1e9 x T (8,000)."""
    inputs = PlanInputs(
        tensors=tensors_of_count(10**9),
        micro_batches=2,
        flops=400e12,
        weights=WeightLayout(blocks=(41_250_000,) * 24, rest=10**7, source="by hand"),
        weight_copy_bytes=2,
    )
    weights = plan(inputs).weights
    assert weights is not None
    forward, backward, _ = weights.phases
    assert forward.tokens_to_hide() == pytest.approx(8_000)
    assert backward.tokens_to_hide() == pytest.approx(11_795)
    assert binding_phase(weights.phases) is backward


def test_plan_command_prints_the_link_per_phase(capsys: pytest.CaptureFixture[str]) -> None:
    """Only with --offload-parameters; the times only with --tokens; the binding phase
    named. 1e9 parameters in 24 blocks: forward brings 4e9 bytes (3814.7 MiB) in 80 ms at
    50 GB/s against 5.12 ms of compute for 1,024 tokens a micro-batch at 400 TFLOP/s."""
    base = ["plan", "--params", "1000000000", "--micro-batches", "4", "--tflops", "400"]
    assert cli.main([*base, "--tokens", "4096"]) == 0
    assert "link per phase" not in capsys.readouterr().out
    offload = [*base, "--offload-parameters", "--blocks", "24", "--link-gbps", "50"]
    assert cli.main([*offload, "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    header = "| link per phase | MiB | link, ms | compute, ms | hides from, tokens a micro-batch |"
    assert header in out
    assert "| forward, host to device, a micro-batch | 3814.7 | 80.00 | 5.12 | 16,000 |" in out
    assert "| optimizer step, device to host, a step | 11444.1 | 240.00 | ~0 | never |" in out
    assert "Binding: forward, which hides its copies from 16,000 tokens a micro-batch" in out
    assert "At 1,024 tokens a micro-batch forward's link sets its pace (1562% of its" in out
    assert cli.main(offload) == 0
    out = capsys.readouterr().out
    assert "| link per phase | MiB | hides from, tokens a micro-batch |" in out
    assert "| backward, device to host, a micro-batch | 3814.7 | 8,000 |" in out
    assert "Binding: forward" in out and "At 1,024" not in out


LAYOUT_ROWS = (
    "fp32 compute, adamw",
    "fp32 compute, adamw8bit",
    "fp32 compute, adamw4bit",
    "bf16 compute_dtype, adamw",
    "bf16 compute_dtype, adamw8bit",
    "bf16 compute_dtype, adamw4bit",
)
PER_TENSOR = {"adamw": 4, "adamw8bit": EIGHT_BIT_ADAM_TENSOR_BYTES, "adamw4bit": 4 + 2 * 16 * 4}


def layouts_of(tensors: list[int], **options: object) -> dict[str, HostLayout]:
    """The planner's host layouts for ``tensors`` in two equal blocks (the cut does not
    change the host's bytes), by row name; ``options`` more of `PlanInputs`."""
    layout = WeightLayout(blocks=(sum(tensors) // 2,) * 2, rest=0, source="test")
    result = plan(PlanInputs(tensors=tensors, weights=layout, **options))  # type: ignore[arg-type]
    return {row.name: row for row in result.layouts}


def test_the_host_layouts_are_the_hand_computed_bytes_a_parameter() -> None:
    """Ten tensors of 2**20 entries (multiples of the masters' 16 entries and 8-bit Adam's
    256-entry blocks), lossless fp32: a master 4 bytes, a bf16 wire 2, a gradient's slot 4,
    AdamW 8 and 8-bit AdamW 2 x (1 + 4 / 256); this model adds the pool's slabs and the
    state's per-tensor bytes (AdamW's step, 8-bit AdamW's step and code tables)."""
    tensors = [2**20] * 10
    numel = sum(tensors)
    rows = layouts_of(tensors)
    assert list(rows) == list(LAYOUT_ROWS)
    eight_bit = 2 * (1 + 4 / 256)
    assert eight_bit == EIGHT_BIT_ADAM_BYTES
    four_bit = 2 * (0.5 + 4 / 128)  # torchao's: two 4-bit codes an entry, a scale per 128
    expected = {
        LAYOUT_ROWS[0]: ([4, 0, 4, 8], 16),
        LAYOUT_ROWS[1]: ([4, 0, 4, eight_bit], 10 + 1 / 32),
        LAYOUT_ROWS[2]: ([4, 0, 4, four_bit], 9 + 1 / 16),
        LAYOUT_ROWS[3]: ([4, 2, 4, 8], 18),
        LAYOUT_ROWS[4]: ([4, 2, 4, eight_bit], 12 + 1 / 32),
        LAYOUT_ROWS[5]: ([4, 2, 4, four_bit], 11 + 1 / 16),
    }
    pool = plan(PlanInputs(tensors=tensors)).host["pinned pool (CUDA)"]
    assert pool == 4 * numel  # 40 MiB of 4 MiB slots: slabs of 32 and 8 MiB, nothing spare
    for name, (components, total) in expected.items():
        row = rows[name]
        assert list(row.per_parameter.values()) == components
        assert row.bytes_per_parameter() == total
        weights = (4 + row.per_parameter["bf16 wires"]) * numel
        per_tensor = PER_TENSOR[row.optimizer]
        state = row.per_parameter["optimizer state"] * numel + per_tensor * len(tensors)
        assert row.model_bytes == weights + pool + state
        assert row.overhead_bytes() == per_tensor * len(tensors)


def test_the_host_layouts_count_alignment_and_small_tensors() -> None:
    """A tensor of 100 entries: its master and wire take 112 (16-entry alignment); 8-bit
    AdamW keeps its moments in fp32 (8 bytes an entry, no code tables: under 4096
    entries), AdamW counts its 8 bytes an entry and its step; the pool is the planner's
    (`test_pinned_pool_is_the_cuda_backends_pool`: the engine's)."""
    tensors = [100, 2**20]
    rows = layouts_of(tensors)
    pool = plan(PlanInputs(tensors=tensors)).host["pinned pool (CUDA)"]
    masters = (112 + 2**20) * 4
    adamw = (100 + 2**20) * 8 + 2 * 4
    eight_bit = 100 * 8 + int(2**20 * EIGHT_BIT_ADAM_BYTES) + EIGHT_BIT_ADAM_TENSOR_BYTES
    four_bit = 100 * 8 + int(2**20 * 2 * (0.5 + 4 / 128)) + PER_TENSOR["adamw4bit"]
    for index, state in enumerate((adamw, eight_bit, four_bit)):
        assert rows[LAYOUT_ROWS[index]].model_bytes == masters + pool + state
        assert rows[LAYOUT_ROWS[index + 3]].model_bytes == masters * 6 // 4 + pool + state


def test_the_largest_model_is_the_allowed_bytes_over_the_bytes_a_parameter() -> None:
    """host_memory_fraction (0.5 by default) of the host's RAM is allowed: the largest model
    is floor(allowed / bytes a parameter), the modelled overheads taken in the same
    proportion (a model shaped like this one): it fits and one parameter more does not,
    below the figure without the overheads by their share."""
    tensors = [2**20] * 10
    ram = 1024 * 2**30
    for fraction in (0.5, 1.0):
        inputs = PlanInputs(
            tensors=tensors,
            weights=WeightLayout(blocks=(2**19,) * 20, rest=0, source="test"),
            host_bytes=ram,
            config=EngineConfig(host_memory_fraction=fraction),
        )
        assert host_allowance(inputs)[:2] == (ram, int(ram * fraction))
        allowed = int(ram * fraction)
        for row in plan(inputs).layouts:
            largest = row.largest_model(allowed)
            per_parameter = row.bytes_per_parameter()
            share = row.overhead_bytes() / row.model_bytes
            assert allowed / per_parameter * (1 - share) - 1 <= largest <= allowed / per_parameter
            assert largest * row.model_bytes <= allowed * sum(tensors)  # it fits
            assert (largest + 1) * row.model_bytes > allowed * sum(tensors)  # one more does not
    # fp32 AdamW in 512 GiB: 2**39 / 16 = 2**35 parameters, less the steps' 40 bytes' share.
    rows = layouts_of(tensors, host_bytes=ram)
    assert rows[LAYOUT_ROWS[0]].largest_model(2**39) == 2**39 * 10 * 2**20 // (160 * 2**20 + 40)
    assert 2**35 - rows[LAYOUT_ROWS[0]].largest_model(2**39) == 8192


def test_plan_command_prints_the_host_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    """Only with --offload-parameters: a row a layout with its bytes a parameter, this
    model's GiB and the largest model in host_memory_fraction of --host-gib; a row for
    --optimizer where its state differs from AdamW's and 8-bit AdamW's."""
    base = ["plan", "--params", "10485760", "--largest", "1048576"]
    assert cli.main([*base, "--host-gib", "1", "--offload-parameters", "--blocks", "8"]) == 0
    out = capsys.readouterr().out
    header = (
        "| host, offload_parameters=True: bytes a parameter | masters | bf16 wires | gradient "
        "store | optimizer state | all | this model, GiB | largest model in 0.5 GiB |"
    )
    assert header in out
    # 2**29 bytes over (16 x 10 x 2**20 + 40) / (10 x 2**20) bytes a parameter: 2**25 less
    # 40 bytes' share, 8.
    assert (
        "| fp32 compute, adamw | 4.00 | 0.00 | 4.00 | 8.00 | **16.00** | 0.2 | 33,554,424 |" in out
    )
    assert "| bf16 compute_dtype, adamw | 4.00 | 2.00 | 4.00 | 8.00 | **18.00** |" in out
    assert "| fp32 compute, adamw8bit | 4.00 | 0.00 | 4.00 | 2.03 | **10.03** |" in out
    assert "| bf16 compute_dtype, adamw8bit | 4.00 | 2.00 | 4.00 | 2.03 | **12.03** |" in out
    assert "first five figures are bytes a parameter" in out
    assert "host_memory_fraction 0.5 of 1.0 GiB (given with --host-gib), 0.5 GiB" in out
    options = ["--offload-parameters", "--optimizer", "sgd-momentum", "--host-memory-fraction", "1"]
    assert cli.main([*base, *options]) == 0
    out = capsys.readouterr().out
    assert "| fp32 compute, sgd-momentum | 4.00 | 0.00 | 4.00 | 4.00 | **12.00** |" in out
    assert "host_memory_fraction 1 of" in out and "available on this machine now" in out
    assert cli.main(base) == 0
    assert "bytes a parameter |" not in capsys.readouterr().out


def test_the_gradient_store_is_the_codecs_slots() -> None:
    """The gradient store a parameter is its slot in the CUDA pinned pool for the plan's
    codec: int8's payload (an int8 code an entry, an fp32 scale per 64 entries); top-k's
    payload and its int8 error-feedback residual, twice (the slot keeps a spare for a
    pending step's new residual)."""
    tensors = [2**20] * 4
    int8 = layouts_of(tensors, config=EngineConfig(codec="int8"))[LAYOUT_ROWS[0]]
    assert int8.per_parameter["gradient store"] == 1 + 4 / 64
    config = EngineConfig(codec=TopK(selection="exact"))
    host = plan(PlanInputs(tensors=tensors, compression_ratio=100, config=config)).host
    topk = layouts_of(tensors, compression_ratio=100, config=config)[LAYOUT_ROWS[0]]
    store = host["stored gradients"] + 2 * host["error-feedback residual"]
    assert topk.per_parameter["gradient store"] == store / sum(tensors)
    # The residual: an int8 an entry, an fp32 scale per 64.
    assert host["error-feedback residual"] == sum(tensors) * (1 + 4 / 64)
