"""`gradient-cache plan`: what a model's training step holds, plain against the cache.

Arithmetic on the parameters' sizes only: the model is built on the meta device (nothing
is allocated) or given as a parameter count, and no manager is created. Activations are
the user's (batch, sequence, checkpointing) and are left out. The cache's figures are the
engine's own: each tensor's route (`engine.route`: its codec's payload bytes, its residual,
its pinned slot), ``staging_depth`` buckets in flight.

With the weights on the host too (``offload_parameters=True``, `PlanInputs.weights`), the
model's parameters are cut as `engine.weights.blocks.weight_units` cuts them: blocks, which
come to the device one ahead of the one running, and the rest (embeddings, final norm,
head, tied weights), on the device from forward to the end of backward. `hiding_tokens`
derives the tokens per micro-batch at which the link's bytes take no longer than the
compute, pooled over the step; `phase_links` cuts the same bytes by phase (forward,
backward, the optimizer step) and direction, each phase against its own compute;
`host_layouts` gives the host's bytes a parameter for each layout the library supports (fp32
or bf16 compute, AdamW or 8-bit AdamW) and the largest model a host's RAM holds in each.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from .engine.budget import REST, BudgetDecision, Candidate, MemoryBudget, decide, unit_candidates
from .engine.config import EngineConfig
from .engine.hostmem import available_host_bytes
from .engine.pool import reserved_bytes
from .engine.route import Codecs, Route, plan_routes
from .engine.units import MIB
from .engine.weights.blocks import weight_units
from .engine.weights.masters import UNIT_ALIGN

#: 8-bit Adam (bitsandbytes' and torchao's AdamW8bit, Adam8bit): two moments of one uint8
#: code an entry, each with an fp32 scale per block of 256 entries.
EIGHT_BIT_ADAM_BYTES = 2 * (1 + 4 / 256)
#: Per tensor, torchao's: its 0-dim fp32 step and a 256-entry fp32 code table per moment
#: (bitsandbytes counts steps in Python and shares two tables: 2 KiB in all).
EIGHT_BIT_ADAM_TENSOR_BYTES = 4 + 2 * 256 * 4
#: Optimizer state: (bytes per parameter, bytes per tensor), fp32 state unless named 8-bit;
#: Adam's per-tensor bytes are its step counter (a 0-dim fp32 tensor in torch's Adam and
#: AdamW). Both 8-bit libraries keep tensors under 4096 entries (biases, norms) in fp32,
#: 8 bytes an entry, which the 8-bit figure leaves out: under 1% of the state of the
#: demo's GPT (tests/test_eight_bit.py measures both libraries).
#: torchao's AdamW4bit: two moments of 4-bit codes (two an entry in a byte), each with an
#: fp32 scale per block of 128 entries; per tensor its step and a 16-entry fp32 code table
#: per moment. Its AdamWFp8: two float8_e4m3 moments, an fp32 scale per 256 entries; per
#: tensor its step. (Measured: tests/test_eight_bit.py.)
FOUR_BIT_ADAM_BYTES = 2 * (0.5 + 4 / 128)
FOUR_BIT_ADAM_TENSOR_BYTES = 4 + 2 * 16 * 4
FP8_ADAM_BYTES = 2 * (1 + 4 / 256)
OPTIMIZER_STATE_BYTES = {
    "sgd": (0, 0),
    "sgd-momentum": (4, 0),
    "adam": (8, 4),
    "adamw": (8, 4),
    "adam8bit": (EIGHT_BIT_ADAM_BYTES, EIGHT_BIT_ADAM_TENSOR_BYTES),
    "adamw8bit": (EIGHT_BIT_ADAM_BYTES, EIGHT_BIT_ADAM_TENSOR_BYTES),
    "adamw4bit": (FOUR_BIT_ADAM_BYTES, FOUR_BIT_ADAM_TENSOR_BYTES),
    "adamwfp8": (FP8_ADAM_BYTES, 4),
}
#: The quantized Adams quantize tensors of at least this many entries; smaller ones
#: (biases, norms) keep two fp32 moments, 8 bytes an entry, and no code tables.
EIGHT_BIT_MIN_ENTRIES = 4096
EIGHT_BIT_OPTIMIZERS = ("adam8bit", "adamw8bit", "adamw4bit", "adamwfp8")
#: The optimizers of the host layouts table (`host_layouts`), each with fp32 and bf16 compute.
LAYOUT_OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit")
#: Bytes an entry of a weight's wire: with ``compute_dtype=torch.bfloat16`` each floating
#: weight keeps, beside its fp32 master, the master cast to bf16 on the host, which forward
#: and backward bring to the device (`engine.weights.masters`).
WIRE_BYTES = 2
#: The components of a host layout, in the table's order.
MASTERS, WIRES, GRADIENT_STORE, HOST_STATE = (
    "masters",
    "bf16 wires",
    "gradient store",
    "optimizer state",
)
#: Time-floor defaults: an H200 at 40% of its 989 TFLOP/s dense bf16, PCIe 5 x16 at the
#: ~50 GB/s a copy achieves per direction.
DEFAULT_FLOPS = 0.4 * 989e12
DEFAULT_LINK_GBPS = 50.0
#: With the weights on the host and a parameter count instead of a model, the blocks are
#: unknown: this many equal blocks (a 7B transformer's depth), the largest tensor the rest.
DEFAULT_BLOCKS = 32


@dataclass(frozen=True)
class WeightLayout:
    """The weights' units with ``offload_parameters``: each block's parameter entries in
    forward order, the rest's entries, and where the cut came from (printed)."""

    blocks: tuple[int, ...]
    rest: int
    source: str

    def window(self) -> int:
        """Entries on the device in forward and backward: the rest, and the two
        consecutive blocks (the one running, the next arriving) holding the most."""
        pairs = [first + second for first, second in itertools.pairwise(self.blocks)]
        return self.rest + max(pairs, default=sum(self.blocks))

    def entries_per_micro_batch(self) -> int:
        """Entries brought to the device a micro-batch: each block's twice (forward, then
        backward again) but the last one's, the rest's once (they stay from forward to
        the end of backward)."""
        return 2 * sum(self.blocks) - self.blocks[-1] + self.rest


def weight_layout(model: torch.nn.Module, *, name: str | None = None) -> WeightLayout:
    """``model``'s blocks and rest as `weight_units` cuts them (``name``: the container of
    its blocks, as ``parameter_blocks`` names it; None: found). Raises its ValueError."""
    units = weight_units(model, name=name)
    found = f"the blocks of {name!r}" if name else "the blocks found in the model"
    return WeightLayout(
        blocks=tuple(sum(p.numel() for p in params) for params in units.block_params),
        rest=sum(p.numel() for p in units.rest),
        source=f"{found}, {len(units.blocks)} of them",
    )


