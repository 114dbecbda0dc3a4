"""Which data-parallel wrappers the cache works under, and the refusal of the others.

Classic DDP (``DistributedDataParallel`` and ``torch.distributed._composable.replicate``,
which wraps it) reduces gradients in its reducer, after the post-accumulate-grad hook the
cache takes them in: cached gradients would be each rank's own, un-averaged, and the ranks'
weights would drift apart. Nor could offloading save memory there: the reducer keeps every
gradient in flat buckets allocated for the whole run. FSDP2 (``fully_shard``, HSDP meshes,
``replicate_with_fsdp``) reduces first and then runs the hooks on the reduced gradient.
"""

from __future__ import annotations

import sys

import torch

from .engine.fsdp_privates import is_fsdp_module
from .engine.sharding import INSTEAD, fsdp_param_groups


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


def _offloads_to_cpu(group: object) -> bool:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy)


def _is_ddp_replicate(module: torch.nn.Module) -> bool:
    """``torch.distributed._composable.replicate`` (DDP inside); not its FSDP2 namesake.
    Looked up, not imported: until something has imported the registry, no module is in it."""
    contract = sys.modules.get("torch.distributed._composable.contract")
    if contract is None or not hasattr(contract, "_get_registry"):  # torch before 2.6
        return False
    registry = contract._get_registry(module) or {}
    return "replicate" in registry and not is_fsdp_module(module)
