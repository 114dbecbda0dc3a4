"""Forward and backward under FSDP2 with each rank's shards on the host: their placement
(`FsdpShards`: the padded shard ``S`` keeps its storage, its memory moves, ``P``'s local
tensor is repointed) and the hooks around FSDP2's all-gathers that move them
(`ShardStream`). Each moment, its hook and its streams: docs/ARCHITECTURE.md, "Under FSDP2".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .. import fsdp_privates, sharding
from ..compiled import outside_graphs
from ..fsdp_privates import ShardedModule
from .hooks import (
    BackwardEnd,
    OwnerHooks,
    in_backward,
    module_hook,
    of_this_backward,
    tensors_needing_gradients,
)
from .masters import HostWeights, Weight, WeightAt

Param = torch.nn.Parameter


class ShardStream:
    """The hooks that bring and give up each rank's shards."""

    def __init__(
        self, model: torch.nn.Module, weights: HostWeights, modules: list[ShardedModule]
    ) -> None:
        self.weights = weights
        self._modules = modules
        self._of_state = {id(m.state): i for i, m in enumerate(modules)}
        self._of_group = {id(g): i for i, m in enumerate(modules) for g in m.groups}
        self._in_model = False  # inside the model's forward, or a root's called directly
        self._next: dict[int, int] = {}  # the module that ran after each, last forward
        self._previous: int | None = None  # the module that ran last in this forward
        self._reached: set[int] = set()  # the modules whose backward began
        self.end = BackwardEnd(self._backward_ended, weights.backend.device)  # a close's too
        self._handles: list[Any] = []
        for index, sharded in enumerate(modules):
            module = sharded.module
            self._handles += [
                # prepend: before FSDP2's pre-hook (its all-gather) and post-hook (which
                # registers its backward hook on the outputs, after this one's).
                module.register_forward_pre_hook(
                    module_hook(self._before_gather, index), prepend=True
                ),
                module.register_forward_pre_hook(module_hook(self._gathered, index)),
                module.register_forward_hook(module_hook(self._forward_ends, index), prepend=True),
            ]
            # The user's unshard() all-gathers too: an instance attribute over FSDP2's.
            unshard = functools.partial(self._unshard, index, module.unshard)
            object.__setattr__(module, "unshard", unshard)
        self._handles += OwnerHooks(model, weights, give_up=self._give_up).handles
        # The model's forward, and a root's where a framework calls it, not the model
        # (Lightning's training_step): prepend, registered last, before the hooks above.
        outermost = {id(model): model}
        outermost.update({id(m.module): m.module for m in modules if m.topmost})
        for module in outermost.values():
            self._handles += [
                module.register_forward_pre_hook(module_hook(self._model_begins), prepend=True),
                module.register_forward_hook(module_hook(self._model_ends), always_call=True),
            ]

    def remove(self) -> None:
        """The hooks removed; the shards stay where they are."""
        for handle in self._handles:
            handle.remove()
        for sharded in self._modules:
            vars(sharded.module).pop("unshard", None)  # FSDP2's own again
        self._handles = []

    @outside_graphs
    def _model_begins(self, module: torch.nn.Module, args: Any) -> None:
        if not in_backward():
            self.end.after_a_failed_backward()
            self._in_model, self._previous = True, None

    @outside_graphs
    def _model_ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """After an eval, a module brought ahead but not run goes."""
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
        prefetched = fsdp_privates.forward_prefetch(self._modules[index].state)
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
        """FSDP2's ``unshard()``, the shards brought first (and given up after where it waited)."""
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
    @of_this_backward
    def _backward_reaches(self, index: int, grad: torch.Tensor) -> None:
        """Its outputs have their gradient: FSDP2's hook, next, all-gathers it and a prefetch."""
        self.end.queue()
        wanted = [index, *self._backward_prefetch(index)]
        # Those whose backward began earlier: their all-gathers were waited for.
        done = [p for i in self._reached - set(wanted) for p in self._modules[i].params]
        self.weights.free(done)
        self._reached.add(index)
        self._ensure(i for i in wanted if self._gathers(i))

    def _backward_prefetch(self, index: int) -> list[int]:
        """The modules FSDP2's backward hook of module ``index`` prefetches: those named
        (``set_modules_to_backward_prefetch``), else the one before it in forward order."""
        named = fsdp_privates.named_backward_prefetch(self._modules[index].state)
        if named:
            return self._indices_of(named)
        found = []
        for group in self._modules[index].groups:
            positions, order = fsdp_privates.post_forward_order(group)
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
        return any(fsdp_privates.gathers(group) for group in self._modules[index].groups)

    def _copy_in_streams(self, indices: Iterable[int]) -> list[Any]:
        """FSDP2's all-gather copy-in streams of ``indices`` (one per root; none before its
        lazy init, whose pre-hook waits for the compute stream)."""
        found = (fsdp_privates.copy_in_stream(self._modules[i].state) for i in indices)
        return list({id(stream): stream for stream in found if stream is not None}.values())

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
        """``params``' shards given up, where FSDP2 may not have waited for their all-gather."""
        if params:
            for stream in self._copy_in_streams(range(len(self._modules))):
                self.weights.backend.join(stream)
            self.weights.free(params)

    def _backward_ended(self) -> None:
        self._give_up(self.weights.present())
        self._reached = set()


