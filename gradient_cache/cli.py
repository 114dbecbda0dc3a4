"""The `gradient-cache` command: `gradient-cache demo [options]`."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .codecs import CODEC_NAMES
from .demo.models import GPT_SIZES
from .demo.report import check_matplotlib, format_table, report_dict, write_json, write_plot
from .demo.run import (
    DEFAULT_SCENARIO,
    LEARNING_RATE,
    SCENARIOS,
    DemoSettings,
    DeviceCapExceeded,
    run_demo,
)
from .engine.budget import MemoryBudget, MemoryBudgetError
from .engine.config import DEFAULT_COMPRESSION_RATIO, EngineConfig
from .engine.hostmem import HostMemoryError
from .engine.units import MIB
from .linkrate import measure_link
from .planner import (
    DEFAULT_BLOCKS,
    DEFAULT_FLOPS,
    DEFAULT_LINK_GBPS,
    OPTIMIZER_STATE_BYTES,
    PlanInputs,
    WeightLayout,
    budget_decision,
    format_plan,
    layout_optimizers,
    model_of_factory,
    optimizer_state_bytes,
    plan,
    tensors_of_count,
    trainable_sizes,
    weight_layout,
    weight_layout_of_count,
)
from .testing import EmulatedDeviceError

DEVICES = ("auto", "cpu", "cuda", "emulated")
# The scenario --device emulated runs: its device cap is what the emulated device's allocator
# holds (the other scenarios measure memory on the CPU or CUDA only).
EMULATED_SCENARIO = "larger-than-device"
# A lost or doubled gradient moves a weight by about the learning rate in one AdamW step;
# rounding differences stay far below that (4.9e-5 after 10 steps, the largest seen; one
# thread instead of two moves the small model's weights by 4.0e-5 in 10 steps).
LOSSLESS_TOLERANCE = LEARNING_RATE / 10
# torch seeds are 64-bit; the validation batches use seed + 1.
MAX_SEED = 2**63 - 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` when None); return the exit status."""
    parser, demo_parser, plan_parser = _parsers()
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _plan(plan_parser, args)
    # Errors found after parsing come with the demo's usage, as argparse's own do.
    device = _resolve_device(demo_parser, args.device)
    if args.device == "emulated" and args.scenario != EMULATED_SCENARIO:
        demo_parser.error(
            f"argument --device: 'emulated' runs --scenario {EMULATED_SCENARIO} only (its "
            f"device cap held by the emulated device's allocator), not {args.scenario!r}; use "
            "--device cpu or --device auto"
        )
    out = _output_folder(demo_parser, args.out)
    try:
        check_matplotlib()  # before training, not after two minutes of it
    except ImportError as error:
        return _fail(str(error))
    try:
        return _demo(args, device=device, out=out)
    except HostMemoryError as error:  # it names the figures and the option that lowers them
        return _fail(str(error))
    except (DeviceCapExceeded, EmulatedDeviceError) as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted", status=130)


def _fail(message: str, *, status: int = 1) -> int:
    print(f"gradient-cache: error: {message}", file=sys.stderr)
    return status


def _demo(args: argparse.Namespace, *, device: torch.device, out: Path) -> int:
    scenario = SCENARIOS[args.scenario]
    args.steps = scenario.steps if args.steps is None else args.steps
    if args.model_size is None:
        args.model_size = scenario.default_model_size(device)
    settings = DemoSettings(
        steps=args.steps,
        ratio=args.ratio,
        model_size=args.model_size,
        device=device,
        seed=args.seed,
        scenario=args.scenario,
        emulated=args.device == "emulated",
    )
    result = run_demo(settings)
    report = report_dict(result, args={**vars(args), "out": str(out)})
    write_json(report, out / "report.json")
    write_plot(result, out / "report.png")
    print(format_table(result))
    print(f"\nWrote {out / 'report.json'} and {out / 'report.png'}.")
    lossless = check_lossless(report["lossless_max_abs_weight_diff"], report["plain_again"])
    return max(lossless, check_device_cap(report.get("device_cap")))


