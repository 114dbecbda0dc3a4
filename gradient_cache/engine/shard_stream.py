"""Forward and backward under FSDP2 with each rank's shards on the host.

FSDP2 reads a module's shards (`shard_weights.ShardWeights`) only in its all-gathers: in
the module's forward pre-hook, in backward in a hook on the module's outputs (where it
resharded after forward), and there it also starts the all-gather of the module it
prefetches. So the cache's hooks run around FSDP2's own, on each ``fully_shard`` module:

* a forward pre-hook registered before FSDP2's brings the module's shards (and those of
  the modules FSDP2 prefetches in forward, where the user named some), and, inside the
  model's forward, starts bringing the module that ran next last time (it arrives while
  this one runs; a submodule called on its own teaches no order);
* one registered after FSDP2's, when FSDP2 has waited for the all-gather, gives them up
  (a module brought ahead that the forward does not run goes at the end of backward, or
  at the model's end without gradients);
* a hook on the module's outputs registered before FSDP2's brings, in backward, its shards
  and those of the module FSDP2 prefetches (read from FSDP2's own record of the forward
  order, so the two agree), and gives up the shards of the modules whose backward began
  earlier (FSDP2 has waited for their all-gathers). What is left goes at the end of
  backward.

FSDP2's lazy init (at a root's first forward) pads and checks every shard of the root's
tree: it runs when the cache is created (`initialize_roots`), and the shards stay on the
device until their module's first all-gather is done (the decorator creates the cache inside
a root's first forward, whose hooks were fixed before these existed). A module's forward
rerun in
backward (activation checkpointing) brings its shards only where FSDP2 all-gathers again.
FSDP2's ``unshard()``, called by the user, brings the module's shards first. A load
(``load_state_dict``, into the model or any submodule) writes the shards of each module it
reaches: they are on the device for it (FSDP2 checks them after, in its own load hook on
that module), and go to their masters after. A ``state_dict`` (of the model or any
submodule) copies the masters out of their slabs.

Giving up a shard whose all-gather FSDP2 has not waited for (one it prefetched, at the end
of backward or at a ``state_dict``) makes the compute stream wait for the copy-in streams
first (`Backend.join`): the allocator hands the memory on in the compute stream's order.

This reads FSDP2's private state (its module state, parameter groups and forward order), as
`sharding.fsdp_param_groups` does: the names in `FSDP_PRIVATES`, each in the sources of
torch 2.6.0, 2.10.0, 2.13.0 and 2.14.1 (the parameter groups under one of two names,
`sharding.param_groups`); the cache's creation refuses a torch without one
(`check_fsdp_privates`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from . import sharding
from .module_hooks import ModuleHook
from .shard_weights import ShardWeights
from .weight_stream import (
    compact_masters,
    in_backward,
    outside_graphs,
    tensors_needing_gradients,
)

Param = torch.nn.Parameter


def _hook(method: Callable[..., Any], *bound: Any) -> ModuleHook:
    """``method`` with ``bound`` first, as a module hook (inert in a copy of the module)."""
    return ModuleHook(functools.partial(method, *bound))


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
    "FSDPCommContext": ("post_forward_order", "all_gather_copy_in_stream"),  # from lazy init
}


def check_fsdp_privates(module: Any, *, initialized: bool = False) -> None:
    """Raises, naming torch's version, where FSDP2's objects for ``module`` (a
    ``fully_shard`` module) lack one of `FSDP_PRIVATES`, which the stream would otherwise
    read as a silent default; the communication context's only once ``initialized`` (after
    the root's lazy init, which sets them)."""

    def require(kind: str, holder: Any) -> None:
        for names in FSDP_PRIVATES[kind]:
            if not any(hasattr(holder, name) for name in names.split(" or ")):
                raise RuntimeError(
                    f"offload_parameters=True under FSDP2 cannot run on torch "
                    f"{torch.__version__}: FSDP2's {kind} has no {names!r}, one of the "
                    "private names the cache reads to follow its all-gathers (all present "
                    "in torch 2.6.0, 2.10.0, 2.13.0 and 2.14.1). Use one of those torch "
                    "versions, or drop offload_parameters."
                )

    require("FSDPModule", module)
    state = module._get_fsdp_state()
    require("FSDPState", state)
    groups: list[Any] = sharding.param_groups(state)
    for group in groups:
        require("FSDPParamGroup", group)
        for fsdp_param in group.fsdp_params:
            require("FSDPParam", fsdp_param)
        if initialized:
            require("FSDPCommContext", group.comm_ctx)
    if initialized:
        require("FSDPCommContext", state._comm_ctx)