class FsdpShards:
    """FSDP2's shards. ``flat_shards``: each parameter's flat padded shard as FSDP2 holds it
    now, read each time: FSDP2 may replace it."""

    loads_on_device = True  # FSDP2 checks the loaded shards in its own load hook

    def __init__(
        self,
        flat_shards: Mapping[Param, Callable[[], torch.Tensor]],
        cast_to: Mapping[Param, torch.dtype | None],
    ) -> None:
        self._flat_shards = flat_shards
        self._cast_to = cast_to  # the dtype FSDP2's all-gather casts each shard to
        # Each parameter's local tensor: its view of S (FSDP2's) and of the master (at rest).
        self._locals: dict[Param, tuple[torch.Tensor, torch.Tensor]] = {}

    def check(self, named_params: Sequence[tuple[str, Param]]) -> None:
        """Every parameter one of FSDP2's shards (the cache's own check refuses unsharded
        trainable ones, this the frozen ones)."""
        for name, param in named_params:
            if not sharding.is_dtensor(param):
                raise ValueError(
                    f"offload_parameters=True under FSDP2 cannot move parameter {name!r}: it "
                    "is not one of FSDP2's shards. Shard every parameter (fully_shard(model) "
                    "after the blocks) before creating the cache."
                )

    def source(self, param: Param) -> torch.Tensor:
        """The whole padded shard, which FSDP2's all-gather reads: 1-D over all its storage."""
        local = sharding.local(param)
        storage = local.untyped_storage()
        return torch.empty(0, dtype=local.dtype, device=local.device).set_(
            storage, 0, (storage.nbytes() // local.element_size(),), (1,)
        )

    def part_to_come(self, param: Param) -> bool:
        return False  # FSDP2 reduce-scatters a shard's gradient once per backward

    def device_tensors(
        self, sources: list[torch.Tensor], masters: list[torch.Tensor]
    ) -> tuple[None, list[torch.Tensor], list[torch.Tensor]]:
        """No buffer: each shard's own storage, in its dtype, for forward and the step."""
        return None, sources, sources

    def wire_dtype(self, param: Param) -> torch.dtype | None:
        """Under a ``MixedPrecisionPolicy`` its ``param_dtype``: FSDP2's all-gather casts to
        it, so a shard filled from the master's cast gathers the same bits for half the bytes."""
        return self._cast_to.get(param)

    def rest(self, param: Param, weight: Weight) -> None:
        """S stays on the device, in use, until it first may go (FSDP2's pre-hook of a
        forward running now may already be under way)."""
        on_device = fsdp_privates.local_object(param)  # FSDP2's narrow view of S
        at_rest = weight.master[: on_device.numel()].view(on_device.shape)
        self._locals[param] = (on_device, at_rest)
        weight.at, weight.in_use, weight.exact = WeightAt.DEVICE, weight.full, True
        weight.version = param._version  # a write from now on is a write to copy back

    def show(self, param: Param, weight: Weight) -> None:
        on_device, at_rest = self._locals[param]
        fsdp_privates.set_local(param, on_device if weight.place() is weight.full else at_rest)

    def in_place(self, param: Param, weight: Weight) -> bool:
        """Whether FSDP2 still all-gathers ``param`` from S (``reset_sharded_param`` may not)."""
        flat = self._flat_shards.get(param)
        return flat is not None and flat().is_set_to(weight.full)

    def step_begins(self, weights: Iterable[tuple[Param, Weight]]) -> None:
        """Nothing guarded: a shard's weights are never dressed (`at_rest`)."""

    def step_ends(self, weights: Iterable[tuple[Param, Weight]]) -> None:
        """Nothing watched: a shard at rest is FSDP2's, on the device (`rest`)."""

    def close(self, weights: HostWeights) -> None:
        """Every shard back on the device for good (one there stays: the newest). Raises
        without room: a shard left on the host would be read freed by FSDP2's next gather."""
        try:
            weights.ensure(weights.params(), step=True)  # the masters, not their casts
        except torch.OutOfMemoryError as error:
            size = sum(master.nbytes for master in weights.masters()) / 2**20
            raise RuntimeError(
                f"remove_hooks(): this rank's shards ({size:.1f} MiB) did not fit back on "
                "the device, where plain FSDP2 keeps them. The cache stays attached and "
                "keeps streaming them; free device memory and call remove_hooks() again, "
                "or save the model (model.state_dict()) and train on with the cache."
            ) from error
        self._locals = {}