def weight_layout_of_count(tensors: list[int], *, blocks: int = DEFAULT_BLOCKS) -> WeightLayout:
    """A parameter count's assumed cut (no module to look into): the largest tensor (the
    embedding, as `tensors_of_count` takes it) is the rest, the other entries ``blocks``
    equal blocks."""
    if blocks < 2:
        raise ValueError(
            f"blocks={blocks}: the weights stream a block at a time, one running and the next "
            "arriving; give the model's number of repeated blocks (2 or more, e.g. 32)."
        )
    rest = max(tensors)
    share, extra = divmod(sum(tensors) - rest, blocks)
    return WeightLayout(
        blocks=tuple(share + (index < extra) for index in range(blocks)),
        rest=rest,
        source=f"assumed: {blocks} equal blocks (--blocks), the largest tensor the rest",
    )


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What the plan is for; ``tensors`` are the trainable parameters' sizes."""

    tensors: list[int]
    param_bytes: int = 4  # per entry
    grad_bytes: int = 4
    optimizer_state_bytes: float = 8  # per parameter
    optimizer_tensor_bytes: int = 4  # per parameter tensor (Adam's step counter)
    micro_batches: int = 1
    compression_ratio: float = 1.0
    config: EngineConfig = field(default_factory=EngineConfig)
    tokens_per_step: int | None = None
    flops: float = DEFAULT_FLOPS
    link_gbps: float = DEFAULT_LINK_GBPS
    #: Where ``link_gbps`` came from, printed beside it.
    link_source: str = "assumed: PCIe 5 x16's achieved copy rate, not measured"
    #: With ``offload_parameters``: the weights' blocks and rest (adds the last column).
    weights: WeightLayout | None = None
    #: Bytes an entry of the weights' copies in forward and backward; None: ``param_bytes``
    #: (the engine copies the master as it is); 2: a bf16 ``compute_dtype``, whose wires
    #: (the masters' casts, kept on the host) cross (``plan --compute-dtype bf16``).
    weight_copy_bytes: int | None = None
    #: With ``weights``: the host RAM, bytes, the layouts table's largest models are for
    #: (``config.host_memory_fraction`` of it allowed, as the engine allows); None: what
    #: this machine has available now (`engine.hostmem.available_host_bytes`).
    host_bytes: int | None = None
    #: The optimizers of the layouts table's rows: names of `OPTIMIZER_STATE_BYTES` or
    #: numbers of bytes a parameter.
    layout_optimizers: tuple[str, ...] = LAYOUT_OPTIMIZERS

    def __post_init__(self) -> None:
        # The CLI's parsers refuse these too; the Python API must not divide by a zero rate
        # or plan for no parameters and answer with inf, nan or a bare max() error.
        if not self.tensors or min(self.tensors) < 1:
            raise ValueError(
                f"tensors={self.tensors!r}: give the trainable parameters' sizes, each a "
                "whole number >= 1 (`trainable_sizes(model)`)."
            )
        positive = {"flops": self.flops, "link_gbps": self.link_gbps}
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r}: give a finite rate > 0.")
        counts = {"micro_batches": self.micro_batches, "tokens_per_step": self.tokens_per_step}
        for name, count in counts.items():
            if count is not None and count < 1:
                raise ValueError(f"{name}={count!r}: give a whole number >= 1.")
        if not (math.isfinite(self.compression_ratio) and self.compression_ratio >= 1):
            raise ValueError(
                f"compression_ratio={self.compression_ratio!r}: give a finite number, 1 "
                "(lossless) or more."
            )
        if self.host_bytes is not None and self.host_bytes < 1:
            raise ValueError(
                f"host_bytes={self.host_bytes!r}: give the host RAM in bytes (>= 1), or None "
                "for what this machine has available now."
            )


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Bytes per component, per way of training; and the time floor, if tokens were given."""

    device: dict[str, dict[str, int]]  # way -> component -> bytes, on the device
    host: dict[str, int]  # the cache's host components
    pcie_bytes_per_step: dict[str, int]  # direction -> bytes
    restore_seconds: float
    compute_seconds: float | None
    #: With offload_optimizer_state: the state's bytes each direction per step, and the
    #: step's copies to the device (restores and state) at the link's rate, the floor of
    #: its step (the copies back run the other way, at the same time).
    state_bytes_per_step: int
    state_step_seconds: float
    #: With ``PlanInputs.weights``: the last column's figures.
    weights: WeightsOnHost | None = None
    #: With ``PlanInputs.weights``: the host's bytes in each layout (`host_layouts`).
    layouts: tuple[HostLayout, ...] = ()


@dataclass(frozen=True, kw_only=True)
class WeightsOnHost:
    """The weights on the host (``offload_parameters=True``, with the state there too)."""

    window_bytes: int  # on the device in forward and backward: the rest and two blocks
    rest_bytes: int
    step_bytes: int  # on the device at the step: two buckets' weights
    host_bytes: int  # every parameter's fp32 master (param_bytes an entry)
    copy_bytes: int  # an entry of the weights' copies in forward and backward
    streamed_bytes_per_micro_batch: int  # those copies, one micro-batch
    link_bytes_per_step: dict[str, int]  # direction -> weights, state and gradients
    link_seconds: float  # the busier direction at the link's rate: the step's floor
    step_seconds: float  # the step's copies to the device (gradients, state, weights)
    hiding_tokens: float  # tokens a micro-batch at which the compute takes as long
    phases: tuple[PhaseLink, ...]  # the same link bytes by phase: forward, backward, step


@dataclass(frozen=True, kw_only=True)
class HostLayout:
    """The host's bytes with the weights there (``offload_parameters=True``, the state
    there too) for one compute dtype and optimizer: each component's bytes a parameter,
    and this model's bytes with what the planner counts per tensor on top."""

    compute: str  # "fp32 compute", or "bf16 compute_dtype" (the weights' bf16 wires)
    optimizer: str  # a name of `OPTIMIZER_STATE_BYTES`, or bytes a parameter
    per_parameter: dict[str, float]  # component -> bytes a parameter, `MASTERS` ... order
    model_bytes: int  # this model's: per parameter, alignment and per-tensor bytes
    numel: int  # this model's parameters

    @property
    def name(self) -> str:
        return f"{self.compute}, {self.optimizer}"

    def bytes_per_parameter(self) -> float:
        return sum(self.per_parameter.values())

    def overhead_bytes(self) -> float:
        """This model's bytes beyond its parameters' (alignment, per-tensor bytes)."""
        return self.model_bytes - self.bytes_per_parameter() * self.numel

    def largest_model(self, allowed_bytes: int) -> int:
        """Parameters of the largest model shaped like this one (the same overheads a
        parameter) whose host bytes fit in ``allowed_bytes``."""
        return allowed_bytes * self.numel // self.model_bytes


