"""The weights on the host (``offload_parameters=True``), with one owner, `Weights`: the
masters (`masters.HostWeights`) with their placement (`stream.OwnTensors` on one process,
`shard_stream.FsdpShards` under FSDP2), the hooks that move them (`stream.WeightStream`,
`shard_stream.ShardStream`, sharing `hooks`) and the fused step's `masters.StepJourney`.
docs/ARCHITECTURE.md, "The life of a weight".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..budget import REST
from ..config import EngineConfig
from ..fsdp_privates import (
    ShardedModule,
    flat_shards,
    initialize_roots,
    param_dtypes,
    sharded_modules,
)
from .blocks import WeightUnits, weight_units
from .masters import HostWeights, StepJourney
from .shard_stream import FsdpShards, ShardStream
from .stream import OwnTensors, WeightStream

if TYPE_CHECKING:
    from ..pipeline import Pipeline

Param = torch.nn.Parameter

__all__ = ["StepJourney", "Weights", "attach", "plan"]


@dataclass(eq=False)
class Weights:
    """``masters``, ``stream`` and, on one process, the ``units`` a memory budget may keep
    on the device, by name (a block's module name; the rest's, ``"(the rest)"``)."""

    masters: HostWeights
    stream: WeightStream | ShardStream
    units: dict[str, list[Param]] = field(default_factory=dict)

    def keep_on_device(self, names: Iterable[str]) -> None:
        """The units ``names`` on the device for good, as plain parameters (a memory
        budget's choice). Raises torch.OutOfMemoryError, all still on the host, without room."""
        params = [param for name in names for param in self.units.pop(name)]
        assert isinstance(self.stream, WeightStream)  # a budget is refused under FSDP2
        assert isinstance(self.masters.placement, OwnTensors)
        self.masters.placement.settle(self.masters, params)
        self.stream.settled(params)

    def close(self, *, refuse_an_awaited_backward: bool) -> None:
        """Every weight back on the device for good (else the placement raises or warns,
        before any hook goes), then the hooks removed. ``refuse_an_awaited_backward``:
        raise first where a forward's backward is still to come (it would read what moves)."""
        if (
            refuse_an_awaited_backward
            and isinstance(self.stream, WeightStream)
            and self.stream.awaited()
        ):
            raise RuntimeError(
                "remove_hooks() between a forward and its backward, with the weights on the "
                "host (offload_parameters=True): that backward would read weights the close "
                "moves and fail. Run the backward first, or drop the forward's outputs "
                "(del loss, logits) if no backward will come."
            )
        self.stream.end.after_a_failed_backward()  # else its last hook may bring one meanwhile
        self.masters.close()
        self.stream.remove()


def plan(
    model: torch.nn.Module,
    config: EngineConfig,
    patterns: Sequence[str],
    groups: Sequence[Sequence[Param]],
) -> WeightUnits | list[ShardedModule] | None:
    """With ``offload_parameters``: ``model``'s blocks, or under FSDP2 its ``fully_shard``
    modules, after refusing what it cannot be combined with."""
    if not config.offload_parameters:
        return None
    if patterns:
        raise ValueError(
            f"exclude_layers={list(patterns)} cannot be combined with offload_parameters=True: "
            "an excluded layer's gradient stays on the device, and its weights do not. Drop "
            "exclude_layers (every gradient is offloaded), or offload_parameters."
        )
    if groups:
        return _sharded_modules_or_refusal(model, config)
    sparse = [n for n, m in model.named_modules() if getattr(m, "sparse", False) is True]
    if config.compute_dtype is not None and sparse:
        raise ValueError(
            f"compute_dtype={config.compute_dtype} cannot be combined with a sparse gradient: "
            f"module {sparse[0] or type(model).__name__!r} (nn.Embedding(sparse=True)) gives "
            "one in the compute dtype, which cannot step its fp32 master. Make it dense "
            "(sparse=False), or drop compute_dtype."
        )
    devices = sorted({str(p.device) for p in model.parameters()})
    target = None if config.device is None else torch.device(config.device)
    on_it = target is not None and all(
        d.type == target.type and target.index in (None, d.index)
        for d in map(torch.device, devices)
    )
    if target is not None and devices != ["cpu"] and not on_it:
        raise ValueError(
            f"device={str(config.device)!r} sets up a model whose parameters are on the "
            f"host, and this one's are on {', '.join(devices)}. Build or load the model on "
            "the CPU (torch.device('cpu'), or load_state_dict(..., assign=True) into a "
            "model made on the meta device), or drop device for a model already on it."
        )
    if len(devices) > 1:
        raise ValueError(
            f"offload_parameters=True found the model's parameters on several devices "
            f"{devices}: its weights leave for the host and come back to one device, a block "
            "at a time. Put the whole model on one device (model.to(device)) before creating "
            "the cache."
        )
    return weight_units(model, name=config.parameter_blocks)


def _sharded_modules_or_refusal(
    model: torch.nn.Module, config: EngineConfig
) -> list[ShardedModule]:
    """Under FSDP2 the ``fully_shard`` modules are the blocks, and FSDP2 casts."""
    if config.compute_dtype is not None:
        raise ValueError(
            f"compute_dtype={config.compute_dtype} cannot be combined with FSDP2: FSDP2 "
            "casts the weights in its all-gathers. Drop compute_dtype and shard with "
            "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype="
            f"{config.compute_dtype}, reduce_dtype=torch.float32))."
        )
    if config.device is not None:
        raise ValueError(
            f"device={str(config.device)!r} cannot be combined with FSDP2: fully_shard puts "
            "each rank's shards on its device, from which the cache moves them to the host. "
            "Drop device."
        )
    if config.parameter_blocks is not None:
        raise ValueError(
            f"parameter_blocks={config.parameter_blocks!r} cannot be combined with FSDP2: "
            "each fully_shard module's shards stream on their own. Drop parameter_blocks."
        )
    return sharded_modules(model)


def attach(
    model: torch.nn.Module, pipeline: Pipeline, units: WeightUnits | list[ShardedModule]
) -> Weights:
    """The weights to host memory, their hooks on ``model``, their step journeys through
    ``pipeline``; if the masters raise (host budget, an unsharded parameter) the pipeline
    is closed and nothing stays attached."""
    backend, config = pipeline.backend, pipeline.config
    named = list(model.named_parameters())
    try:
        if isinstance(units, WeightUnits):
            placement: OwnTensors | FsdpShards = OwnTensors(backend, config.compute_dtype)
            together = [units.rest, *units.block_params]
        else:
            initialize_roots(units)
            placement = FsdpShards(flat_shards(units), param_dtypes(units))
            together = [[param] for _, param in named]
        masters = HostWeights(
            named,
            backend,
            placement,
            units=together,
            fraction=config.host_memory_fraction,
            compute_dtype=config.compute_dtype,
        )
    except BaseException:
        pipeline.close()
        raise
    pipeline.carry_weights(masters)
    if isinstance(units, WeightUnits):
        _buffers_to(model, backend.device)
        return Weights(masters, WeightStream(model, masters, units), _named_units(model, units))
    return Weights(masters, ShardStream(model, masters, units))


def _named_units(model: torch.nn.Module, units: WeightUnits) -> dict[str, list[Param]]:
    """``units``' parameters by unit name: each block's module name, and `REST`."""
    names = {id(module): name for name, module in model.named_modules()}
    named = {
        names[id(block)]: params
        for block, params in zip(units.blocks, units.block_params, strict=True)
    }
    return {REST: units.rest, **named} if units.rest else named


def _buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """``model``'s buffers on ``device``, where a model set up from the host computes."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.device != device:
                setattr(module, name, buffer.to(device))  # a buffer still, persistent or not