@dataclass
class ShardedModule:
    """A ``fully_shard`` module: FSDP2's state for it, and the sharded parameters of its
    parameter groups."""

    module: torch.nn.Module
    state: Any  # FSDP2's FSDPState
    topmost: bool  # under no other fully_shard module: a root, or one when called alone
    params: list[Param] = field(init=False)

    def __post_init__(self) -> None:
        self.params = [fp.sharded_param for group in self.groups for fp in group.fsdp_params]

    @property
    def groups(self) -> list[Any]:
        return sharding.param_groups(self.state)


def sharded_modules(model: torch.nn.Module) -> list[ShardedModule]:
    """Each ``fully_shard`` module under ``model`` (itself first, where it is one) with its
    sharded parameters; raises for ``fully_shard([a, b])`` (one state over two modules)."""
    from torch.distributed.fsdp import FSDPModule

    found: list[ShardedModule] = []
    names: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        check_fsdp_privates(module)
        state = module._get_fsdp_state()
        if len(getattr(state, "_modules", (module,))) > 1:
            raise ValueError(
                f"offload_parameters=True cannot stream FSDP2 group {name or 'the model'!r}: "
                "it was sharded with other modules in one fully_shard([...]) call, whose "
                "shards the cache cannot follow. Call fully_shard on each module on its own."
            )
        topmost = not any(name.startswith(f"{outer}.") or not outer for outer in names)
        names.append(name)
        found.append(ShardedModule(cast(torch.nn.Module, module), state, topmost))
    return found


def initialize_roots(modules: list[ShardedModule]) -> None:
    """FSDP2's lazy init of each topmost module's tree, as its first forward would run it
    (a no-op where one ran): it re-reads every shard (``reset_sharded_param``), which must
    happen while they are all on the device, before the cache gives any up."""
    for sharded in modules:
        if sharded.topmost:
            sharded.state._lazy_init()
    for sharded in modules:
        check_fsdp_privates(sharded.module, initialized=True)


def flat_shards(modules: list[ShardedModule]) -> dict[Param, Callable[[], torch.Tensor]]:
    """Each sharded parameter's flat padded shard as FSDP2 holds it at the call (FSDP2's
    ``_sharded_param_data``, which its all-gather reads and it may replace)."""
    return {
        fsdp_param.sharded_param: functools.partial(getattr, fsdp_param, "_sharded_param_data")
        for sharded in modules
        for group in sharded.groups
        for fsdp_param in group.fsdp_params
    }