def check_device_cap(cap: dict[str, Any] | None) -> int:
    """Say how the runs met the scenario's device cap (`report_dict`'s ``device_cap``; None:
    no cap, nothing to say); 1 if plain PyTorch fitted under it, or the cache did not."""
    if cap is None:
        return 0
    plain, cache = cap["peak_over_cap"].values()  # plain uncapped, the cache under the cap
    if cap["plain_under_cap_out_of_memory"] is None or plain <= 1:
        return _fail(
            f"plain PyTorch trained under the {cap['mb']:.1f} MiB device cap (its peak "
            f"uncapped: {plain:.2f}x the cap), so the scenario shows nothing; please report "
            "this, with the command line."
        )
    if cache > 1:
        return _fail(f"the cache's peak was {cache:.2f}x the {cap['mb']:.1f} MiB device cap.")
    refused = (
        f"was refused at placement, its fp32 weights {cap['weights_bytes'] / cap['bytes']:.1f}x "
        "the cap,"
        if cap.get("plain_under_cap_refused_at_placement")
        else "ran out of memory"
    )
    print(
        f"Under a {cap['mb']:.1f} MiB device cap plain PyTorch {refused} (trained uncapped it "
        f"needs {plain:.1f}x the cap); the cache trained under it (its peak {cache:.0%} of the "
        "cap)."
    )
    return 0


