"""Every private name of FSDP2 (and of `DTensor`) the cache reads, in one place: FSDP2 has
no public API for its parameter groups, shards, forward order, prefetch lists or copy-in
stream. `check_fsdp_privates` refuses at creation a torch without one of `FSDP_PRIVATES`,
so the reads below have no silent default (docs/ARCHITECTURE.md, "Under FSDP2").
FSDP2 is looked up, not imported (0.9 s of a process's start): until something has
imported it, no module is sharded.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

Param = torch.nn.Parameter


def local_object(param: torch.Tensor) -> torch.Tensor:
    """The tensor object a `DTensor` holds as its local part (`local` gives a view)."""
    return cast("DTensor", param)._local_tensor


def set_local(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """``tensor`` as the local part of `DTensor` ``param`` (whose identity the optimizer
    keeps), as FSDP2's own ``reset_sharded_param`` sets it; ``tensor`` has its shape."""
    cast("DTensor", param)._local_tensor = tensor


def is_fsdp_module(module: object) -> bool:
    """Whether ``module`` is one ``fully_shard`` made (an ``FSDPModule``)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def fsdp_param_groups(model: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups (one per ``fully_shard`` call) under ``model``, read from
    its module state as its own hooks do (there is no public getter)."""
    return [
        group
        for module in model.modules()
        if is_fsdp_module(module)
        for group in param_groups(cast("FSDPModule", module)._get_fsdp_state())
    ]


def param_groups(state: Any) -> list[Any]:
    """The parameter groups of FSDP2's ``FSDPState``: ``_fsdp_param_groups`` (torch 2.13
    on: several where ``shard_placement_fn`` gives several meshes, and the singular is a
    property that raises then), else ``_fsdp_param_group`` (one or None: 2.6 and 2.10)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


# FSDP2's private names this module reads, by the class that holds them ("a or b": either).
FSDP_PRIVATES = {
    "FSDPModule": ("_get_fsdp_state",),
    "FSDPState": (
        "_fsdp_param_groups or _fsdp_param_group",
        "_modules",
        "_lazy_init",
        "_comm_ctx",
        "_states_to_forward_prefetch",
        "_states_to_backward_prefetch",
    ),
    "FSDPParamGroup": ("fsdp_params", "comm_ctx", "_post_forward_indices", "is_unsharded"),
    "FSDPParam": ("sharded_param", "_sharded_param_data"),
    "FSDPParam, after lazy init": ("param_dtype",),
    "FSDPCommContext": ("post_forward_order", "all_gather_copy_in_stream"),  # from lazy init
    "DTensor": ("_local_tensor",),
}


def check_fsdp_privates(module: Any, *, initialized: bool = False) -> None:
    """Raises, naming torch's version, where FSDP2's objects for ``fully_shard`` ``module``
    lack one of `FSDP_PRIVATES`; the communication context's once ``initialized`` (the
    root's lazy init sets it)."""

    def require(kind: str, holder: Any) -> None:
        for names in FSDP_PRIVATES[kind]:
            if not any(hasattr(holder, name) for name in names.split(" or ")):
                raise RuntimeError(
                    f"offload_parameters=True under FSDP2 cannot run on torch "
                    f"{torch.__version__}: FSDP2's {kind} has no {names!r}, one of the "
                    "private names the cache reads to follow its all-gathers (all present "
                    "in torch 2.6.0, 2.10.0, 2.13.0, 2.14.1 and 2.15.0). Use one of those torch "
                    "versions, or drop offload_parameters."
                )

    require("FSDPModule", module)
    state = module._get_fsdp_state()
    require("FSDPState", state)
    for group in param_groups(state):
        require("FSDPParamGroup", group)
        for fsdp_param in group.fsdp_params:
            require("FSDPParam", fsdp_param)
            require("DTensor", fsdp_param.sharded_param)
            if initialized:
                require("FSDPParam, after lazy init", fsdp_param)
        if initialized:
            require("FSDPCommContext", group.comm_ctx)
    if initialized:
        require("FSDPCommContext", state._comm_ctx)


@dataclass
class ShardedModule:
    """A ``fully_shard`` module, its FSDP2 state and its groups' parameters (FSDP2's, sharded)."""

    module: torch.nn.Module
    state: Any  # FSDP2's FSDPState
    topmost: bool  # under no other fully_shard module: a root, or one when called alone
    fsdp_params: list[Any] = field(init=False)
    params: list[Param] = field(init=False)

    def __post_init__(self) -> None:
        self.fsdp_params = [fp for group in self.groups for fp in group.fsdp_params]
        self.params = [fp.sharded_param for fp in self.fsdp_params]

    @property
    def groups(self) -> list[Any]:
        return param_groups(self.state)