class ShardStream:
    """The hooks that bring and give up each rank's shards (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, weights: ShardWeights, modules: list[ShardedModule]
    ) -> None:
        self.weights = weights
        self._modules = modules
        self._of_state = {id(m.state): i for i, m in enumerate(modules)}
        self._of_group = {id(g): i for i, m in enumerate(modules) for g in m.groups}
        self._in_model = False  # inside the model's forward, or a root's called directly
        self._next: dict[int, int] = {}  # the module that ran after each, last forward
        self._previous: int | None = None  # the module that ran last in this forward
        self._reached: set[int] = set()  # the modules whose backward began
        self._end_queued = False
        self._handles: list[Any] = []
        self._unshards: list[torch.nn.Module] = []
        for index, sharded in enumerate(modules):
            module = sharded.module
            self._handles += [
                # prepend: before FSDP2's pre-hook (its all-gather) and post-hook (which
                # registers its backward hook on the outputs, after this one's).
                module.register_forward_pre_hook(_hook(self._before_gather, index), prepend=True),
                module.register_forward_pre_hook(_hook(self._gathered, index)),
                module.register_forward_hook(_hook(self._forward_ends, index), prepend=True),
            ]
            # The user's unshard() all-gathers too: an instance attribute over FSDP2's.
            unshard = functools.partial(self._unshard, index, module.unshard)
            object.__setattr__(module, "unshard", unshard)
            self._unshards.append(module)
        held = set(weights.params())
        for owner in model.modules():  # a save or load reaches a parameter through its owner
            own = {n: p for n, p in owner.named_parameters(recurse=False) if p in held}
            if own:
                self._handles += [
                    owner.register_state_dict_pre_hook(_hook(self._saving, own)),
                    owner.register_state_dict_post_hook(_hook(self._saved, own)),
                    owner.register_load_state_dict_pre_hook(_hook(self._load_begins, own)),
                    owner.register_load_state_dict_post_hook(_hook(self._loaded, own)),
                ]
        # The model's forward, and a root's where a framework calls it, not the model
        # (Lightning's training_step): prepend, registered last, before the hooks above.
        outermost = {id(model): model}
        outermost.update({id(m.module): m.module for m in modules if m.topmost})
        for module in outermost.values():
            self._handles += [
                module.register_forward_pre_hook(_hook(self._model_begins), prepend=True),
                module.register_forward_hook(_hook(self._model_ends), always_call=True),
            ]

    def remove(self) -> None:
        """The hooks removed; the shards stay where they are."""
        for handle in self._handles:
            handle.remove()
        for module in self._unshards:
            del module.unshard  # FSDP2's own again
        self._handles, self._unshards = [], []

    @outside_graphs
    def _model_begins(self, module: torch.nn.Module, args: Any) -> None:
        if not in_backward():
            self._in_model, self._previous = True, None

    @outside_graphs
    def _model_ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Without gradients (an eval) no backward comes: a module brought ahead that the
        forward did not run goes now."""
        if in_backward():
            return
        self._in_model = False
        if not torch.is_grad_enabled():
            self._give_up(self.weights.present())

    @outside_graphs
    def _before_gather(self, index: int, module: torch.nn.Module, args: Any) -> None:
        if in_backward():  # a recomputation: FSDP2 all-gathers only what it resharded
            self._ensure(i for i in [index] if self._gathers(i))
            return
        prefetched = getattr(self._modules[index].state, "_states_to_forward_prefetch", ())
        self._ensure([index, *self._indices_of(prefetched)])
        if not self._in_model:  # a submodule called on its own: no order to learn
            return
        if self._previous is not None:
            self._next[self._previous] = index
        self._previous = index
        ahead = self._next.get(index)
        if ahead is not None:
            self.weights.bring(self._modules[ahead].params)

    @outside_graphs
    def _gathered(self, index: int, module: torch.nn.Module, args: Any) -> None:
        """FSDP2's pre-hook has waited for this module's all-gather: its shards go."""
        self.weights.free(self._modules[index].params)

    def _unshard(self, index: int, unshard: Any, async_op: bool = False) -> Any:
        """FSDP2's ``unshard()`` after the module's shards came (and, where it waited for
        the all-gather, with them gone again)."""
        self._ensure([index])
        handle = unshard(async_op=async_op)
        if not async_op:
            self.weights.free(self._modules[index].params)
        return handle

    @outside_graphs
    def _forward_ends(self, index: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        if in_backward() or not torch.is_grad_enabled():
            return
        hook = functools.partial(self._backward_reaches, index)
        for tensor in tensors_needing_gradients(output):
            tensor.register_hook(hook)

    @outside_graphs
    def _backward_reaches(self, index: int, grad: torch.Tensor) -> None:
        """The module's outputs have their gradient: FSDP2's hook, next, all-gathers it
        and starts the all-gather of the module it prefetches."""
        self._queue_end_of_backward()
        wanted = [index, *self._backward_prefetch(index)]
        done = [
            p
            for i in self._reached - set(wanted)
            for p in self._modules[i].params  # their all-gathers were waited for
        ]
        self.weights.free(done)
        self._reached.add(index)
        self._ensure(i for i in wanted if self._gathers(i))

    def _backward_prefetch(self, index: int) -> list[int]:
        """The modules FSDP2's backward hook of module ``index`` prefetches: those named
        (``set_modules_to_backward_prefetch``), else the one before it in forward order."""
        state = self._modules[index].state
        named = getattr(state, "_states_to_backward_prefetch", ())
        if named:
            return self._indices_of(named)
        found = []
        for group in self._modules[index].groups:
            positions = getattr(group, "_post_forward_indices", ())
            order = getattr(group.comm_ctx, "post_forward_order", ())
            if not positions:
                continue
            for earlier in reversed(order[: positions[-1]]):
                if self._of_group.get(id(earlier)) != index:
                    found.append(self._of_group[id(earlier)])
                    break
        return found

    def _indices_of(self, states: Iterable[Any]) -> list[int]:
        return [self._of_state[id(state)] for state in states]

    def _gathers(self, index: int) -> bool:
        """Whether FSDP2's next unshard of module ``index`` all-gathers (reads its shards)."""
        return any(not group.is_unsharded for group in self._modules[index].groups)

    def _copy_in_streams(self, indices: Iterable[int]) -> list[Any]:
        """FSDP2's all-gather copy-in streams of ``indices`` (one per root; none before its
        lazy init, whose root pre-hook waits for the compute stream)."""
        streams = {}
        for i in indices:
            comm = getattr(self._modules[i].state, "_comm_ctx", None)
            stream = getattr(comm, "all_gather_copy_in_stream", None)
            if stream is not None:
                streams[id(stream)] = stream
        return list(streams.values())

    def _ensure(self, indices: Iterable[int]) -> None:
        """The shards of ``indices`` on the device, for FSDP2's all-gathers queued next."""
        indices = list(indices)
        params = [p for i in indices for p in self._modules[i].params]
        if not params:
            return
        self.weights.bring(params)
        refills = self.weights.refills(params)
        self.weights.ensure(params)
        for stream in self._copy_in_streams(indices):
            # The copy-in waits for the refills alone, so an all-gather overlaps the module
            # running before it (or for the compute stream where a shard arrived earlier).
            self.weights.backend.let_read(stream, refills or ())

    def _give_up(self, params: list[Param]) -> None:
        """``params``' shards given up, though FSDP2 may not have waited for an all-gather
        it started from them (a prefetch)."""
        if params:
            for stream in self._copy_in_streams(range(len(self._modules))):
                self.weights.backend.join(stream)
            self.weights.free(params)

    def _queue_end_of_backward(self) -> None:
        if not self._end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self._end_queued = True

    def _backward_ended(self) -> None:
        self._give_up(self.weights.present())
        self._reached = set()
        self._end_queued = False

    def _saving(self, own: dict[str, Param], *args: Any) -> None:
        """Before ``state_dict`` reads ``own`` (one module's parameters): their shards
        home (the local tensors the masters' views), no copy in flight."""
        present = set(self.weights.present())
        self._give_up([p for p in own.values() if p in present])
        self.weights.wait_on_host()

    def _saved(
        self, own: dict[str, Param], module: Any, state: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        """Each of ``own`` in ``state`` as a copy of its own, not a view of a slab."""
        compact_masters(self.weights, state, [prefix + name for name in own])

    def _load_begins(self, own: dict[str, Param], *args: Any) -> None:
        """A load copies into ``own`` (one module's parameters): their shards on the
        device first, filled from their masters, the local tensors their views of them."""
        self.weights.ensure(own.values())

    def _loaded(self, own: dict[str, Param], module: Any, incompatible_keys: Any) -> None:
        """The loaded shards to their masters, and their memory given up."""
        self.weights.store(own.values())
        self.weights.wait_on_host()