def check_lossless(difference: float, plain_again: dict[str, float] | None = None) -> int:
    """Say how far the lossless run ended from plain PyTorch; 1 if beyond rounding.

    ``plain_again``: a second plain run's distances to the first plain run and to the
    lossless run (made when ``difference`` is not 0).
    """
    if difference == 0:
        print("The lossless cache (r=1) ended bit for bit on plain PyTorch's weights.")
        return 0
    if plain_again is not None and plain_again["max_abs_weight_diff_vs_lossless"] == 0:
        print(
            f"The lossless cache (r=1) ended {difference:.3g} away from the first plain "
            "PyTorch run but bit for bit on a second one: plain PyTorch itself left its "
            f"path in the first run ({plain_again['max_abs_weight_diff_vs_plain']:.3g} from "
            "the second; perf/RESULTS.md, Determinism)."
        )
        return 0
    reference = "plain PyTorch's weights"
    if plain_again is not None:  # both plain runs differ from it: judge by the nearer
        difference = min(difference, plain_again["max_abs_weight_diff_vs_lossless"])
        reference = "the nearer of two plain PyTorch runs"
    if difference <= LOSSLESS_TOLERANCE:
        # Last-bit differences: CUDA backward kernels that accumulate with atomics, or CPU
        # kernels whose sums depend on the thread count, compounded by AdamW.
        print(
            f"The lossless cache (r=1) ended {difference:.3g} away from {reference}: within "
            f"the {LOSSLESS_TOLERANCE:g} that kernel rounding can explain "
            "(docs/ARCHITECTURE.md, Traps)."
        )
        return 0
    return _fail(
        f"the lossless cache (r=1) ended {difference:.3g} away from {reference}, more than "
        f"the {LOSSLESS_TOLERANCE:g} that kernel rounding can explain; a gradient was lost "
        "or applied twice. Please report this."
    )


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `gradient-cache` parser and its `demo` and `plan` subparsers."""
    parser = argparse.ArgumentParser(
        prog="gradient-cache",
        description="gradient-cache: offload gradients to host memory during backward.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small GPT several ways and compare memory, speed and loss",
        description=(
            "Train the built-in TinyGPT on an embedded byte corpus (nothing is downloaded) "
            "several ways from the same seed and batches: plain PyTorch, the gradient cache "
            "lossless (ratio 1) and at --ratio; in the default scenario, memory-bound, also "
            "lossless with the optimizer state on the host, and with the weights on the host "
            "beside it (five runs); --scenario larger-than-device: plain under a device cap "
            "and without it, and the cache with the weights and the optimizer state on the "
            "host under the cap. Prints a table and writes report.json and report.png to "
            "--out."
        ),
    )
    defaults = ", ".join(f"{s.steps} for {s.name}" for s in SCENARIOS.values())
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help=f"training steps per run (default: the scenario's, {defaults})",
    )
    demo.add_argument(
        "--ratio",
        type=_ratio,
        default=DEFAULT_COMPRESSION_RATIO,
        help="compression ratio of the third run, a number >= 1 (default: the library's, "
        f"{DEFAULT_COMPRESSION_RATIO:g})",
    )
    sizes = ", ".join(
        f"{s.model_size} for {s.name}"
        + ("" if s.cuda_model_size is None else f" ({s.cuda_model_size} on CUDA)")
        for s in SCENARIOS.values()
    )
    demo.add_argument(
        "--model-size",
        choices=sorted(GPT_SIZES),
        default=None,
        help=f"TinyGPT size (default: the scenario's, {sizes})",
    )
    demo.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where to train; auto picks cuda when available, else cpu; emulated: the "
        "accelerator emulated on the CPU (gradient_cache.testing, built at first use), whose "
        f"allocator holds the device cap, for --scenario {EMULATED_SCENARIO} only "
        "(default auto)",
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for report.json and report.png "
        "(default: a new gradient-cache-demo-YYYYmmdd-HHMMSS folder here)",
    )
    demo.add_argument(
        "--seed", type=_seed, default=0, help="seed of the weights and batches (default 0)"
    )
    demo.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default=DEFAULT_SCENARIO,
        help="; ".join(f"{s.name}: {s.summary}" for s in SCENARIOS.values())
        + f" (default {DEFAULT_SCENARIO})",
    )
    plan = commands.add_parser(
        "plan",
        help="what a model's training step holds, plain against the cache (no training)",
        description=(
            "Print, per component, the bytes a training step holds on the device (parameters, "
            "gradients, optimizer state, the cache's buckets in flight) for plain PyTorch, the "
            "cache with apply_gradients() and with the fused step(), the cache's host memory "
            "(stored gradients, error-feedback residual, the CUDA pinned pool) and PCIe bytes "
            "per step; with --tokens, the step's compute against the restore's copy time; "
            "with --offload-parameters, a column with the weights on the host too, their "
            "link per phase, and the host's bytes a parameter in each layout (fp32 or bf16 "
            "compute, AdamW or 8-bit AdamW) with the largest model --host-gib holds. "
            "Activations are left out. Nothing is trained and no cache is created."
        ),
    )
    model = plan.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model",
        help="a factory, package.module:function, returning the nn.Module; it is called "
        "under torch.device('meta'), so nothing is allocated (a factory that moves tensors "
        "itself, or loads weights, fails or allocates there: use --params instead)",
    )
    model.add_argument("--params", type=_positive_int, help="a trainable parameter count")
    plan.add_argument(
        "--largest",
        type=_positive_int,
        default=None,
        help="with --params: the largest tensor's entries (default 1%% of the count)",
    )
    plan.add_argument(
        "--param-bytes",
        type=int,
        choices=(2, 4),
        default=4,
        help="bytes an entry of every parameter: 4 fp32, 2 bf16 or fp16 (default 4); a "
        "--model's own dtype is not read: for a bf16 model give 2 here and to --grad-bytes",
    )
    plan.add_argument(
        "--grad-bytes",
        type=int,
        choices=(2, 4),
        default=4,
        help="bytes an entry of every gradient, which has its parameter's dtype (default 4; "
        "not read from a --model either)",
    )
    plan.add_argument(
        "--compute-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="with --offload-parameters: the weights' compute dtype (compute_dtype); bf16 "
        "brings each weight's bf16 wire in forward and backward, 2 bytes an entry (default "
        "fp32: the master as it is)",
    )
    plan.add_argument(
        "--optimizer",
        default="adamw",
        help=f"{', '.join(OPTIMIZER_STATE_BYTES)} (adam and adamw: 8 bytes a parameter; "
        "the 8-bit ones and fp8 2.03, 4-bit 1.06), or the optimizer state's bytes per "
        "parameter (default adamw; 4 for an AdamW with bf16 moments)",
    )
    plan.add_argument("--micro-batches", type=_positive_int, default=1)
    plan.add_argument(
        "--bucket-size-mb",
        type=_positive_float,
        default=None,
        help="dense gradient MiB per bucket (default: sized from the model, as the cache "
        "sizes it: an eighth of the gradients with the state on the host, a 32nd with the "
        "weights there too, 64 KiB to 4 MiB)",
    )
    plan.add_argument("--ratio", type=_ratio, default=1.0, help="compression ratio (default 1)")
    plan.add_argument(
        "--codec",
        choices=CODEC_NAMES,
        default=None,
        help="the codec of every tensor, whatever --ratio (default: per tensor, the "
        "best-training codec that fits 1/ratio of its bytes; topk: top-k with its default "
        "options, error feedback with an int8 residual)",
    )
    plan.add_argument("--tokens", type=_positive_int, default=None, help="tokens per step")
    plan.add_argument(
        "--tflops",
        type=_positive_float,
        default=DEFAULT_FLOPS / 1e12,
        help=f"the device's achieved TFLOP/s (default {DEFAULT_FLOPS / 1e12:.0f}: an H200 "
        "at 40%% of its dense bf16 peak)",
    )
    plan.add_argument(
        "--memory-budget",
        default=None,
        help="what memory_budget= would keep on the device ('80%%', '20GiB'), with the "
        "optimizer state offloaded too; a share needs --device-gib",
    )
    plan.add_argument(
        "--device-gib", type=_positive_float, default=None, help="the device's memory, GiB"
    )
    plan.add_argument(
        "--activations-mib",
        type=_non_negative_float,
        default=0.0,
        help="with --memory-budget: the activations at the end of backward, MiB (default 0: "
        "measure them, or the budget keeps too much)",
    )
    plan.add_argument(
        "--offload-parameters",
        action="store_true",
        help="add a column with the weights on the host too (offload_parameters=True, with "
        "the optimizer state there): the device's window (the rest and two blocks in forward "
        "and backward, two buckets' weights at the step), the host's bytes, the link's bytes "
        "a step, its time floor and the tokens a micro-batch at which it hides behind the "
        "compute; then the link per phase (forward, backward, the optimizer step) and "
        "direction: bytes, with --tokens the link's and the compute's times, the tokens a "
        "micro-batch from which each phase hides its copies, and the phase that binds; "
        "then the host's bytes a parameter (masters, bf16 wires, gradient store, optimizer "
        "state) for fp32 and bf16 compute with AdamW and 8-bit AdamW (and --optimizer's), "
        "this model's host GiB and the largest model --host-gib holds",
    )
    plan.add_argument(
        "--host-gib",
        type=_host_gib,
        default=None,
        help="with --offload-parameters: the host's RAM, GiB, for the largest model each "
        "layout holds, host_memory_fraction of it allowed (default: what this machine has "
        "available now)",
    )
    plan.add_argument(
        "--host-memory-fraction",
        type=_host_memory_fraction,
        default=None,
        help="with --offload-parameters: host_memory_fraction, the share of the host's RAM "
        "the cache may take, in (0, 1] (default: the library's, "
        f"{EngineConfig().host_memory_fraction:g})",
    )
    plan.add_argument(
        "--parameter-blocks",
        default=None,
        help="with --model and --offload-parameters: the dotted name of the module list "
        "holding the model's blocks, as parameter_blocks= takes it (default: the "
        "nn.ModuleList or nn.Sequential whose children hold the most bytes)",
    )
    plan.add_argument(
        "--blocks",
        type=_positive_int,
        default=None,
        help=f"with --params and --offload-parameters: the model's number of blocks, assumed "
        f"equal, the largest tensor (--largest) the rest (default {DEFAULT_BLOCKS})",
    )
    link = plan.add_mutually_exclusive_group()
    link.add_argument(
        "--link-gbps",
        type=_positive_float,
        default=None,
        help=f"host link GB/s per direction (default {DEFAULT_LINK_GBPS:g}: PCIe 5 x16)",
    )
    link.add_argument(
        "--measure-link",
        action="store_true",
        help="time pinned copies each way on the local GPU (256 MiB, about a second) and "
        "use the slower rate; without a GPU the default rate is used, and the plan says so",
    )
    return parser, demo, plan


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        state_bytes, state_tensor_bytes = optimizer_state_bytes(args.optimizer)
    except ValueError:
        parser.error(
            f"argument --optimizer: {args.optimizer!r} is not one of "
            f"{', '.join(OPTIMIZER_STATE_BYTES)} or a number of bytes >= 0"
        )
    _check_host_options(parser, args)
    _check_compute_dtype(parser, args)
    tensors, weights = _plan_model(parser, args)
    host_bytes = None if args.host_gib is None else int(args.host_gib * 2**30)
    fraction = {}
    if args.host_memory_fraction is not None:
        fraction = {"host_memory_fraction": args.host_memory_fraction}
    inputs = PlanInputs(
        tensors=tensors,
        param_bytes=args.param_bytes,
        grad_bytes=args.grad_bytes,
        optimizer_state_bytes=state_bytes,
        optimizer_tensor_bytes=state_tensor_bytes,
        micro_batches=args.micro_batches,
        compression_ratio=args.ratio,
        config=EngineConfig(codec=args.codec, bucket_size_mb=args.bucket_size_mb, **fraction),
        tokens_per_step=args.tokens,
        flops=args.tflops * 1e12,
        weights=weights,
        weight_copy_bytes=2 if args.compute_dtype == "bf16" else None,
        layout_optimizers=layout_optimizers(args.optimizer),
        host_bytes=host_bytes,
        **_link(args),
    )
    result = plan(inputs)
    print(format_plan(result, inputs))
    if args.memory_budget is not None:
        try:
            budget = MemoryBudget.parse(args.memory_budget)
            device = None if args.device_gib is None else int(args.device_gib * 2**30)
            decision = budget_decision(
                result,
                inputs,
                budget=budget,
                device_bytes=device,
                activation_bytes=int(args.activations_mib * MIB),
            )
        except (ValueError, TypeError) as error:
            parser.error(f"argument --memory-budget: {error}")
        except MemoryBudgetError as error:
            print(f"\nmemory_budget: {error}")
            return 1
        offloaded = "state and weights" if args.offload_parameters else "state"
        print(
            f"\nmemory_budget={budget.text!r}, {offloaded} offloaded too, activations "
            f"{args.activations_mib:g} MiB: {decision.describe()}."
        )
    return 0


def _plan_model(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[int], WeightLayout | None]:
    """The trainable parameters' sizes and, with --offload-parameters, the weights' blocks:
    a --model's own, or --params' assumed ones."""
    _check_block_options(parser, args)
    if args.model is None:
        if args.largest is not None and args.largest > args.params:
            parser.error(
                f"argument --largest: {args.largest} entries is more than --params "
                f"{args.params}: give the largest tensor's entries, at most the count"
            )
        tensors = tensors_of_count(args.params, largest=args.largest)
        if not args.offload_parameters:
            return tensors, None
        return tensors, weight_layout_of_count(tensors, blocks=args.blocks or DEFAULT_BLOCKS)
    try:
        model = model_of_factory(args.model)
    except (ImportError, AttributeError, ValueError, TypeError) as error:
        parser.error(f"argument --model: {error}")
    tensors = trainable_sizes(model)
    if not tensors:
        parser.error(
            f"argument --model: {args.model!r} built a {type(model).__name__} with no "
            "trainable parameters (none has requires_grad=True), so there are no gradients "
            "to plan for; give a model that trains, or a count with --params"
        )
    if not args.offload_parameters:
        return tensors, None
    try:
        return tensors, weight_layout(model, name=args.parameter_blocks)
    except ValueError as error:
        option = "--model" if args.parameter_blocks is None else "--parameter-blocks"
        parser.error(f"argument {option}: {error}")


def _check_block_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--blocks and --parameter-blocks: each only where it means something."""
    if args.blocks is not None and args.blocks < 2:
        parser.error(
            f"argument --blocks: {args.blocks} block(s); the weights stream a block at a "
            "time, one running and the next arriving: give 2 or more (the model's depth)"
        )
    if (args.blocks or args.parameter_blocks) and not args.offload_parameters:
        parser.error(
            "arguments --blocks and --parameter-blocks describe the weights' blocks: add "
            "--offload-parameters, or leave them out"
        )
    if args.blocks is not None and args.model is not None:
        parser.error(
            "argument --blocks: a --model's blocks are found in it (name their container "
            "with --parameter-blocks); --blocks is for --params"
        )
    if args.parameter_blocks is not None and args.model is None:
        parser.error(
            "argument --parameter-blocks: --params has no modules to name; give the number "
            "of blocks with --blocks"
        )


