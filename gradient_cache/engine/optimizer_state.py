"""The optimizer's state in host memory between steps, on the device one bucket at a time.

Each moment of a state tensor, its stream and what orders it: docs/ARCHITECTURE.md, "The
life of an optimizer-state tensor".
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

from .backend import Backend, Transfer
from .layout import gradient_strides
from .records import StateAt
from .state_slabs import StateSlabs
from .users_line import outside_the_package

Param = torch.nn.Parameter
Optimizer = torch.optim.Optimizer
# One optimizer's host copies: per parameter, per state key.
Copies = dict[Param, dict[str, torch.Tensor]]
# An optimizer's ``state``: per parameter, its values by key.
OptimizerStateDict = MutableMapping[torch.Tensor, Any]


@dataclass
class StateCopies:
    """One optimizer's offloaded state: its host copies and where each parameter's values
    are (`StateAt`). Others write ``optimizer.state`` too (a framework on resume), so
    `HostOptimizerState.send` compares values with their host copies: identity decides."""

    copies: Copies = field(default_factory=dict)
    at: dict[Param, StateAt] = field(default_factory=dict)


def leaves(value: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``value``: itself, or a tensor subclass's inner tensors
    in flatten order (torchao's 8-bit state: its codes, block scales and code table)."""
    if not is_traceable_wrapper_subclass(value):
        return [value]
    names, _ = value.__tensor_flatten__()
    inner = [getattr(value, name) for name in names]  # a DTensor also names its mesh
    return [leaf for each in inner if isinstance(each, torch.Tensor) for leaf in leaves(each)]


