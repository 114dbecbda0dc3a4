"""Which data-parallel wrappers the cache works under, and the refusal of the others.

Classic DDP (``DistributedDataParallel`` and ``torch.distributed._composable.replicate``,
which wraps it) reduces gradients in its reducer, after the post-accumulate-grad hook the
cache takes them in: cached gradients would be each rank's own, un-averaged, and the ranks'
weights would drift apart. Nor could offloading save memory there: the reducer keeps every
gradient in flat buckets allocated for the whole run. FSDP2 (``fully_shard``, HSDP meshes,
``replicate_with_fsdp``) reduces first and then runs the hooks on the reduced gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .engine.sharding import fsdp_param_groups, is_dtensor

INSTEAD = (
    "Use FSDP2 instead: torch.distributed.fsdp.fully_shard(model) (or, to replicate "
    "rather than shard, torch.distributed._composable.replicate_with_fsdp.replicate), "
    "then create the cache on the sharded model. Under DDP itself, "
    "gradient_as_bucket_view=True already removes DDP's second copy of the gradients."
)


def check_data_parallel(model: torch.nn.Module) -> None:
    """Raise if ``model`` is, or contains, a module under classic DDP or FSDP2's CPU offload."""
    for group in fsdp_param_groups(model):
        if _offloads_to_cpu(group):
            raise ValueError(
                f"{type(model).__name__} is sharded with FSDP2's CPUOffloadPolicy, which "
                "already keeps its gradients in host memory (and runs the optimizer step "
                "there): the cache would have nothing to take off the device. Use one of the "
                "two: CPUOffloadPolicy, or the cache (whose fused step(optimizer) keeps the "
                "optimizer on the device) on a model sharded without it."
            )
    for module in model.modules():
        if isinstance(module, torch.nn.parallel.DistributedDataParallel) or _is_ddp_replicate(
            module
        ):
            kind = type(module).__name__ if module is model else f"a {type(module).__name__}"
            raise TypeError(
                f"The gradient cache cannot run under classic DistributedDataParallel "
                f"(found {kind} in {type(model).__name__}): DDP averages gradients after "
                "the backward hook the cache takes them in, so each rank would keep its own "
                "un-averaged gradients and the ranks' weights would drift apart; and DDP's "
                "reducer keeps every gradient in its buckets for the whole run, so "
                f"offloading could not save memory anyway. {INSTEAD}"
            )


def check_gradient_is_reduced(name: str, grad: torch.Tensor) -> None:
    """At the first hook: across processes, a plain gradient was reduced by nobody yet.

    Catches a model whose DDP wrapper the cache never saw (created on ``ddp.module``, say).
    """
    if is_dtensor(grad) or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        raise RuntimeError(
            f"Parameter {name!r} got a plain (not DTensor) gradient while "
            f"torch.distributed runs {dist.get_world_size()} processes: under DDP the cache "
            "would take it before DDP averages it, and the ranks would drift apart. If the "
            f"model is inside DistributedDataParallel, remove the cache. {INSTEAD}"
        )


def _offloads_to_cpu(group: object) -> bool:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy)


def _is_ddp_replicate(module: torch.nn.Module) -> bool:
    """``torch.distributed._composable.replicate`` (DDP inside); not its FSDP2 namesake."""
    try:
        from torch.distributed._composable.contract import _get_registry
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch before 2.6, or without distributed
        return False

    registry = _get_registry(module) or {}
    return "replicate" in registry and not isinstance(module, FSDPModule)