def sharded_modules(model: torch.nn.Module) -> list[ShardedModule]:
    """Each ``fully_shard`` module under ``model`` (itself first, where it is one) with its
    sharded parameters; raises for ``fully_shard([a, b])`` (one state over two modules)."""
    found: list[ShardedModule] = []
    names: list[str] = []
    for name, module in model.named_modules():
        if not is_fsdp_module(module):
            continue
        check_fsdp_privates(module)
        state = module._get_fsdp_state()
        if len(state._modules) > 1:
            raise ValueError(
                f"offload_parameters=True cannot stream FSDP2 group {name or 'the model'!r}: "
                "it was sharded with other modules in one fully_shard([...]) call, whose "
                "shards the cache cannot follow. Call fully_shard on each module on its own."
            )
        topmost = not any(name.startswith(f"{outer}.") or not outer for outer in names)
        names.append(name)
        found.append(ShardedModule(cast(torch.nn.Module, module), state, topmost))
    _refuse_a_root_outside(model, [sharded.module for sharded in found if sharded.topmost])
    return found


def _refuse_a_root_outside(model: torch.nn.Module, topmost: list[torch.nn.Module]) -> None:
    """Refuse a cache on a module inside a ``fully_shard`` model: the cache's lazy init
    would make its shards roots of their own, which FSDP2's root refuses (or, once it ran,
    its prefetch reads shards the cache gave up: a segmentation fault). FSDP2's registry
    ``_module_state_mapping`` is the only way to the modules around ``model``."""
    from torch.distributed._composable_state import _module_state_mapping

    inside = {id(module) for module in model.modules()}
    wanted = {id(module) for module in topmost}
    for outer in list(_module_state_mapping):
        if (
            is_fsdp_module(outer)
            and id(outer) not in inside
            and any(id(module) in wanted for module in outer.modules())
        ):
            raise ValueError(
                f"offload_parameters=True under FSDP2 takes the fully_shard model whose "
                f"root is {type(outer).__name__}, not a {type(model).__name__} inside it: "
                "the cache follows FSDP2's all-gathers from the root down. Create the cache "
                "on the root module."
            )


def initialize_roots(modules: list[ShardedModule]) -> None:
    """FSDP2's lazy init of each topmost tree, as its first forward would run it: it re-reads
    every shard (``reset_sharded_param``), so before the cache gives any up."""
    for sharded in modules:
        if sharded.topmost:
            sharded.state._lazy_init()
    for sharded in modules:
        check_fsdp_privates(sharded.module, initialized=True)


def flat_shards(modules: list[ShardedModule]) -> dict[Param, Callable[[], torch.Tensor]]:
    """Each sharded parameter's flat padded shard as FSDP2 holds it at the call
    (``_sharded_param_data``: its all-gather reads it, and FSDP2 may replace it)."""
    return {
        fp.sharded_param: functools.partial(getattr, fp, "_sharded_param_data")
        for sharded in modules
        for fp in sharded.fsdp_params
    }


def param_dtypes(modules: list[ShardedModule]) -> dict[Param, torch.dtype | None]:
    """The dtype each sharded parameter's all-gather casts its shard to (its
    ``MixedPrecisionPolicy``'s ``param_dtype``), or None where it does not cast."""
    return {fp.sharded_param: fp.param_dtype for sharded in modules for fp in sharded.fsdp_params}


def forward_prefetch(state: Any) -> list[Any]:
    """The FSDP2 states whose all-gather ``state``'s forward starts (the user's
    ``set_modules_to_forward_prefetch``)."""
    return list(state._states_to_forward_prefetch)


def named_backward_prefetch(state: Any) -> list[Any]:
    """Those its backward starts where the user named some (else FSDP2 takes the module
    before it in forward order: `post_forward_order`)."""
    return list(state._states_to_backward_prefetch)


def post_forward_order(group: Any) -> tuple[list[int], list[Any]]:
    """Where ``group`` ran in the last forward (its positions in the order), and FSDP2's
    record of that order (the groups in the order their forwards ended)."""
    return list(group._post_forward_indices), list(group.comm_ctx.post_forward_order)


def gathers(group: Any) -> bool:
    """Whether FSDP2's next unshard of ``group`` all-gathers (reads its shards)."""
    return not group.is_unsharded


def copy_in_stream(state: Any) -> Any:
    """FSDP2's all-gather copy-in stream for ``state``'s root (None before its lazy init,
    or where the device has no streams)."""
    return state._comm_ctx.all_gather_copy_in_stream