def _check_host_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--host-gib and --host-memory-fraction: only with the table they size."""
    for option, value in (
        ("--host-gib", args.host_gib),
        ("--host-memory-fraction", args.host_memory_fraction),
    ):
        if value is not None and not args.offload_parameters:
            parser.error(
                f"argument {option}: {value:g} sizes the host layouts table, printed with "
                "the weights on the host: add --offload-parameters, or leave it out"
            )


def _check_compute_dtype(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--compute-dtype: only with the weights it casts, and not with a budget (the engine
    refuses both)."""
    if args.compute_dtype != "fp32" and not args.offload_parameters:
        parser.error(
            f"argument --compute-dtype: {args.compute_dtype} is the weights' copies over the "
            "link (compute_dtype needs offload_parameters=True): add --offload-parameters, "
            "or leave it out"
        )
    if args.compute_dtype != "fp32" and args.memory_budget is not None:
        parser.error(
            f"argument --memory-budget: {args.memory_budget!r} cannot be combined with "
            f"--compute-dtype {args.compute_dtype}, as the engine refuses memory_budget with "
            "offload_parameters=True and a compute_dtype (a block the budget keeps would "
            "compute in its parameters' own dtype): leave one out"
        )


def _link(args: argparse.Namespace) -> dict[str, Any]:
    """The plan's ``link_gbps`` and ``link_source``, from the options."""
    if args.link_gbps is not None:
        return {"link_gbps": args.link_gbps, "link_source": "given with --link-gbps"}
    if not args.measure_link:
        return {}
    try:
        rate = measure_link()
    except RuntimeError as error:
        source = (
            f"assumed: PCIe 5 x16's achieved copy rate; --measure-link measured nothing: {error}"
        )
        print(f"gradient-cache plan: {source}", file=sys.stderr)
        return {"link_gbps": DEFAULT_LINK_GBPS, "link_source": source}
    return {
        "link_gbps": rate.slower_gbps,
        "link_source": (
            f"measured on {rate.device_name}: device to host {rate.device_to_host_gbps:.1f}, "
            f"host to device {rate.host_to_device_gbps:.1f} GB/s, "
            f"{rate.copy_bytes // MIB} MiB pinned copies; the slower is used"
        ),
    }