@dataclass(frozen=True, kw_only=True)
class PhaseLink:
    """One phase's copies with the weights on the host. The link is full duplex: each
    direction has the whole rate, and a phase hides its copies where each direction's
    take no longer than its compute."""

    phase: str
    per: str  # what ``link_bytes`` count: "a micro-batch" (forward, backward) or "a step"
    #: direction -> bytes; backward's are a micro-batch's from the second on, which also
    #: brings the stored gradients back to be added to.
    link_bytes: dict[str, int]
    link_bytes_per_step: dict[str, int]  # direction -> bytes over the step's micro-batches
    link_seconds: dict[str, float]  # direction -> ``link_bytes`` at the link's rate
    #: The phase's FLOPs a token: forward 2 x N, backward 4 x N (of 6 x N); the fused
    #: optimizer step's few FLOPs a parameter count as none.
    flops_per_token: float
    compute_seconds: float | None  # a micro-batch's (tokens a step / micro-batches), or None
    #: direction -> tokens a micro-batch from which the compute takes as long as the
    #: copies; empty for the optimizer step, which has no compute to hide them behind.
    hiding_tokens: dict[str, float]

    def tokens_to_hide(self) -> float:
        """Tokens a micro-batch from which both directions hide (inf: never)."""
        return max(self.hiding_tokens.values(), default=math.inf)


WAYS = ("plain", "cache, apply_gradients()", "cache, fused step()", "fused step(), state on host")
STATE_ON_HOST = WAYS[3]
WEIGHTS_ON_HOST = "fused step(), state and weights on host"  # with PlanInputs.weights
GRADIENTS_IN_BACKWARD = "gradients, end of backward"  # the cache's: buckets in flight
GRADIENTS_AT_STEP = "gradients, optimizer step"
PARAMETERS_AT_STEP = "parameters, optimizer step"  # "parameters": forward and backward's
DIRECTIONS = ("host to device", "device to host")


def plan(inputs: PlanInputs) -> Plan:
    """The figures of `PlanInputs` (see the module docstring)."""
    tensors = inputs.tensors
    numel = sum(tensors)
    config = inputs.config
    params = numel * inputs.param_bytes
    grads = numel * inputs.grad_bytes
    state = int(numel * inputs.optimizer_state_bytes) + inputs.optimizer_tensor_bytes * len(tensors)
    largest = max(tensors) * inputs.grad_bytes
    bucket = config.bucket_bytes(grads) + largest  # a bucket closes past its size
    in_flight = config.staging_depth * bucket
    # The fused step restores the bucket it steps and the next one (restore_ahead on CUDA).
    fused_step_grads = min(grads, 2 * bucket)
    backward_grads = min(grads, in_flight)  # the cache's: buckets not yet copied
    step_grads = {"plain": grads, WAYS[1]: grads, WAYS[2]: fused_step_grads}
    # With the state on the host the cache sizes its buckets from the model (`bucket_bytes`).
    state_bucket = state_on_host(config).bucket_bytes(grads) + largest
    step_grads[STATE_ON_HOST] = min(grads, 2 * state_bucket)
    per_param_state = int(numel * inputs.optimizer_state_bytes)
    step_state = {way: state for way in WAYS}
    step_state[STATE_ON_HOST] = _state_at_step(inputs, state_bucket)
    device = {
        way: {
            "parameters": params,
            PARAMETERS_AT_STEP: params,
            "optimizer state": step_state[way],
            GRADIENTS_IN_BACKWARD: grads if way == "plain" else backward_grads,
            GRADIENTS_AT_STEP: step_grads[way],
        }
        for way in WAYS
    }
    payload, residual = _host_figures(tensors, inputs)
    slots, pool = _pool_figures(tensors, inputs)
    host = {
        "stored gradients": payload,
        "error-feedback residual": residual,
        "pinned pool (CUDA)": pool,
        "optimizer state (state on host)": per_param_state,
    }
    # Per micro-batch, each payload goes out; from the second on, the cached one comes back
    # to be added to (accumulation), and the last comes back at the restore. A host
    # residual crosses in its stored form in for every encode and out after it.
    on_host = config.residual_options.residual_location == "host"
    per_encode = payload + (residual if on_host else 0)
    # The first micro-batch's payload (`_first_payload`): with the weights on the host, a
    # carried bf16 gradient's may be narrower than the later ones'.
    # The second's joins it as carried (`DensePayload.followed_by`): out as narrow, and back
    # (a clipped step's norm, before the step: `phase_links`) only as the first's bytes.
    first = _first_payload(tensors, inputs, payload) if inputs.weights else payload
    crossing = per_encode * inputs.micro_batches - payload + first
    second_saves = payload - first if inputs.micro_batches > 1 else 0
    pcie = {"device to host": crossing - second_saves, "host to device": crossing}
    restore_seconds = payload / (inputs.link_gbps * 1e9)
    compute_seconds = None
    if inputs.tokens_per_step is not None:
        compute_seconds = 6 * numel * inputs.tokens_per_step / inputs.flops
    weights = None
    layouts: tuple[HostLayout, ...] = ()
    if inputs.weights is not None:
        layouts = host_layouts(inputs, store_bytes=(slots, pool))
        # With the weights on the host too the cache's buckets are smaller still.
        weights_bucket = weights_on_host_config(config).bucket_bytes(grads) + largest
        weights = weights_on_host(
            inputs,
            bucket=weights_bucket,
            gradients=pcie,
            payload=payload,
            per_encode=per_encode,
            first=first,
        )
        host["parameters (weights on host)"] = weights.host_bytes
        device[WEIGHTS_ON_HOST] = device[STATE_ON_HOST] | {
            "parameters": weights.window_bytes,
            PARAMETERS_AT_STEP: weights.step_bytes,
            "optimizer state": _state_at_step(inputs, weights_bucket),
            GRADIENTS_AT_STEP: min(grads, 2 * weights_bucket),
        }
    return Plan(
        device=device,
        host=host,
        pcie_bytes_per_step=pcie,
        restore_seconds=restore_seconds,
        compute_seconds=compute_seconds,
        state_bytes_per_step=per_param_state,
        state_step_seconds=(payload + per_param_state) / (inputs.link_gbps * 1e9),
        weights=weights,
        layouts=layouts,
    )


def _state_at_step(inputs: PlanInputs, bucket: int) -> int:
    """With the state on the host: the state of the two buckets of ``bucket`` gradient bytes
    at the step (the one stepped, the one arriving) on the device; scalars (a step counter
    per tensor) stay there."""
    numel = sum(inputs.tensors)
    per_param = int(numel * inputs.optimizer_state_bytes)
    buckets = int(2 * bucket / inputs.grad_bytes * inputs.optimizer_state_bytes)
    return min(per_param, buckets) + inputs.optimizer_tensor_bytes * len(inputs.tensors)