def rebuilt(value: torch.Tensor, tensors: Iterator[torch.Tensor]) -> torch.Tensor:
    """``value``'s kind and structure around the next plain tensors of ``tensors``."""
    if not is_traceable_wrapper_subclass(value):
        return next(tensors)
    names, context = value.__tensor_flatten__()
    inner = {name: getattr(value, name) for name in names}
    inner = {k: rebuilt(v, tensors) if isinstance(v, torch.Tensor) else v for k, v in inner.items()}
    return type(value).__tensor_unflatten__(inner, context, value.size(), value.stride())


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def offloaded(value: object) -> bool:
    """Whether a state value is one the cache keeps on the host: a tensor with a dimension
    (Adam's moments, a momentum buffer), not a scalar such as ``step``."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


@dataclass
class Arrival:
    """A bucket's state on its way to the device: ``params`` (``fresh``: those with none
    yet), per brought tensor its parameter, key and host copy, and a copy of each entry
    that stays where the optimizer keeps it (Adam's ``step``)."""

    params: list[Param]
    fresh: list[Param]
    keys: list[tuple[Param, str, torch.Tensor]]
    transfer: Transfer
    kept: list[tuple[Param, str, Any]]
    installed: bool = False


@dataclass
class HostOptimizerState:
    """Every optimizer's host copies and their journeys (``fraction``: the host budget's)."""

    backend: Backend
    fraction: float
    # Per optimizer (weakly; two optimizers over one parameter have two states), its
    # `StateCopies`: a value in optimizer.state that *is* its host copy is on the host.
    host: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    host_bytes: int = 0
    # The state bytes the fused step under way moved, to the device and back (counted as
    # they go), and those the last step moved: its fused steps', every optimizer's.
    moved_bytes: int = 0
    moved_last_step: int = 0
    _counted_step: int = -1  # the step moved_last_step counts
    _counted: set[int] = field(default_factory=set)  # its optimizers' `StateCopies` (ids)
    # The attached optimizers (weakly) and their hooks' handles, removed by `close`.
    _attached: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    _loading: list[dict[Param, dict[str, torch.Tensor]]] = field(default_factory=list)
    # Parameters whose state stays on the device (a memory budget's decision): brought
    # once more from its host copy, then never sent back.
    on_device: set[Param] = field(default_factory=set)
    # Whether a parameter's weight rests on the host between steps (offload_parameters,
    # `Pipeline.carry_weights`): it steps on the device all the same.
    rests_on_host: Callable[[Param], bool] = lambda param: False

    def __post_init__(self) -> None:
        # Where every host copy is cut from (the backend's slabs: pinned on CUDA).
        self._slabs = StateSlabs(
            self.backend.host_slab,
            fraction=self.fraction,
            round_up=self.backend.host_slabs_round_up,
        )

    def send(self, state: OptimizerStateDict, owned: StateCopies, params: Iterable[Param]) -> None:
        """Each offloaded value of ``params`` in ``state`` that is not its host copy in
        ``owned`` copied to the host and replaced by it. New host copies are allocated
        first: if that raises, the state stays on the device, whole, and moves next step."""
        pairs = [
            (param, key, value)
            for param in params
            if param not in self.on_device
            for key, value in state.get(param, {}).items()
            if offloaded(value) and owned.copies.get(param, {}).get(key) is not value
        ]
        self._allocate(pairs, owned.copies)
        copies = [
            (device, host)
            for param, key, value in pairs
            for device, host in zip(leaves(value), leaves(owned.copies[param][key]), strict=True)
        ]
        self.moved_bytes += nbytes([device for device, _ in copies])
        transfer = self.backend.start_to_host(copies)
        for param, key, _ in pairs:
            state[param][key] = owned.copies[param][key]
            owned.at[param] = StateAt.HOST
        # The device copies go only after the copy back read them (`Backend.release`).
        self.backend.release(transfer)

    def send_to_host(self, optimizer: Optimizer) -> None:
        """``optimizer`` attached, its offloaded values on the device (loaded before, moved by
        a framework, made by a plain step) to their host copies, but a budget's kept ones. A
        bring is ordered after the copy (`Backend.release` makes compute wait for it, the
        restore stream waits for compute); the host reads them after `wait_on_host`."""
        self.attach(optimizer)
        self._scalars_to_device(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.send(optimizer.state, self.state_copies(optimizer), params)

    def _scalars_to_device(self, optimizer: Optimizer) -> None:
        """The scalar tensors ``load_state_dict`` put beside a parameter at rest on the host
        to the device it steps on, where plain PyTorch's load puts them: torch's policy puts
        each beside its parameter but the ``step`` of an optimizer neither capturable nor
        fused, and a capturable step refuses a ``step`` on the host."""
        for group in optimizer.param_groups:
            beside = bool(group.get("capturable") or group.get("fused"))
            for param in group["params"]:
                if not self.rests_on_host(param):
                    continue
                state = optimizer.state.get(param, {})
                for key, value in state.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and not offloaded(value)  # a scalar: a moment beside it is send's
                        and value.device == param.device
                        and (beside or key != "step")
                    ):
                        state[key] = value.to(self.backend.device)

    def copies_of(self, optimizer: Optimizer) -> Copies:
        """``optimizer``'s host copies (empty if it has none): read-only for callers."""
        return self.host[optimizer].copies if optimizer in self.host else {}

    def state_copies(self, optimizer: Optimizer) -> StateCopies:
        """``optimizer``'s `StateCopies` (made empty the first time)."""
        return self.host.setdefault(optimizer, StateCopies())

    def _has_copy_for(self, copies: Copies, param: Param, key: str, value: torch.Tensor) -> bool:
        host = copies.get(param, {}).get(key)
        if host is None or type(host) is not type(value):
            return False
        return [(t.shape, t.dtype) for t in leaves(host)] == [
            (t.shape, t.dtype) for t in leaves(value)
        ]

    def keep_on_device(self, params: Iterable[Param]) -> None:
        """From the next step on, ``params``' state stays on the device (host copies kept)."""
        self.on_device.update(params)

    def bytes_by_param(self) -> dict[Param, int]:
        """Each parameter's host bytes, every optimizer's: what its state costs on the device."""
        total: dict[Param, int] = {}
        for owned in self.host.values():
            for param, copies in owned.copies.items():
                size = nbytes(leaf for host in copies.values() for leaf in leaves(host))
                total[param] = total.get(param, 0) + size
        return total

    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        """The plain tensors of every host copy, every optimizer's (memory accounting)."""
        return tuple(
            leaf
            for owned in self.host.values()
            for copies in owned.copies.values()
            for host in copies.values()
            for leaf in leaves(host)
        )

    def wait_on_host(self) -> None:
        """Block the host until every state copy started so far is complete: before the
        host reads a host copy (a post-hook, a checkpoint) or writes one (a load)."""
        self.backend.wait_for_state_copies()

    def _allocate(self, items: list[tuple[Param, str, torch.Tensor]], copies: Copies) -> None:
        """Host copies like ``items``' values (each leaf's shape, strides, dtype) in
        ``copies`` where it has none alike, cut from the slabs (`StateSlabs.take` checks the
        host budget)."""
        items = [item for item in items if not self._has_copy_for(copies, *item)]
        flat = [leaf for _, _, value in items for leaf in leaves(value)]
        regions = self._slabs.take([leaf.numel() * leaf.element_size() for leaf in flat])
        taken = (
            region.view(leaf.dtype).as_strided(leaf.shape, gradient_strides(leaf))
            for region, leaf in zip(regions, flat, strict=True)
        )
        for param, key, value in items:
            copies.setdefault(param, {})[key] = rebuilt(value, taken)
        self.host_bytes = self._slabs.reserved_bytes

    def _compact_state_dict(
        self, optimizer: Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """``state_dict()``'s post-hook: each host copy (a slab view, which ``torch.save``
        would write whole) as a compact copy, read once the copies back are complete; in
        new per-parameter dicts, as the optimizer's own keep the host copies."""
        self.wait_on_host()
        state_dict["state"] = {
            index: {key: self._compact(value) for key, value in values.items()}
            for index, values in state_dict["state"].items()
        }
        return state_dict

    def _compact(self, value: object) -> object:
        """A host copy's value in tensors of its own; anything else as it is."""
        if not isinstance(value, torch.Tensor) or not self._slabs.holds(leaves(value)[0]):
            return value
        return rebuilt(value, iter([leaf.clone() for leaf in leaves(value)]))

    def begin_step(self, optimizer: Optimizer) -> StateJourney:
        """A fused step begins: moved bytes from zero (a failed attempt's not counted),
        ``optimizer``'s state on the device sent home (`send_to_host`). Returns the step's
        journeys of its state."""
        self.moved_bytes = 0
        self._slabs.expect(p for group in optimizer.param_groups for p in group["params"])
        self.send_to_host(optimizer)
        return StateJourney(self, optimizer.state, self.state_copies(optimizer))

    def step_ended(self, steps: int, owned: StateCopies) -> None:
        """The fused step of ``owned``'s optimizer completed step ``steps``: its moved bytes
        are the last step's, added to other optimizers' of the same step (the weights' rule,
        `HostWeights.step_ended`). A step that delivered no cached gradient (a budget keeps
        them all) leaves ``steps`` as it was: there, an optimizer stepping again begins the
        next."""
        if steps != self._counted_step or id(owned) in self._counted:
            self.moved_last_step, self._counted_step, self._counted = 0, steps, set()
        self.moved_last_step += self.moved_bytes
        self._counted.add(id(owned))
        self.moved_bytes = 0

    def attach(self, optimizer: Optimizer) -> None:
        """From now on ``optimizer.load_state_dict`` puts the offloaded state on the host
        (cast as the optimizer casts it), never on the device; once, until `close`."""
        if optimizer in self._attached:
            return
        self._attached[optimizer] = [
            optimizer.register_load_state_dict_pre_hook(_held_weakly(self._take_tensors)),
            optimizer.register_load_state_dict_post_hook(_held_weakly(self._place_on_host)),
            # A checkpoint holds the state's bytes, not its slabs' (`_compact_state_dict`).
            optimizer.register_state_dict_post_hook(_held_weakly(self._compact_state_dict)),
        ]

    def close(self) -> None:
        """Remove the load hooks and hand each state back to the device as new tensors (the
        host copies dropped), so it steps on without the cache. A state with no room on the
        device stays on the host, with a warning: a run's end must not fail for it."""
        self.wait_on_host()  # the last copies back complete before they are read
        for handles in list(self._attached.values()):
            for handle in handles:
                handle.remove()
        self._attached = WeakIdKeyDictionary()
        for optimizer, owned in list(self.host.items()):
            try:
                self._bring_home(optimizer, owned.copies)
            except torch.OutOfMemoryError:
                size = nbytes(
                    leaf for c in owned.copies.values() for h in c.values() for leaf in leaves(h)
                )
                warnings.warn(
                    f"The gradient cache closed, and {type(optimizer).__name__}'s state "
                    f"({size / 2**20:.1f} MiB) did not fit on the device, where plain PyTorch "
                    "keeps it: it stays in host memory. Save it (optimizer.state_dict()) or "
                    "hand it to a new cache with offload_optimizer_state=True; a plain "
                    "optimizer.step() needs it on the device.",
                    UserWarning,
                    stacklevel=outside_the_package(),
                )
        self.host = WeakIdKeyDictionary()
        self.host_bytes = 0

    def _bring_home(self, optimizer: Optimizer, owned: Copies) -> None:
        """``optimizer``'s values that are host copies, as new device tensors."""
        places = [
            (param, key, host)
            for param, copies in owned.items()
            for key, host in copies.items()
            if optimizer.state.get(param, {}).get(key) is host
        ]
        hosts = [leaf for _, _, host in places for leaf in leaves(host)]
        device = iter(self.backend.finish_to_device(self.backend.start_to_device(hosts)))
        for param, key, host in places:
            optimizer.state[param][key] = rebuilt(host, device)

    def _take_tensors(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> Any:
        """Take the offloaded tensors out of the loaded state before the optimizer moves
        them to the device. Unmatched groups are refused as ``load_state_dict`` refuses
        them, before anything changes (this hook runs before torch's check)."""
        saved_sizes = [len(g["params"]) for g in state_dict["param_groups"]]
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        if len(saved_sizes) != len(sizes):
            raise ValueError(
                f"loaded state dict has a different number of parameter groups "
                f"({len(saved_sizes)}) than the optimizer ({len(sizes)})"
            )
        if saved_sizes != sizes:
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of "
                f"optimizer's group (parameters per group: saved {saved_sizes}, optimizer "
                f"{sizes})"
            )
        kept, taken = {}, {}
        for index, values in state_dict["state"].items():
            kept[index] = {k: v for k, v in values.items() if not offloaded(v)}
            if moved := {k: v for k, v in values.items() if offloaded(v)}:
                taken[index] = moved  # a state of scalars alone has nothing on the host
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
        by_index: dict[int, Param] = dict(zip(saved, params, strict=True))
        self._loading.append({by_index[index]: values for index, values in taken.items()})
        return {**state_dict, "state": kept}

    def _place_on_host(self, optimizer: Optimizer) -> None:
        """The taken tensors into ``optimizer``'s host copies (reused where alike), floating
        values cast to a floating parameter's dtype, as the optimizer casts a load."""
        self.wait_on_host()  # before the host overwrites host copies a copy may still use
        taken = self._loading.pop()
        owned = self.state_copies(optimizer)
        items = [
            (param, key, value.to(dtype=param.dtype))
            if param.is_floating_point() and value.is_floating_point()
            else (param, key, value)
            for param, values in taken.items()
            for key, value in values.items()
        ]
        self._allocate(items, owned.copies)
        owned.at.update(dict.fromkeys(taken, StateAt.HOST))
        for param, key, value in items:
            host = owned.copies[param][key]
            for host_leaf, leaf in zip(leaves(host), leaves(value), strict=True):
                host_leaf.copy_(leaf)
            optimizer.state[param][key] = host


@dataclass(frozen=True)
class StateJourney:
    """One fused step's journeys of one optimizer's state, a bucket at a time."""

    states: HostOptimizerState
    state: OptimizerStateDict
    owned: StateCopies

    def bring(self, params: Sequence[Param]) -> Arrival:
        """Start copying ``params``' host state to the device (a new state: the step makes it)."""
        keys: list[tuple[Param, str, torch.Tensor]] = []
        for param in params:
            if self.owned.at.get(param) is not StateAt.HOST:
                continue  # none yet (the step creates it), or kept on the device
            copies = self.owned.copies[param]
            values = self.state.get(param, {})
            keys += [(param, key, copies[key]) for key in values if key in copies]
        fresh = [param for param in params if not self.state.get(param)]
        # An optimizer may count its step before it raises (Adam's ``step += 1``, then an
        # out-of-memory error): a retry must find the count as it was. Cloned before the
        # copies start: a clone on a full device (a capturable AdamW's ``step``) that raises
        # then leaves nothing in transit, which no `Arrival` would put back.
        kept = [
            (param, key, value.clone() if isinstance(value, torch.Tensor) else value)
            for param in params
            for key, value in self.state.get(param, {}).items()
            if not offloaded(value)
        ]
        hosts = [leaf for _, _, host in keys for leaf in leaves(host)]
        transfer = self.states.backend.start_to_device(hosts)
        try:
            self.states.moved_bytes += nbytes(hosts)
            for param, _, _ in keys:  # only once started: a failed start leaves them home
                self.owned.at[param] = StateAt.IN_TRANSIT
            return Arrival(list(params), fresh, keys, transfer, kept)
        except BaseException:  # an interrupt (a signal): no `Arrival` will put them back
            self.states.backend.abandon_refills()  # the copies' memory dropped after them
            for param, _, _ in keys:
                self.owned.at[param] = StateAt.HOST
            raise

    def install(self, arrival: Arrival) -> None:
        """Put the brought tensors in the optimizer's state, safe for its step to use."""
        device = iter(self.states.backend.finish_to_device(arrival.transfer))
        for param, key, host in arrival.keys:
            self.state[param][key] = rebuilt(host, device)
            self.owned.at[param] = StateAt.DEVICE
        arrival.installed = True

    def send_back(self, arrival: Arrival) -> None:
        """After the bucket's step: its state, updated or new, to the host (`send`)."""
        self.states.send(self.state, self.owned, arrival.params)

    def abandon(self, arrivals: Iterable[Arrival]) -> None:
        """A step raised: each bucket's state as before its journey (host copies unchanged,
        a state its step began to create dropped), so that a retry steps from it."""
        for arrival in arrivals:
            if not arrival.installed:
                # Before its blocks are freed.
                self.states.backend.finish_to_device(arrival.transfer)
            for param, key, host in arrival.keys:
                self.state[param][key] = host
                self.owned.at[param] = StateAt.HOST
            for param, key, value in arrival.kept:
                self.state[param][key] = value
            for param in arrival.fresh:
                self.state.pop(param, None)
                self.owned.at.pop(param, None)

    def step_ended(self, steps: int) -> None:
        """Each bucket's state went back as its step ended: only the bytes to count."""
        self.states.step_ended(steps, self.owned)


def _held_weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """A `HostOptimizerState`'s bound ``method`` as an optimizer's hook holding it weakly: an
    optimizer outliving its cache does not keep it alive (those of a cache dropped unclosed
    do nothing)."""
    held = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = held()
        return None if bound is None else bound(*args)

    return hook