def _number(text: str) -> float:
    """``text`` as a float, NaN where it is not a number (each check refuses NaN)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _positive_float(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def _host_gib(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value) or value * 2**30 < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a finite number of GiB of a byte or more: give the host's RAM, "
            "e.g. 1024, or leave it out for what this machine has available now"
        )
    return value


def _host_memory_fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a share of the host's RAM in (0, 1]: give e.g. 0.9, or leave "
            f"it out for the library's {EngineConfig().host_memory_fraction:g}"
        )
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number in [0, 2**63 - 1)")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a finite number >= 1 (1 = lossless, r = at most 1/r of the bytes)"
        )
    return value


def _resolve_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """The device to train on; for ``emulated`` the CPU it runs on (each run installs the
    emulated device in its own process: installing it is for the whole process)."""
    if name in ("cpu", "emulated") or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        parser.error(
            f"argument --device: 'cuda' was asked for, but this torch {torch.__version__} "
            "sees no CUDA device (torch.cuda.is_available() is False); "
            "use --device cpu or --device auto"
        )
    return torch.device("cuda", torch.cuda.current_device())


def _output_folder(parser: argparse.ArgumentParser, out: Path | None) -> Path:
    if out is None:
        out = Path.cwd() / time.strftime("gradient-cache-demo-%Y%m%d-%H%M%S")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"argument --out: cannot use {str(out)!r} as a folder: {error.strerror}")
    return out