def host_layouts(inputs: PlanInputs, *, store_bytes: tuple[int, int]) -> tuple[HostLayout, ...]:
    """The host's bytes with the weights there, a layout for each of
    ``inputs.layout_optimizers`` with the weights' dtype in compute, then each with a bf16
    ``compute_dtype`` (none where the weights are 2-byte already). ``store_bytes``: the
    gradient store's (CUDA pinned pool's) slots and what its slabs reserve, `_pool_figures`.

    A parameter: its master (``param_bytes``), its bf16 wire (2), its gradient's slot, its
    state (`OPTIMIZER_STATE_BYTES`). This model adds its tensors' alignment (a unit's
    masters and wires each start on `UNIT_ALIGN` entries; the pool's slots on 64 bytes, in
    power-of-two slabs) and the state's per-tensor bytes; 8-bit Adam's tensors under
    `EIGHT_BIT_MIN_ENTRIES` keep fp32 moments."""
    tensors, numel = inputs.tensors, sum(inputs.tensors)
    slots, pool = store_bytes
    padded = sum(-(-size // UNIT_ALIGN) * UNIT_ALIGN for size in tensors)
    names = {2: "bf16", 4: "fp32", 8: "fp64"}
    computes = {f"{names.get(inputs.param_bytes, inputs.param_bytes)} compute": 0}
    if inputs.param_bytes > WIRE_BYTES:
        computes["bf16 compute_dtype"] = WIRE_BYTES
    layouts = []
    for compute, wire in computes.items():
        for optimizer in inputs.layout_optimizers:
            per_param, state_bytes = host_state_bytes(tensors, optimizer)
            per_parameter = {
                MASTERS: float(inputs.param_bytes),
                WIRES: float(wire),
                GRADIENT_STORE: slots / numel,
                HOST_STATE: per_param,
            }
            weights = padded * (inputs.param_bytes + wire)
            layouts.append(
                HostLayout(
                    compute=compute,
                    optimizer=_optimizer_label(optimizer),
                    per_parameter=per_parameter,
                    model_bytes=weights + pool + state_bytes,
                    numel=numel,
                )
            )
    return tuple(layouts)


def layout_optimizers(optimizer: str) -> tuple[str, ...]:
    """The layouts table's optimizers: `LAYOUT_OPTIMIZERS`, and ``optimizer`` (a name of
    `OPTIMIZER_STATE_BYTES` or bytes a parameter) where its state's bytes differ from
    theirs. Raises ValueError for an optimizer it does not know."""
    known = {optimizer_state_bytes(name) for name in LAYOUT_OPTIMIZERS}
    if optimizer_state_bytes(optimizer) in known:
        return LAYOUT_OPTIMIZERS
    return (*LAYOUT_OPTIMIZERS, optimizer)


def _optimizer_label(optimizer: str) -> str:
    """A name of `OPTIMIZER_STATE_BYTES` as it is, a number as its bytes a parameter."""
    name = optimizer.lower()
    return name if name in OPTIMIZER_STATE_BYTES else f"{float(optimizer):g} B/param state"


def host_state_bytes(tensors: list[int], optimizer: str) -> tuple[float, int]:
    """(bytes a parameter, ``tensors``' bytes) of ``optimizer``'s state (a name of
    `OPTIMIZER_STATE_BYTES` or bytes a parameter) on the host: per parameter and per
    tensor as the table gives them, 8-bit Adam's tensors under `EIGHT_BIT_MIN_ENTRIES`
    entries at 8 bytes an entry (fp32 moments, no code tables). Raises ValueError for
    an optimizer it does not know."""
    per_param, per_tensor = optimizer_state_bytes(optimizer)
    small = EIGHT_BIT_MIN_ENTRIES if optimizer.lower() in EIGHT_BIT_OPTIMIZERS else 0
    total = 0
    for size in tensors:
        if size < small:
            total += 8 * size
        else:
            total += int(size * per_param) + per_tensor
    return per_param, total


def host_allowance(inputs: PlanInputs) -> tuple[int, int, str]:
    """(host RAM, the bytes the layouts may take, where the RAM's figure came from): the
    RAM is ``inputs.host_bytes`` or what this machine has available now, and the engine
    allows ``config.host_memory_fraction`` of it."""
    if inputs.host_bytes is not None:
        ram, source = inputs.host_bytes, "given with --host-gib"
    else:
        ram = available_host_bytes()
        source = "available on this machine now: psutil's, capped by its cgroups; --host-gib"
    return ram, int(ram * inputs.config.host_memory_fraction), source


def weights_on_host(
    inputs: PlanInputs,
    *,
    bucket: int,
    gradients: dict[str, int],
    payload: int,
    per_encode: int,
    first: int,
) -> WeightsOnHost:
    """The weights-on-host column's figures (``inputs.weights`` set); ``bucket``: a bucket's
    gradient bytes, ``gradients``: their link bytes a step (direction -> bytes),
    ``payload``: their restore's, ``per_encode``: a micro-batch's each way in backward,
    ``first``: the first micro-batch's payload (`_first_payload`). The state crosses as in
    the state-on-host column."""
    layout = inputs.weights
    if layout is None:
        raise ValueError("weights_on_host needs PlanInputs.weights (the blocks and the rest)")
    numel = sum(inputs.tensors)
    weights = numel * inputs.param_bytes  # the trainable ones, stepped a bucket at a time
    state = int(numel * inputs.optimizer_state_bytes)
    copy_bytes = inputs.weight_copy_bytes or inputs.param_bytes
    streamed = layout.entries_per_micro_batch() * copy_bytes
    # The step: each weight to the device and back, with its state (each way) and its
    # gradient (as the gradients' own link bytes count them).
    to_device = inputs.micro_batches * streamed + weights + state + gradients["host to device"]
    to_host = weights + state + gradients["device to host"]
    rate = inputs.link_gbps * 1e9
    return WeightsOnHost(
        # Forward and backward compute on the copies that crossed: a unit's device buffer is
        # in the compute dtype (bf16 wires: 2 bytes an entry), the step's in the masters'.
        window_bytes=layout.window() * copy_bytes,
        rest_bytes=layout.rest * copy_bytes,
        # The two buckets at the step (stepped, arriving): their gradients' entries as weights.
        step_bytes=min(weights, int(2 * bucket / inputs.grad_bytes * inputs.param_bytes)),
        host_bytes=(sum(layout.blocks) + layout.rest) * inputs.param_bytes,
        copy_bytes=copy_bytes,
        streamed_bytes_per_micro_batch=streamed,
        link_bytes_per_step={"host to device": to_device, "device to host": to_host},
        link_seconds=max(to_device, to_host) / rate,
        step_seconds=(payload + state + weights) / rate,
        hiding_tokens=hiding_tokens(max(to_device, to_host), inputs),
        phases=phase_links(inputs, payload=payload, per_encode=per_encode, first=first),
    )


def phase_links(
    inputs: PlanInputs, *, payload: int, per_encode: int, first: int | None = None
) -> tuple[PhaseLink, ...]:
    """The weights-on-host link by phase and direction (``inputs.weights`` set);
    ``payload``: the stored gradients' bytes, ``per_encode``: a micro-batch's gradient
    bytes each way in backward (the payload, and a host residual: in before its encode,
    out after it).

    Forward brings each block's weights and the rest's (c bytes an entry); backward the
    blocks' but the last again, sends the gradients out and, from the second micro-batch
    on, brings the stored ones back to be added to; the fused step brings each master
    (``param_bytes``), its state and its restored gradient, and takes the master and state
    back. Over a step the phases add up to `weights_on_host`'s link bytes."""
    layout = inputs.weights
    if layout is None:
        raise ValueError("phase_links needs PlanInputs.weights (the blocks and the rest)")
    numel, micro_batches = sum(inputs.tensors), inputs.micro_batches
    copy_bytes = inputs.weight_copy_bytes or inputs.param_bytes
    forward = (sum(layout.blocks) + layout.rest) * copy_bytes  # the rest stays to backward's end
    # Backward brings the blocks again, but the last, kept from its forward.
    blocks = (sum(layout.blocks) - layout.blocks[-1]) * copy_bytes
    residual = per_encode - payload
    master_and_state = numel * inputs.param_bytes + int(numel * inputs.optimizer_state_bytes)
    accumulations = micro_batches - 1
    # The first micro-batch's payload (carried bf16: half), brought back by the second's
    # encode or else by the restore. The second's (carried too) goes out beside it in the
    # same slot; the first part comes back then only for a clipped step's norm (counted:
    # without clipping nothing crosses back before the third). The later ones' are the
    # full payload.
    first = payload if first is None else first
    brought_back = first + max(accumulations - 1, 0) * payload if accumulations else 0
    second = first + residual  # a carried part has no residual: lossless
    sent = first + (second + (accumulations - 1) * per_encode if accumulations else 0)
    restored = payload if accumulations else first
    return (
        _phase_link(
            inputs,
            phase="forward",
            per_micro_batch={"host to device": forward},
            per_step={"host to device": micro_batches * forward},
            flops_per_token=2 * numel,
        ),
        _phase_link(
            inputs,
            phase="backward",
            per_micro_batch={
                "host to device": blocks + residual + (payload if accumulations else 0),
                "device to host": per_encode if accumulations else first + residual,
            },
            per_step={
                "host to device": micro_batches * (blocks + residual) + brought_back,
                "device to host": sent + residual,
            },
            flops_per_token=4 * numel,
        ),
        _phase_link(
            inputs,
            phase="optimizer step",
            per_micro_batch=None,
            per_step={
                "host to device": master_and_state + restored,  # the restore's gradients
                "device to host": master_and_state,
            },
            flops_per_token=0,
        ),
    )


def _phase_link(
    inputs: PlanInputs,
    *,
    phase: str,
    per_micro_batch: dict[str, int] | None,
    per_step: dict[str, int],
    flops_per_token: float,
) -> PhaseLink:
    """One phase's figures from its bytes (a direction left out moves none);
    ``per_micro_batch`` None: a phase that runs once a step."""
    per_step = _both_directions(per_step)
    link_bytes = per_step if per_micro_batch is None else _both_directions(per_micro_batch)
    rate = inputs.link_gbps * 1e9
    link_seconds = {direction: value / rate for direction, value in link_bytes.items()}
    compute_seconds = None
    if inputs.tokens_per_step is not None:
        tokens = inputs.tokens_per_step / inputs.micro_batches
        compute_seconds = flops_per_token * tokens / inputs.flops
    hiding = {}
    if flops_per_token:  # T tokens take flops_per_token x T / F seconds
        hiding = {d: s * inputs.flops / flops_per_token for d, s in link_seconds.items()}
    return PhaseLink(
        phase=phase,
        per="a step" if per_micro_batch is None else "a micro-batch",
        link_bytes=link_bytes,
        link_bytes_per_step=per_step,
        link_seconds=link_seconds,
        flops_per_token=flops_per_token,
        compute_seconds=compute_seconds,
        hiding_tokens=hiding,
    )


def _both_directions(link_bytes: dict[str, int]) -> dict[str, int]:
    """``link_bytes`` with both directions, in `DIRECTIONS` order (one left out: none)."""
    return {direction: link_bytes.get(direction, 0) for direction in DIRECTIONS}


def binding_phase(phases: tuple[PhaseLink, ...]) -> PhaseLink:
    """The phase with compute that needs the most tokens a micro-batch to hide its copies."""
    return max((phase for phase in phases if phase.flops_per_token), key=PhaseLink.tokens_to_hide)


def hiding_tokens(link_bytes_per_step: int, inputs: PlanInputs) -> float:
    """Tokens a micro-batch at which a step's compute takes as long as its link bytes (the
    busier direction; the other runs at the same time).

    Compute a step: 6 x N x m x T FLOPs (N parameters, m micro-batches of T tokens) at F
    FLOP/s; link: the bytes at B bytes/s. Equal at T = F x bytes / (6 x N x m x B). With the
    weights on the host, to the device a step: m x (2c x N_blocks + c x N_rest) weights'
    copies (c bytes an entry), N x (p + s) in the step (fp32 master p, state s bytes a
    parameter) and m x g x N of gradients (lossless; the accumulation's from the second
    micro-batch on, then the restore); so, the rest small:
    T ~ (F / B) x (2c + g + (p + s) / m) / 6.
    """
    # The (F / B) x (4 + s / m) / 6 for bf16 copies (c = 2) is this formula without
    # g (the gradients that come back each micro-batch: 4 B fp32 lossless, less with a
    # codec) and without p / m (the fp32 master to the device in the step); both are
    # there, so the figure is a lower bound. Like it, the step's copies back (p + s)
    # are not added: the link carries both directions at once, and a bucket's copy back
    # runs beside the next bucket's restore.
    compute_per_token = 6 * sum(inputs.tensors) * inputs.micro_batches / inputs.flops
    return link_bytes_per_step / (inputs.link_gbps * 1e9) / compute_per_token


def _routes(tensors: list[int], inputs: PlanInputs, *, steps: int) -> list[Route]:
    """The engine's route for each tensor after ``steps`` steps."""
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[inputs.grad_bytes]
    codecs = Codecs.for_options(inputs.config, ratio=inputs.compression_ratio, selection="exact")
    shapes = {i: ((numel,), dtype) for i, numel in enumerate(tensors)}
    return list(plan_routes(shapes, codecs=codecs, config=inputs.config, steps=steps).values())


def _first_payload(tensors: list[int], inputs: PlanInputs, payload: int) -> int:
    """The first micro-batch's stored gradients (nothing to join them): with a narrower
    compute dtype (``weight_copy_bytes``) and lossless routes they cross as they came,
    its bytes an entry (`engine.capture.Capture._carried`); else ``payload``."""
    copy_bytes = inputs.weight_copy_bytes or inputs.grad_bytes
    routes = _routes(tensors, inputs, steps=inputs.config.warmup_steps)
    if copy_bytes >= inputs.grad_bytes or any(route.codec.lossy for route in routes):
        return payload
    return sum(tensors) * copy_bytes


def _host_figures(tensors: list[int], inputs: PlanInputs) -> tuple[int, int]:
    """(payload bytes, residual bytes held between steps), once the warm-up is over."""
    routes = _routes(tensors, inputs, steps=inputs.config.warmup_steps)
    return sum(r.payload_bytes for r in routes), sum(r.residual_bytes for r in routes)


def _pool_figures(tensors: list[int], inputs: PlanInputs) -> tuple[int, int]:
    """The CUDA backend's pinned pool at the start: (its slots' bytes, what it reserves).
    One slot per parameter (its largest payload's regions, its host residual), packed
    into power-of-two slabs (what the pinned allocator reserves)."""
    routes = _routes(tensors, inputs, steps=0)
    layout = {index: route.slot for index, route in enumerate(routes)}
    return sum(sum(slot.parts()) for slot in layout.values()), reserved_bytes(layout)


def budget_decision(
    result: Plan,
    inputs: PlanInputs,
    *,
    budget: MemoryBudget,
    device_bytes: int | None,
    activation_bytes: int,
) -> BudgetDecision:
    """What ``memory_budget`` would keep on the device after its measured steps, with the
    state offloaded too: the steady step's peak taken as the state-on-host column's (with the
    weights on the host, theirs) plus ``activation_bytes`` at the end of backward; each
    tensor's gradient and state the candidates, as `budget.candidates_of` makes them for a
    live model (with the weights on the host, each unit of weights, as `budget.units_of`)."""
    if budget.nbytes is None and device_bytes is None:
        raise ValueError(
            f"memory_budget={budget.text!r} is a share of the device's memory: give the "
            "device's memory too (--device-gib)."
        )
    way = STATE_ON_HOST if inputs.weights is None else WEIGHTS_ON_HOST
    measured = max(
        peak_bytes(result, way, GRADIENTS_IN_BACKWARD) + activation_bytes,
        peak_bytes(result, way, GRADIENTS_AT_STEP),
    )
    budget_bytes = budget.bytes_of(device_bytes)
    if inputs.weights is None:
        candidates = _tensor_candidates(inputs)
    else:  # the budget keeps units of weights (`budget.units_of`)
        units, size = inputs.weights, inputs.param_bytes
        blocks = [(f"block {i}", n * size) for i, n in enumerate(units.blocks)]
        candidates = unit_candidates((REST, units.rest * size), blocks)
    return decide(candidates, measured_peak=measured, budget_bytes=budget_bytes, budget=budget.text)


def _tensor_candidates(inputs: PlanInputs) -> list[Candidate]:
    """Each tensor's gradient and state, as `budget.candidates_of` makes them."""
    routes = _routes(inputs.tensors, inputs, steps=inputs.config.warmup_steps)
    candidates = []
    for index, (numel, route) in enumerate(zip(inputs.tensors, routes, strict=True)):
        name = f"tensor {index}"
        if route.residual is None:
            link = 2 * (route.payload_bytes + route.residual_bytes)
            candidates.append(Candidate(name, "gradient", numel * inputs.grad_bytes, link))
        state = int(numel * inputs.optimizer_state_bytes)
        if state:
            candidates.append(Candidate(name, "optimizer state", state, 2 * state))
    return candidates


def tensors_of_factory(path: str) -> list[int]:
    """The trainable parameters' sizes of ``package.module:function()``, built on meta."""
    return trainable_sizes(model_of_factory(path))


def trainable_sizes(model: torch.nn.Module) -> list[int]:
    """Each trainable parameter's entries, in ``model.parameters()`` order."""
    return [p.numel() for p in model.parameters() if p.requires_grad]


def model_of_factory(path: str) -> torch.nn.Module:
    """The model ``package.module:function()`` returns, built on the meta device.

    A factory that moves tensors itself (``.to("cuda")``, loading weights) would allocate
    or fail there: give it a way to build without data, or pass a parameter count.
    """
    module_name, _, function_name = path.partition(":")
    if not module_name or not function_name:
        raise ValueError(
            f"--model {path!r}: expected package.module:function (a factory returning an "
            "nn.Module), e.g. gradient_cache.demo.models:medium"
        )
    if os.getcwd() not in sys.path:  # as `python -m` would: modules of the current folder
        sys.path.insert(0, os.getcwd())
    factory: Callable[[], torch.nn.Module] = getattr(
        importlib.import_module(module_name), function_name
    )
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model {path!r} returned {type(model).__name__}, not an nn.Module.")
    return model


def state_on_host(config: EngineConfig) -> EngineConfig:
    """``config`` with ``offload_optimizer_state=True``, as the state-on-host column runs."""
    return (
        config if config.offload_optimizer_state else replace(config, offload_optimizer_state=True)
    )


def weights_on_host_config(config: EngineConfig) -> EngineConfig:
    """``config`` with the state and the weights on the host, as the weights-on-host column
    runs (its automatic buckets are smaller: `EngineConfig.bucket_bytes`)."""
    return replace(config, offload_optimizer_state=True, offload_parameters=True)


def format_plan(result: Plan, inputs: PlanInputs) -> str:
    """Markdown tables of the plan, then what they leave out."""
    lines = [*_device_table(result), "", *_host_table(result)]
    numel = sum(inputs.tensors)
    grads = numel * inputs.grad_bytes
    bucket_mb = inputs.config.bucket_bytes(grads) / MIB
    state_bucket_mb = state_on_host(inputs.config).bucket_bytes(grads) / MIB
    others = []
    if state_bucket_mb != bucket_mb:
        others.append(f"{state_bucket_mb:.3g} MiB with the state on the host")
    if inputs.weights is not None:
        weights_bucket_mb = weights_on_host_config(inputs.config).bucket_bytes(grads) / MIB
        if weights_bucket_mb != state_bucket_mb:
            others.append(f"{weights_bucket_mb:.3g} MiB with the weights there too")
    buckets = f"{bucket_mb:.3g} MiB" + (f" ({', '.join(others)})" if others else "")
    lines += [
        "",
        f"{numel / 1e6:.1f}M trainable parameters in {len(inputs.tensors)} tensors; "
        f"compression_ratio {inputs.compression_ratio:g}, {inputs.micro_batches} micro-batch(es) "
        f"per step, buckets of {buckets}, staging depth "
        f"{inputs.config.staging_depth}.",
        "Activations are left out: they depend on batch, sequence and checkpointing, and add "
        "to the end of backward's figure (the last micro-batch's) and not to the step's. The "
        "cache's backward holds at most the buckets in flight (staging depth x (bucket + "
        "largest gradient)); its fused step the bucket it steps and the next one.",
        f"Host link: {inputs.link_gbps:.3g} GB/s per direction ({inputs.link_source}).",
        f"Restore (the copies on the step's critical path): {result.restore_seconds * 1e3:.2f} ms "
        f"at {inputs.link_gbps:.3g} GB/s.",
    ]
    lines.append(
        f"State on host (offload_optimizer_state=True, the fourth column): the optimizer "
        f"state crosses the link both ways every step, "
        f"{result.state_bytes_per_step / MIB:.1f} MiB each way; the step's copies to the "
        f"device (restores and state) take at least {result.state_step_seconds * 1e3:.2f} ms "
        f"at {inputs.link_gbps:.3g} GB/s, the copies back overlapping them. Its state row is "
        "the step's (two buckets' state); between steps the device holds none of it."
    )
    copies = max(result.pcie_bytes_per_step.values()) / (inputs.link_gbps * 1e9)
    lines.append(
        f"All of a step's copies, one direction: {copies * 1e3:.2f} ms; they overlap "
        "backward, but a link busier than the step's compute sets its pace."
    )
    if result.compute_seconds is not None:
        lines.append(
            f"Compute of the step (6 x parameters x {inputs.tokens_per_step} tokens at "
            f"{inputs.flops / 1e12:.0f} TFLOP/s): {result.compute_seconds * 1e3:.2f} ms; the "
            f"restore is {result.restore_seconds / result.compute_seconds:.1%} of it, all "
            f"copies {copies / result.compute_seconds:.0%}."
        )
    if result.weights is not None and inputs.weights is not None:
        lines += _weights_notes(result, result.weights, inputs.weights, inputs)
        lines += ["", *_phase_table(result.weights.phases, inputs), ""]
        lines += _phase_notes(result, result.weights, inputs)
    if result.layouts:
        ram, allowed, source = host_allowance(inputs)
        lines += ["", *_layouts_table(result.layouts, allowed), ""]
        lines += _layouts_notes(result.layouts, inputs, ram=ram, allowed=allowed, source=source)
    return "\n".join(lines)


def _device_table(result: Plan) -> list[str]:
    """The device's components per way, then what each way holds at the two moments. The
    parameters at the step get their own row where the weights column differs there."""
    ways = list(result.device)
    components = list(result.device[WAYS[0]])
    labels = {"parameters": "parameters"}
    if result.weights is None:
        components.remove(PARAMETERS_AT_STEP)
    else:
        labels["parameters"] = "parameters, forward and backward"
    lines = ["| on the device, MiB | " + " | ".join(ways) + " |", "|---|" + "---:|" * len(ways)]
    for component in components:
        cells = [f"{result.device[way][component] / MIB:.1f}" for way in ways]
        lines.append(f"| {labels.get(component, component)} | " + " | ".join(cells) + " |")
    for moment in (GRADIENTS_IN_BACKWARD, GRADIENTS_AT_STEP):
        peaks = [peak_bytes(result, way, moment) / MIB for way in ways]
        lines.append(
            f"| **held at the {moment.split(', ')[1]}** | "
            + " | ".join(f"**{p:.1f}**" for p in peaks)
            + " |"
        )
    return lines


def _host_table(result: Plan) -> list[str]:
    """Host memory and the link's bytes a step."""
    lines = ["| in host memory (cache), MiB | |", "|---|---:|"]
    lines += [f"| {name} | {value / MIB:.1f} |" for name, value in result.host.items()]
    lines += [
        f"| PCIe per step, {direction} | {value / MIB:.1f} |"
        for direction, value in result.pcie_bytes_per_step.items()
    ]
    lines.append(
        f"| PCIe per step, state on host, each way | {result.state_bytes_per_step / MIB:.1f} |"
    )
    if result.weights is not None:
        lines += [
            f"| PCIe per step, weights on host, {direction} | {value / MIB:.1f} |"
            for direction, value in result.weights.link_bytes_per_step.items()
        ]
    return lines


def _weights_notes(
    result: Plan, weights: WeightsOnHost, layout: WeightLayout, inputs: PlanInputs
) -> list[str]:
    """What the weights-on-host column holds and moves, its floor and its hiding tokens."""
    rate = inputs.link_gbps
    copies = "weight_copy_bytes" if inputs.weight_copy_bytes else "the master's: copied as it is"
    lines = [
        f"Weights on host (offload_parameters=True with the state on host, the last column; "
        f"blocks: {layout.source}): the host keeps every weight's master, "
        f"{weights.host_bytes / MIB:.1f} MiB; the device holds in forward and backward the "
        f"rest (embeddings, final norm, head, tied weights: {weights.rest_bytes / MIB:.1f} "
        f"MiB) and the two consecutive blocks holding the most (the one running, the next "
        f"arriving), {weights.window_bytes / MIB:.1f} MiB in all; at the step two buckets' "
        f"weights, {weights.step_bytes / MIB:.1f} MiB, beside their gradients and state.",
        f"Each micro-batch brings the blocks' weights twice (forward, then backward again) and "
        f"the rest once, at {weights.copy_bytes} bytes an entry ({copies}): "
        f"{weights.streamed_bytes_per_micro_batch / MIB:.1f} MiB; the step brings each weight "
        f"to the device and takes it back ({inputs.param_bytes} bytes an entry each way), with "
        f"the state and the gradients. Per step "
        + ", ".join(
            f"{direction} {value / MIB:.1f} MiB"
            for direction, value in weights.link_bytes_per_step.items()
        )
        + f": at least {weights.link_seconds * 1e3:.2f} ms at {rate:.3g} GB/s (the busier "
        f"direction; the other runs beside it), {weights.step_seconds * 1e3:.2f} ms of it the "
        "step's copies to the device.",
        f"The link hides behind the compute from {weights.hiding_tokens:,.0f} tokens a "
        f"micro-batch ({inputs.micro_batches} a step; compute 6 x parameters x tokens at "
        f"{inputs.flops / 1e12:.0f} TFLOP/s against the busier direction's bytes at "
        f"{rate:.3g} GB/s).",
    ]
    if result.compute_seconds is not None:
        share = weights.link_seconds / result.compute_seconds
        pace = "the link sets the pace" if share > 1 else "the compute sets the pace"
        lines.append(
            f"Against this step's compute ({result.compute_seconds * 1e3:.2f} ms): the weights "
            f"column's link floor is {share:.0%} of it; {pace}."
        )
    return lines


def _phase_table(phases: tuple[PhaseLink, ...], inputs: PlanInputs) -> list[str]:
    """The weights-on-host link per phase and direction: bytes, then (with tokens) the
    link's and the compute's times, then the tokens a micro-batch that hide the copies."""
    times = ["link, ms", "compute, ms"] if inputs.tokens_per_step is not None else []
    columns = ["MiB", *times, "hides from, tokens a micro-batch"]
    lines = [
        "| link per phase | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for phase in phases:
        for direction in DIRECTIONS:
            cells = [f"{phase.link_bytes[direction] / MIB:.1f}"]
            if phase.compute_seconds is not None:
                compute = phase.compute_seconds * 1e3 if phase.flops_per_token else None
                cells.append(f"{phase.link_seconds[direction] * 1e3:.2f}")
                cells.append("~0" if compute is None else f"{compute:.2f}")
            hiding = phase.hiding_tokens.get(direction)
            cells.append("never" if hiding is None else f"{hiding:,.0f}")
            label = f"{phase.phase}, {direction}, {phase.per}"
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _phase_notes(result: Plan, weights: WeightsOnHost, inputs: PlanInputs) -> list[str]:
    """How the phase table is counted, its binding phase, and the step's unhidden floor."""
    copies = (
        f"{inputs.weight_copy_bytes} bytes an entry (weight_copy_bytes)"
        if inputs.weight_copy_bytes
        else f"{inputs.param_bytes} bytes an entry: the engine copies the master (fp32 unless "
        "--param-bytes 2) as it is (a bf16 compute_dtype brings its wires: --compute-dtype "
        "bf16)"
    )
    binding = binding_phase(weights.phases)
    tokens = binding.tokens_to_hide()
    step = weights.phases[-1]
    floor = max(step.link_seconds.values())
    lines = [
        f"Link per phase: each direction at {inputs.link_gbps:.3g} GB/s (the link is full "
        f"duplex); forward's compute 2 x parameters x tokens, backward's 4 x, at "
        f"{inputs.flops / 1e12:.0f} TFLOP/s (achieved: --tflops counts the MFU in); the "
        f"weights at {copies}."
        + (
            " Backward's rows are a micro-batch's from the second on, which also brings the "
            "stored gradients back to be added to."
            if inputs.micro_batches > 1
            else ""
        ),
        f"Binding: {binding.phase}, which hides its copies from {tokens:,.0f} tokens a "
        f"micro-batch (pooled over the step, the figure above: {weights.hiding_tokens:,.0f}). "
        f"The optimizer step has no compute to hide its copies behind: they take at least "
        f"{floor * 1e3:.2f} ms a step (the busier direction).",
    ]
    step_compute, phase_compute = result.compute_seconds, binding.compute_seconds
    if inputs.tokens_per_step is None or step_compute is None or phase_compute is None:
        return lines  # no tokens: no times
    per_micro_batch = inputs.tokens_per_step / inputs.micro_batches
    pace = "sets" if per_micro_batch < tokens else "does not set"
    busy = max(binding.link_seconds.values()) / phase_compute
    share = floor / (step_compute + floor)
    lines.append(
        f"At {per_micro_batch:,.0f} tokens a micro-batch {binding.phase}'s link {pace} its "
        f"pace ({busy:.0%} of its compute); the optimizer step's floor is {share:.0%} of a "
        f"step of {step_compute * 1e3:.2f} ms of compute plus that floor."
    )
    return lines


def _layouts_table(layouts: Sequence[HostLayout], allowed: int) -> list[str]:
    """Each layout's bytes a parameter, this model's host GiB and the largest model that
    ``allowed`` bytes hold."""
    components = list(layouts[0].per_parameter)
    largest = f"largest model in {allowed / 2**30:,.1f} GiB"
    columns = [*components, "all", "this model, GiB", largest]
    lines = [
        "| host, offload_parameters=True: bytes a parameter | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for layout in layouts:
        cells = [f"{value:.2f}" for value in layout.per_parameter.values()]
        cells += [
            f"**{layout.bytes_per_parameter():.2f}**",
            f"{layout.model_bytes / 2**30:,.1f}",
            f"{layout.largest_model(allowed):,}",
        ]
        lines.append(f"| {layout.name} | " + " | ".join(cells) + " |")
    return lines


def _layouts_notes(
    layouts: Sequence[HostLayout], inputs: PlanInputs, *, ram: int, allowed: int, source: str
) -> list[str]:
    """What the layouts table counts a parameter and a tensor, and what its largest
    models are."""
    fraction = inputs.config.host_memory_fraction
    first = layouts[0]
    return [
        "Host layouts, offload_parameters=True with the state on the host: the first five "
        "figures are bytes a parameter: each weight's master (the weights' dtype; fp32: "
        "4), with compute_dtype=torch.bfloat16 its bf16 wire beside it (2: the master cast "
        "on the host, what forward and backward bring to the device), the gradient store (the "
        "CUDA pinned pool's slots for this plan's codec and ratio; lossless fp32: 4), the "
        "optimizer state (adamw: two fp32 moments, 8; adamw8bit: two uint8 codes with an "
        f"fp32 scale per 256 entries, {EIGHT_BIT_ADAM_BYTES:.2f}; adamw4bit, torchao's: two "
        f"4-bit codes with an fp32 scale per 128 entries, {FOUR_BIT_ADAM_BYTES:.2f}).",
        f"This model ({sum(inputs.tensors):,} parameters in {len(inputs.tensors)} tensors) "
        "adds what the planner counts per tensor: the masters' and wires' alignment "
        f"({UNIT_ALIGN} entries), the pool's (64 bytes) and its power-of-two slabs, the "
        "state's per-tensor bytes (Adam's step, 4; 8-bit Adam's code tables, 2 KiB; 4-bit's, "
        "128 bytes) and the quantized Adams' fp32 moments for tensors under "
        f"{EIGHT_BIT_MIN_ENTRIES} entries: "
        f"{first.overhead_bytes() / MIB:,.1f} MiB for {first.name}. Not counted: the ends of "
        "the slabs the masters, wires and state are cut from (a region, such as a block's "
        "masters, is never split across slabs: one a little over a power of two leaves "
        "its slab's end to smaller ones), the process itself and the data.",
        f"Largest model: one shaped like this one (the same overheads a parameter) whose "
        f"host bytes fit host_memory_fraction {fraction:g} of {ram / 2**30:,.1f} GiB "
        f"({source}), {allowed / 2**30:,.1f} GiB: floor(that / (this model's host bytes / "
        "its parameters)). The engine checks each host allocation (the pool, the masters and "
        "wires, the state's slabs as they grow) against host_memory_fraction of what is "
        "free at the time, so a model within this passes every check; "
        "--host-memory-fraction 1 gives the RAM's ceiling.",
    ]


def peak_bytes(result: Plan, way: str, moment: str) -> int:
    """Parameters, optimizer state and the gradients held at ``moment`` (no activations);
    the parameters at the step are the step's (two buckets' with the weights on the host)."""
    on_device = result.device[way]
    params = on_device[PARAMETERS_AT_STEP if moment == GRADIENTS_AT_STEP else "parameters"]
    return params + on_device["optimizer state"] + on_device[moment]


def optimizer_state_bytes(value: str) -> tuple[float, int]:
    """(bytes per parameter, per tensor) of a name in `OPTIMIZER_STATE_BYTES` (``sgd``,
    ``sgd-momentum``, ``adam``, ``adamw``, ``adam8bit``, ``adamw8bit``), or of a number of
    bytes per parameter."""
    if value.lower() in OPTIMIZER_STATE_BYTES:
        per_param, per_tensor = OPTIMIZER_STATE_BYTES[value.lower()]
        return float(per_param), per_tensor
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(value)
    return number, 0


def tensors_of_count(count: int, *, largest: int | None = None) -> list[int]:
    """A parameter count as tensor sizes: the ``largest`` one (default: 1% of the count,
    as for a transformer's embedding), then the rest in tensors of at most its size."""
    largest = max(1, min(count, largest or count // 100))
    sizes = [largest]
    rest = count - largest
    while rest > 0:
        sizes.append(min(largest, rest))
        rest -= sizes[-1]
    return sizes
