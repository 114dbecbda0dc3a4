"""FSDP2's sharded parameters: the engine caches each rank's own shard.

Under ``fully_shard`` a parameter and its reduce-scattered gradient are `DTensor`s: the
engine works on the local tensor (this rank's shard, uneven ones included) and restores
into a `DTensor` of the parameter's mesh and placements. Other tensors pass unchanged.
``torch.distributed.tensor`` is not imported here (0.9 s of a process's start): until
something has imported it, no tensor is a `DTensor`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist

from .fsdp_privates import fsdp_param_groups

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


# What to do instead of classic DDP: the refusals' common advice.
INSTEAD = (
    "Use FSDP2 instead: torch.distributed.fsdp.fully_shard(model) (or, to replicate "
    "rather than shard, torch.distributed._composable.replicate_with_fsdp.replicate), "
    "then create the cache on the sharded model. Under DDP itself, "
    "gradient_as_bucket_view=True already removes DDP's second copy of the gradients."
)


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a parameter or a gradient); a plain tensor itself."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():  # a view for the engine, never part of an autograd graph
        return tensor.to_local()


def local_shape(param: torch.Tensor) -> torch.Size:
    return local(param).shape


def as_grad_of(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` (a local tensor) as ``param.grad``: a `DTensor` like ``param`` where it is one;
    a gradient that is one already (held in ``.grad``, never cached) as it is."""
    if not is_dtensor(param) or is_dtensor(grad):
        return grad
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return DTensor.from_local(
            grad,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the number of processes; (0, 1) outside torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def fsdp_groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """The sharded parameters of each FSDP2 group, as one reduce-scatter produces them."""
    return [[p.sharded_param for p in group.fsdp_params] for group in fsdp_param_groups(model)]


def check_placements(named_params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """Refuse sharded parameters the cache is not tested with, naming them."""
    sharded = [(n, p) for n, p in named_params if is_dtensor(p)]
    if not sharded:
        return
    from torch.distributed.tensor import Replicate, Shard

    supported = ((Shard(0),), (Replicate(),), (Replicate(), Shard(0)))  # as the refusal names
    for name, param in sharded:
        if tuple(param.placements) not in supported:
            raise ValueError(
                f"Parameter {name!r} is a DTensor with placements {list(param.placements)}; the "
                "gradient cache supports FSDP2's fully_shard (Shard(dim=0)), "
                "replicate_with_fsdp (Replicate()) and HSDP (Replicate(), Shard(dim=0)). "
                "Tensor-parallel and other placements are untested: list these layers in "
                "exclude_layers, or train without the cache."
            )
    meshes: list[Any] = []
    for _, param in sharded:  # equal meshes: the same ranks and shape
        if param.device_mesh not in meshes:
            meshes.append(param.device_mesh)
    if len(meshes) > 1:
        raise ValueError(
            f"The cached parameters live on {len(meshes)} device meshes ({meshes[0]}, "
            f"{meshes[1]}, ...); one manager serves "
            "one mesh (the clip norm is reduced over it). Pass one mesh to every fully_shard, "
            "or list the other mesh's layers in exclude_layers."
        )
    if len(sharded) != len(named_params) and dist.get_world_size() > 1:
        plain = [n for n, p in named_params if not is_dtensor(p)]
        raise ValueError(
            f"{len(plain)} cached parameters ({', '.join(plain[:3])}) are not sharded while "
            "the others are: FSDP2 does not reduce their gradients across ranks. Apply "
            "fully_shard to the root module too, or list them in exclude_layers. (After a "
            "forward without gradients FSDP2's root holds its all-gathered parameters, "
            "which are not sharded: call model.reshard() before creating the cache.)"
        )


def global_norm(
    norms: Iterable[tuple[torch.Tensor, torch.Tensor]], norm_type: float
) -> torch.Tensor:
    """The norm over every rank of ``(parameter, local norm)`` pairs, on the first norm's
    device, as ``clip_grad_norm_`` returns it (no host read): sharded norms combined over
    the shard dimensions first (one all-reduce), then all in the given order, as
    ``clip_grad_norm_`` does for `DTensor`s, to its bits. Replicated ones count once."""
    pairs = list(norms)
    if not pairs:
        return torch.zeros(())
    values = [norm for _, norm in pairs]
    device = values[0].device
    sharded = [i for i, (param, _) in enumerate(pairs) if _shard_dims(param)]
    if sharded:
        first = pairs[sharded[0]][0]
        assert is_dtensor(first)  # only a DTensor has shard dimensions
        mesh = first.device_mesh
        collective = collective_device(local(first).device, mesh.device_type)
        # Combined with every shard's: max for inf, else the p-th root of a sum of p-th powers.
        inf = norm_type == float("inf")
        stacked = torch.stack([values[i].to(collective) for i in sharded])
        value = stacked if inf else stacked.pow(norm_type)
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        for dim in _shard_dims(first):
            dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        for i, reduced in zip(sharded, value if inf else value.pow(1.0 / norm_type), strict=True):
            values[i] = reduced
    return torch.linalg.vector_norm(torch.stack([v.to(device) for v in values]), norm_type)


def _shard_dims(param: torch.Tensor) -> list[int]:
    if not is_dtensor(param):
        return []
    from torch.distributed.tensor import Shard

    return [d for d, p in enumerate(param.placements) if isinstance(p, Shard)]


def collective_device(param_device: torch.device, mesh_device_type: str) -> torch.device:
    """Where the norms' all-reduce runs: the parameters' device where the mesh's backend
    runs there, else the mesh's device type (gloo on a CPU mesh). Not ``"cuda"`` alone: it
    is ``cuda:0`` without ``torch.cuda.set_device``, where nccl hangs on the other ranks."""
    if param_device.type == mesh_device_type:
        return param_device
    return torch.device(mesh_device_type)


def check_gradient_is_reduced(name: str, grad: torch.Tensor) -> None:
    """At the first hook, refuse a plain gradient across processes: nobody reduced it yet
    (a DDP wrapper the cache never saw: created on ``ddp.module``, say)."""
    world_size = rank_and_world_size()[1]
    if world_size > 1 and not is_dtensor(grad):
        raise RuntimeError(
            f"Parameter {name!r} got a plain (not DTensor) gradient while "
            f"torch.distributed runs {world_size} processes: under DDP the cache "
            "would take it before DDP averages it, and the ranks would drift apart. If the "
            f"model is inside DistributedDataParallel, remove the cache. {INSTEAD}"
        )
