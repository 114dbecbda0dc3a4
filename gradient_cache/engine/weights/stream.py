"""Forward and backward with the weights on the host, on one process: their placement
(`OwnTensors`: ``P.data`` a device tensor of its own in use, the host master at rest) and
the hooks that bring and free them a block at a time (`WeightStream`). Each moment and what
orders it: docs/ARCHITECTURE.md, "The life of a weight"; weights used twice: its "Traps".
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch.autograd.graph import get_gradient_edge

from ..backend import Backend
from ..compiled import outside_graphs
from ..users_line import outside_the_package
from . import at_rest
from .blocks import WeightUnits
from .hooks import (
    BackwardEnd,
    OwnerHooks,
    in_backward,
    left_on_modules,
    module_hook,
    of_this_backward,
    outputs_needing_gradients,
    refuse_create_graph,
    tensors_needing_gradients,
)
from .masters import HostWeights, Weight, WeightAt, unit_offsets
from .schedule import Schedule

Param = torch.nn.Parameter


class WeightStream:
    """The model's hooks that bring and free its weights."""

    def __init__(self, model: torch.nn.Module, weights: HostWeights, units: WeightUnits) -> None:
        self.weights = weights
        self.units = units
        self.schedule = Schedule(len(units.blocks))  # the order forward runs the blocks in
        # Forwards with gradients since the last backward ended (a dropped output counts).
        self._forwards = 0
        # A token in each model output's node since then, weakly (`awaited`).
        self._awaiting: weakref.WeakSet[_Awaited] = weakref.WeakSet()
        self._called: set[int] = set()  # the blocks this forward ran
        self._reused = False  # a block ran twice since the last backward ended
        self._running: dict[int, _Entered] = {}  # a running block's inputs
        self._in_model = False  # inside the model's own forward
        self._removed = False  # closed: a forward's output left then has its hooks still
        # Each block output of this forward (weakly, by id) and the blocks that took it as
        # an input: its gradient ends their backward (`_free_frozen`).
        self._consumers: dict[int, tuple[weakref.ref[torch.Tensor], list[int]]] = {}
        # The tensors `left_on_modules` hooked, by id: hooked once, if one stays there.
        self._sides: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.end = BackwardEnd(self._backward_ended, weights.backend.device)  # a close's too
        self._in_blocks = {p for params in units.block_params for p in params}
        self._unstreamed: set[Param] = set()  # block weights whose gradient met the host
        self._warned = False
        hook = module_hook
        self._handles = [
            model.register_forward_pre_hook(hook(self._model_begins), with_kwargs=True),
            # always_call: a forward that raises gives back what it brought.
            model.register_forward_hook(hook(self._model_ends), always_call=True),
        ]
        for index, block in enumerate(units.blocks):
            self._handles += [
                block.register_forward_pre_hook(hook(self._block_begins, index), with_kwargs=True),
                block.register_forward_hook(hook(self._block_ends, index), always_call=True),
            ]
        # The rest's own modules bring their weights too: a framework may call a submodule
        # (Lightning's training_step calls self.model), never the model given.
        rest = set(units.rest)
        for module in model.modules():
            rest_own = [p for p in module.parameters(recurse=False) if p in rest]
            if rest_own and module is not model:
                self._handles += [
                    module.register_forward_pre_hook(
                        hook(self._rest_module_begins, rest_own), with_kwargs=True
                    ),
                    module.register_forward_hook(
                        hook(self._rest_module_ends, rest_own), always_call=True
                    ),
                ]
        self._handles += OwnerHooks(model, weights, give_up=weights.free).handles
        self._handles += [
            param.register_post_accumulate_grad_hook(self._gradient_accumulated)
            for param in model.parameters()
            if param.requires_grad
        ]
        # A block weight used at rest: refused as a backward reaches the use (`at_rest`) where
        # P.data moves between uses, which restarts P's accumulation (to a device, or on a
        # CPU to a compute dtype); a host gradient, at once.
        on_device = weights.backend.device.type != "cpu"
        trainable = [param for param in self._in_blocks if param.requires_grad]
        if on_device:
            self._handles += [  # before autograd accumulates it
                param.register_hook(functools.partial(weights.refuse_a_host_gradient, param))
                for param in trainable
            ]
        placement = weights.placement
        assert isinstance(placement, OwnTensors)  # this stream's (FSDP2's: `ShardStream`)
        self._placement = placement
        if on_device or weights.compute_dtype is not None:
            # The rest's too: a later backward over a retained graph naming them (`at_rest`).
            placement.guard(trainable + [param for param in units.rest if param.requires_grad])
        for param in weights.params():  # for the refusals and the copies of dressed weights
            at_rest.NAMES[id(param)] = weights.name(param)
            at_rest.COPIES_ON[id(param)] = weights.backend.device

    def settled(self, params: Sequence[Param]) -> None:
        """``params`` are on the device for good (`OwnTensors.settle`): plain parameters."""
        self._in_blocks.difference_update(params)

    def awaited(self) -> bool:
        """Whether a forward's graph lives whose backward has not begun: it may come."""
        return len(self._awaiting) > 0

    def remove(self) -> None:
        """The hooks removed; the weights stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._removed = True
        self._placement.forget_uses()

    @outside_graphs
    def _model_begins(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        self._in_model = True
        self._placement.guarding(False)  # a forward with no backward since the last one ended
        if not in_backward():
            self.end.after_a_failed_backward()
        if not in_backward() and torch.is_grad_enabled():
            self._forwards += 1
            self._called = set()
        self._refuse_autocast()
        self.weights.bring(self.units.rest)
        if not in_backward():  # both copies issued before the compute stream waits for one
            self.weights.bring(self._block(self.schedule.first()))
        self.weights.ensure(self.units.rest)
        inputs = self._on_the_device(args, kwargs)
        return self._cast(*inputs) or inputs

    def _on_the_device(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The model's host tensor inputs on the device: at rest its parameters are host
        tensors, so code placing tensors by them (HF ``generate()``) made them there."""
        device = self.weights.backend.device
        if device.type == "cpu":
            return args, kwargs
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(device) if t.device.type == "cpu" else t, (args, kwargs)
        )

    @outside_graphs
    def _rest_module_begins(
        self, params: list[Param], module: torch.nn.Module, args: Any, kwargs: Any
    ) -> Any:
        self.weights.ensure(params)
        # Called on its own (a checkpointed call's rerun in backward too): its inputs as
        # the model's; inside the model's forward they are the compute dtype's already.
        return None if self._in_model else self._cast(args, kwargs)

    @outside_graphs
    def _rest_module_ends(
        self, params: list[Param], module: torch.nn.Module, args: Any, output: Any
    ) -> None:
        """A submodule of the rest called on its own (a second loss through the head): its
        backward brings the rest as the model's does, however many backwards end before it
        (each frees the weights). An eval: nothing comes back for its weights."""
        if self._in_model or in_backward():
            return
        if not torch.is_grad_enabled():
            self.weights.free(params)
            return
        outputs = outputs_needing_gradients(output)
        if outputs:
            self._awaits_a_backward(outputs)

    @outside_graphs
    def _model_ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._in_model = False
        if in_backward():
            return
        self.schedule.learn()
        outputs = outputs_needing_gradients(output) if torch.is_grad_enabled() else []
        if not outputs:  # an eval, a forward that raised, nothing to train: no backward
            if torch.is_grad_enabled():
                self._forwards -= 1  # counted at its begin, and no graph to come back to
            self.weights.free(self.weights.present())  # a backward brings the rest again
            self._placement.eval_ended()
            return
        self._awaits_a_backward(outputs)
        self._placement.record_uses(self.units.rest)
        # Backward starts with the last block run: kept, or brought again where freed.
        self.weights.bring(self._block(self.schedule.last()))
        self._placement.guarding(True)  # what the loss adds to the graph until backward

    def _awaits_a_backward(self, outputs: list[torch.Tensor]) -> None:
        """A backward reaching any of ``outputs`` begins with `_backward_begins`. One token
        for them, in their nodes (alive with the graph, not with a tensor): a close waits
        for it, and a backward's begin forgets its own forward's, not another live one's."""
        token = _Awaited()
        awaited = weakref.ref(token)
        for tensor in outputs:
            if tensor.grad_fn is None:
                continue  # a leaf (a parameter returned as is): a hook would stay on it
            tensor.register_hook(functools.partial(self._backward_begins, awaited))
            metadata = cast("dict[str, Any]", tensor.grad_fn.metadata)  # a dict, typed
            metadata[_AWAITED] = token
        self._awaiting.add(token)

    @outside_graphs
    @of_this_backward
    def _backward_begins(self, awaited: weakref.ref[_Awaited], grad: torch.Tensor) -> None:
        """The model's output has its gradient: the rest is read next (again, if retained)."""
        if self._removed:
            raise RuntimeError(
                "A backward through a forward run before remove_hooks(): the close moved the "
                "weights that forward saved for it (offload_parameters=True). Run the "
                "forward again after the close, or its backward before it."
            )
        # It came (if refused, too): a close no longer waits for it; another forward's graph
        # still alive keeps the close refused until its own backward begins, or one ends.
        came = awaited()
        if came is not None:
            self._awaiting.discard(came)
        refuse_create_graph()
        self._placement.guarding(False)  # the uses before it are recorded, their refusals set
        self.end.queue()
        self.weights.ensure(self.units.rest)

    @outside_graphs
    def _block_begins(self, index: int, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if not in_backward() and torch.is_grad_enabled():
            self._reused |= index in self._called
            self._called.add(index)
            self.schedule.ran(index)
            for tensor in tensors_needing_gradients((args, kwargs)):
                made = self._consumers.get(id(tensor))
                if made is not None and made[0]() is tensor:
                    made[1].append(index)
            self._running[index] = _Entered(args, kwargs)
        self._refuse_autocast()
        self.weights.ensure(self._block(index))
        if not in_backward():
            self.weights.bring(self._block(self.schedule.after(index)))
        return self._cast(args, kwargs)

    def _refuse_autocast(self) -> None:
        """Autocast's weight cache would hold the whole model's weights on the device."""
        kind = self.weights.backend.device.type
        if (
            torch.amp.is_autocast_available(kind)
            and torch.is_autocast_enabled(kind)
            and torch.is_autocast_cache_enabled()
        ):
            raise RuntimeError(
                f"torch.autocast({kind!r}) is on around a model whose weights are on the host "
                "(offload_parameters=True): autocast keeps a cast copy of every weight it "
                "meets until the forward ends, so the device would hold the whole model's "
                "weights. Pass compute_dtype=torch.bfloat16 to the cache instead (forward "
                "and backward in bf16, a block at a time), or turn autocast's weight cache "
                f"off: torch.autocast({kind!r}, dtype=..., cache_enabled=False) (without "
                "activation checkpointing autograd still saves each block's casts for its "
                "backward: half the blocks' fp32 bytes, python -m perf.autocast_window)."
            )

    def _cast(self, args: Any, kwargs: Any) -> Any:
        """The floating inputs in the compute dtype (FSDP2's ``cast_forward_inputs``), or None."""
        dtype = self.weights.compute_dtype
        if dtype is None:
            return None
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs)
        )

    @outside_graphs
    def _block_ends(self, index: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return  # a recomputation: its backward reads these weights next
        entered = self._running.pop(index, None)
        if entered is not None and output is not None and torch.is_grad_enabled():
            self._placement.record_uses(self._block(index))  # before they may leave
            self._hook_its_backward(index, module, entered, output)
        last = index == self.schedule.last()
        if not (last and output is not None and torch.is_grad_enabled()):
            self.weights.free(self._block(index))  # the last one: backward begins with it

    def _hook_its_backward(
        self, index: int, module: torch.nn.Module, entered: _Entered, output: Any
    ) -> None:
        """Hooks on what block ``index`` made (returned, wrote into its inputs, left on its
        modules), whose gradient brings its backward, and on its inputs, which end it."""
        handed = entered.handed()  # (T5's position bias): not this block's
        hook = functools.partial(self._block_backward_ended, index)
        for tensor in handed.values():
            tensor.register_hook(hook)
        written = tensors_needing_gradients((entered.args, entered.kwargs))
        returned = outputs_needing_gradients(output, passed=entered.objects)
        made = {id(t): t for t in returned + written if id(t) not in handed}
        for tensor in made.values():
            consumers: list[int] = []
            self._consumers[id(tensor)] = (weakref.ref(tensor), consumers)
            tensor.register_hook(functools.partial(self._block_backward_begins, index, consumers))
        for tensor in left_on_modules(module):
            if id(tensor) in handed or id(tensor) in made:
                continue
            if self._sides.get(id(tensor)) is not tensor:  # hooked once, if it stays there
                self._sides[id(tensor)] = tensor
                tensor.register_hook(functools.partial(self._side_begins, index))

    @outside_graphs
    @of_this_backward
    def _block_backward_begins(self, index: int, consumers: list[int], grad: torch.Tensor) -> None:
        refuse_create_graph()
        self.end.queue()
        for consumer in consumers:  # their backward is done: this output's gradient is whole
            self._free_frozen(consumer)
        self.weights.ensure(self._block(index))
        self.weights.bring(self._block(self.schedule.before(index)))

    @outside_graphs
    @of_this_backward
    def _side_begins(self, index: int, grad: torch.Tensor) -> None:
        """A tensor block ``index`` left on a module has its gradient, maybe before its outputs'."""
        refuse_create_graph()
        self.end.queue()
        self.weights.ensure(self._block(index))

    @outside_graphs
    @of_this_backward
    def _block_backward_ended(self, index: int, grad: torch.Tensor) -> None:
        """The block's inputs have their gradient: its backward is done."""
        self._free_frozen(index)

    def _free_frozen(self, index: int) -> None:
        """Block ``index``'s backward is done: its frozen weights go (no accumulation will)."""
        if self._forwards <= 1 and not self._reused:
            with at_rest.undispatched():
                frozen = [param for param in self._block(index) if not param.requires_grad]
            self.weights.free(frozen)

    @outside_graphs
    @of_this_backward
    def _gradient_accumulated(self, param: Param) -> None:
        self.end.queue()
        if param in self._in_blocks and self.weights.where(param) is WeightAt.HOST:
            self._unstreamed.add(param)
        if self._forwards <= 1 and not self._reused:
            self.weights.free([param])

    def _warn_unstreamed(self) -> None:
        """Once, at a backward's end: block weights got gradients computed on the host."""
        if not self._unstreamed or self._warned:
            return
        self._warned = True
        names = self.weights.names(self._unstreamed)
        warnings.warn(
            f"{len(names)} block parameter(s) ({', '.join(map(repr, names[:4]))}"
            f"{', ...' if len(names) > 4 else ''}) received their gradients while their "
            "weights were on the host: they were used outside the hooks that bring a "
            "block's weights to the device (block.forward(x) instead of block(x); a "
            "regularizer over model.parameters(); the whole model under torch.compile with "
            "inductor), so those uses computed on the host masters and autograd accumulated "
            "them apart. Call the blocks as modules, compile the blocks (block.compile()) "
            "rather than the whole model, and put a regularizer into the optimizer "
            "(weight_decay) or compute it inside the blocks.",
            UserWarning,
            stacklevel=outside_the_package(),
        )

    def _backward_ended(self) -> None:
        if self.end.raised:  # that backward's error said it: no warning beside it
            self._unstreamed.clear()
        self._warn_unstreamed()
        self._placement.backward_ended()
        self.weights.free(self.weights.present())
        self.schedule.learn()  # a framework calling a submodule never ends the model
        self._forwards = 0
        # A forward before it whose backward is still to come no longer holds a close back
        # (its output kept for a metric, never backwarded, is common); if its backward
        # comes after a close it is refused by name (`_removed`).
        self._awaiting.clear()
        self._called = set()  # nor begins it
        self._reused = False
        self._consumers = {}

    def _block(self, index: int | None) -> list[Param]:
        """Block ``index``'s parameters (the schedule's None: none)."""
        return [] if index is None else self.units.block_params[index]


@dataclass
class _Entered:
    """A running block's inputs, before a compute dtype's cast (a cast copy taken for its
    output brought the block back after its backward)."""

    args: Any
    kwargs: Any

    def __post_init__(self) -> None:
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        # The inputs needing gradients and their nodes now: one still made by the same node
        # at the block's end is handed on, or only read, not its output.
        self.nodes = [(t, t.grad_fn) for t in tensors_needing_gradients(leaves)]
        # The objects passed in (a cache shared by the blocks): handed on too, not searched.
        self.objects = {id(leaf) for leaf in leaves if not isinstance(leaf, torch.Tensor)}

    def handed(self) -> dict[int, torch.Tensor]:
        return {id(t): t for t, made_by in self.nodes if t.grad_fn is made_by}


_AWAITED = "gradient_cache.awaited"  # the key of `WeightStream`'s token in a node's metadata


class _Awaited:
    """A token in a model output's node's metadata: alive while the graph is."""


class OwnTensors:
    """One process: a device tensor of its own for each parameter, ``P.data`` at rest the
    master. ``compute_dtype``: forward and backward's device tensors' dtype."""

    loads_on_device = False  # a load writes the masters at rest

    def __init__(self, backend: Backend, compute_dtype: torch.dtype | None) -> None:
        self.backend = backend
        self.compute_dtype = compute_dtype
        self._guarded: set[Param] = set()  # refuse a use at rest (`at_rest`), by name
        # From a forward's end to its backward's begin, and from a backward's end to the
        # next forward or step (a retained graph's next backward naming the weights).
        self._guarding = False
        self._stepping = False  # from `step_begins` to `step_ends`: nothing watched
        self._uses_stale = False  # a backward ended: the next forward's uses replace them
        self._recorded: set[int] = set()  # the weights whose nodes `at_rest.USES` keeps
        self._settled: list[Param] = []  # on the device for good (`settle`)
        self._accumulated: dict[Param, int] = {}  # nodes of a weight's uses run (`part_to_come`)

    def guard(self, params: Iterable[Param]) -> None:
        """``params`` refuse, by name (`at_rest.NAMES`), a use at rest while `guarding`."""
        self._guarded.update(params)

    def guarding(self, on: bool) -> None:
        """The guarded weights at rest guarded (``on``: from a forward's end to its backward's
        begin) or plain, so the step's loops read their fields with no Python call each."""
        if not on and not self._guarding:
            return  # plain already: `_dress` guards only while guarding
        self._guarding = on
        with at_rest.undispatched():
            for param in self._guarded:
                # At rest ``P.data`` is its master: on the host, not in the compute dtype
                # (on a CPU run, a weight in use is the host's too, in that dtype).
                home = param.device.type == "cpu" and param.dtype != self.compute_dtype
                watched = home and not self._stepping and self._watches(param)
                at_rest.dress(param, guarded=on and home, watched=watched)

    def _watches(self, param: Param) -> bool:
        """Whether ``param`` at home between steps is watched (`at_rest.WatchedAtRest`)."""
        return self.wire_dtype(param) is not None or self.backend.device.type != "cpu"

    def record_uses(self, params: Sequence[Param]) -> None:
        """A forward used ``params``: each guarded one's accumulation node now kept in
        `at_rest.USES` (once: a block run twice without moving has one)."""
        if self._uses_stale:
            self.forget_uses()
        for param in params:
            if param.requires_grad and param in self._guarded:
                edge = get_gradient_edge(param)
                self._recorded.add(id(param))
                known = at_rest.USES.setdefault(id(param), [])
                if all(seen.node is not edge.node for seen in known):
                    known.append(edge)

    def backward_ended(self) -> None:
        """The nodes `record_uses` kept stay for a backward over the retained graph (until
        the next forward records its own), which finds the weights guarded at rest."""
        self._accumulated.clear()
        self._uses_stale = True
        self.guarding(True)

    def step_begins(self, weights: Iterable[tuple[Param, Weight]]) -> None:
        """The weights plain: the step's loops read their fields with no Python call each
        (each optimizer step reads every parameter's ``.grad``, a bucket's or not)."""
        self._stepping, self._guarding = True, False
        for param, weight in weights:
            self._dress(param, weight)

    def step_ends(self, weights: Iterable[tuple[Param, Weight]]) -> None:
        self._stepping = False
        for param, weight in weights:
            self._dress(param, weight)

    def eval_ended(self) -> None:
        """An eval ran plain (`_model_begins`): guarded again where the last backward's
        nodes are still kept for a retained graph's next backward."""
        if self._uses_stale:
            self.guarding(True)

    def forget_uses(self) -> None:
        """The nodes `record_uses` kept go (a new forward's, or the close: a settled weight
        is no longer guarded, and its nodes would keep it alive)."""
        for key in self._recorded:
            at_rest.USES.pop(key, None)
        self._recorded.clear()
        self._accumulated.clear()
        self._uses_stale = False

    def part_to_come(self, param: Param) -> bool:
        """Whether another of ``param``'s recorded nodes this backward runs (a block used
        twice, moved between) is still to accumulate: autograd adds it into ``.grad``, so
        the sum is plain PyTorch's ``M + (b + a)``, not ``(M + b) + a``."""
        nodes = [edge.node for edge in at_rest.USES.get(id(param), ())]
        if len(nodes) < 2:
            return False
        run = self._accumulated.get(param, 0) + 1
        if run < sum(map(torch._C._will_engine_execute_node, nodes)):
            self._accumulated[param] = run
            return True
        self._accumulated.pop(param, None)
        return False

    def _dress(self, param: Param, weight: Weight) -> None:
        """``param`` at rest on the host: guarded while `guarding` (a weight never guarded:
        on the CPU, a rest weight), else watched where its forward reads a wire or its
        model computes on a device; in use: plain."""
        home = weight.place() is weight.master
        guarded = self._guarding and home and param in self._guarded
        watched = home and not self._stepping and self._watches(param)
        if not guarded and not watched and type(param) is Param:
            return  # plain, and to stay so (in use, or a CPU run's weight without a wire)
        at_rest.dress(param, guarded=guarded, watched=watched)

    def check(self, named_params: Sequence[tuple[str, Param]]) -> None:
        """Each parameter must own all its memory: freed and refilled whole, it would take a
        view's base (or a parameter sharing it) along."""
        seen: dict[int, str] = {}
        for name, param in named_params:
            if not param.numel():
                continue  # no memory to share
            storage = param.untyped_storage()
            whole = storage.nbytes() == param.numel() * param.element_size()
            other = seen.get(storage.data_ptr())
            if not whole or param.storage_offset() or other is not None:
                shared = (
                    f"shares its memory with {other!r}" if other else "is a view of a larger tensor"
                )
                raise ValueError(
                    f"offload_parameters=True cannot move parameter {name!r}: it {shared}, and "
                    "its weights leave the device whole. Give it memory of its own before "
                    "creating the cache (module.weight = nn.Parameter(module.weight.detach()"
                    ".clone())), or tie parameters by sharing the Parameter object itself."
                )
            seen[storage.data_ptr()] = name

    def source(self, param: Param) -> torch.Tensor:
        return param.detach()

    def device_tensors(
        self, sources: list[torch.Tensor], masters: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """One buffer for the unit (in the compute dtype for floating weights), each compute
        tensor a view of it; each full tensor (the step's) of its own."""
        offsets, numel = unit_offsets(masters)
        dtype = masters[0].dtype
        if self.compute_dtype is not None and dtype.is_floating_point:
            dtype = self.compute_dtype
        device = self.backend.device
        buffer = torch.empty(numel, dtype=dtype, device=device)
        computes = [
            buffer.as_strided(m.shape, m.stride(), at)
            for m, at in zip(masters, offsets, strict=True)
        ]
        # Each tensor's memory given up as it is made: beside a model still on the device,
        # the set-up holds one new tensor at a time, not the unit twice.
        self.backend.resize_storage(buffer, 0)
        fulls = []
        for m in masters:
            fulls.append(torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device))
            self.backend.resize_storage(fulls[-1], 0)
        return buffer, computes, fulls

    def wire_dtype(self, param: Param) -> torch.dtype | None:
        return self.compute_dtype if param.is_floating_point() else None

    def show(self, param: Param, weight: Weight) -> None:
        with at_rest.undispatched():
            param.data = weight.place()
            self._dress(param, weight)

    rest = show  # at rest: ``P.data`` its master

    def in_place(self, param: Param, weight: Weight) -> bool:
        place = weight.place()
        with at_rest.undispatched():
            return param.data_ptr() == place.data_ptr() and param.dtype == place.dtype

    def settle(self, weights: HostWeights, params: Sequence[Param]) -> None:
        """Those of ``params`` (whole units) on the device for good, as plain parameters
        filled from their masters. Raises torch.OutOfMemoryError, all still home, without room."""
        held = set(weights.params())
        params = [param for param in params if param in held]
        # A P.data the user rebound (p.data = t, model.to(dtype): refused at the next forward
        # or step) holds the newest values, which the close keeps, as plain PyTorch would.
        rebound = {param: param.data for param in params if not weights.in_place(param)}
        weights.free(params)  # a dirty weight's copy back first: the masters are the newest
        weights.wait_on_host()
        homes = self.backend.finish_to_device(
            self.backend.start_to_device(list(weights.masters(params)))
        )
        for param, home in zip(params, homes, strict=True):
            param.data = rebound.get(param, home)
            self._guarded.discard(param)
            at_rest.forget(param)
        weights.drop(params)
        self._settled.extend(params)

    def close(self, weights: HostWeights) -> None:
        """Every weight settled; without room they stay on the host, with a warning: the
        end of a run must not fail."""
        try:
            self.settle(weights, weights.params())
        except torch.OutOfMemoryError:
            # The model in one place that a new cache can take: the settled units join the
            # rest on the host, each master in memory of its own (briefly twice the bytes).
            kept = [p for p in self._settled if p.device == self.backend.device]
            for param in kept:
                param.data = param.data.cpu()
            for param in weights.params():
                param.data = param.data.clone()
            size = sum(master.nbytes for master in weights.masters())
            size += sum(param.nbytes for param in kept)
            warnings.warn(
                f"The gradient cache closed, and the model's weights ({size / 2**20:.1f} "
                "MiB) did not fit on the device, where plain PyTorch keeps them: they stay "
                "in host memory (model.parameters() are host tensors). Save them "
                "(model.state_dict()) or hand the model to a new cache with "
                "offload_parameters=True.",
                UserWarning,
                stacklevel=outside_the_package(),
            )
        finally:
            for param in [*self._guarded, *weights.params()]:  # a closed cache: plain ones
                at_rest.forget(param)
            self._guarded.clear()
