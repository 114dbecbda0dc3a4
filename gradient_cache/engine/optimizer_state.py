"""The optimizer's state in host memory between steps, on the device one bucket at a time.

With ``offload_optimizer_state=True`` the fused step (`fused_step.step`) keeps every
per-parameter state tensor the optimizer holds on the parameter's device (Adam's moments,
SGD's momentum buffer: any tensor with a dimension) in host memory between steps, where
``optimizer.state`` and ``optimizer.state_dict()`` show it. Scalars (``step``) stay as the
optimizer keeps them. A bucket's state travels with its gradients: brought to the device
ahead of its step (`bring`, then `install`), stepped there, copied back (`send_back`), and
its device copy let go once that copy has read it. A state the optimizer creates in a
bucket's step (its first) goes to the host the same way, so the whole state is never on
the device at once.

A bucket's new host copies are cut from slabs laid out by the backend (on CUDA pinned,
in power-of-two slabs as the payload pool's, which the pinned allocator does not round
up), checked against the host budget before they are allocated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .backend import Backend, Transfer
from .hostmem import check_host_budget
from .layout import gradient_strides
from .pool import aligned

Param = torch.nn.Parameter


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
    inner = {
        name: rebuilt(each, tensors) if isinstance(each, torch.Tensor) else each
        for name, each in inner.items()
    }
    return type(value).__tensor_unflatten__(inner, context, value.size(), value.stride())


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def offloaded(value: object) -> bool:
    """Whether a state value is one the cache keeps on the host: a tensor with a dimension
    (Adam's moments, a momentum buffer), not a scalar such as ``step``."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


@dataclass
class Arrival:
    """A bucket's state on its way to the device: ``params`` (each one's state as it was:
    empty or not), and per brought tensor its parameter, key and host copy."""

    params: list[Param]
    had_state: list[bool]
    keys: list[tuple[Param, str, torch.Tensor]]
    transfer: Transfer
    installed: bool = False


@dataclass
class HostOptimizerState:
    """The host copies of the optimizer's state and their journeys (see the module
    docstring). ``fraction``: ``host_memory_fraction``, for the budget checks."""

    backend: Backend
    fraction: float
    # The host copy of each (parameter, key): a value in optimizer.state that *is* one of
    # these is on the host; any other offloaded value is on the device.
    host: dict[Param, dict[str, torch.Tensor]] = field(default_factory=dict)
    host_bytes: int = 0
    # The state bytes the last step moved, to the device and back (counted as it goes).
    moved_bytes: int = 0
    # The optimizers whose load_state_dict puts their state on the host (`attach`).
    _attached: set[int] = field(default_factory=set)
    _loading: list[dict[Param, dict[str, torch.Tensor]]] = field(default_factory=list)
    _sent: list[Transfer] = field(default_factory=list)
    # Parameters whose state stays on the device (a memory budget's decision): brought
    # once more from its host copy, then never sent back.
    on_device: set[Param] = field(default_factory=set)

    # --- a bucket's journey ------------------------------------------------------------

    def bring(self, optimizer: torch.optim.Optimizer, params: Sequence[Param]) -> Arrival:
        """Start copying ``params``' host state to the device (the backend's restore
        stream on CUDA); a state not yet created comes from the step itself."""
        keys: list[tuple[Param, str, torch.Tensor]] = []
        for param in params:
            copies = self.host.get(param, {})
            for key, value in optimizer.state.get(param, {}).items():
                if key in copies and copies[key] is value:
                    keys.append((param, key, copies[key]))
        hosts = [leaf for _, _, host in keys for leaf in leaves(host)]
        self.moved_bytes += nbytes(hosts)
        transfer = self.backend.start_to_device(hosts)
        had_state = [bool(optimizer.state.get(param)) for param in params]
        return Arrival(list(params), had_state, keys, transfer)

    def install(self, optimizer: torch.optim.Optimizer, arrival: Arrival) -> None:
        """Put the brought tensors in ``optimizer.state``, safe for its step to use."""
        device = iter(self.backend.finish_to_device(arrival.transfer))
        for param, key, host in arrival.keys:
            optimizer.state[param][key] = rebuilt(host, device)
        arrival.installed = True

    def send_back(self, optimizer: torch.optim.Optimizer, arrival: Arrival) -> None:
        """After the bucket's step: copy its state (updated or new) to the host, put the
        host copies in ``optimizer.state``, and let the device copies go once the copy has
        read them. New host copies are allocated first: if that raises, the bucket's
        state stays on the device, whole, and moves at its next step."""
        pairs = []
        for param in arrival.params:
            if param in self.on_device:
                continue
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if offloaded(value) and self.host.get(param, {}).get(key) is not value:
                    pairs.append((param, key, value))
        self._allocate([item for item in pairs if not self._has_copy_for(*item)])
        copies = [
            (device, host)
            for param, key, value in pairs
            for device, host in zip(leaves(value), leaves(self.host[param][key]), strict=True)
        ]
        self.moved_bytes += nbytes([device for device, _ in copies])
        transfer = self.backend.start_to_host(copies)
        for param, key, _ in pairs:
            optimizer.state[param][key] = self.host[param][key]
        # The device copies go only after the copy back read them (`Backend.release`).
        self.backend.release(transfer)
        self._sent.append(transfer)

    def _has_copy_for(self, param: Param, key: str, value: torch.Tensor) -> bool:
        """Whether a host copy like ``value`` (shape, dtype, kind) exists for (param, key)."""
        host = self.host.get(param, {}).get(key)
        if host is None or type(host) is not type(value):
            return False
        return [(t.shape, t.dtype) for t in leaves(host)] == [
            (t.shape, t.dtype) for t in leaves(value)
        ]

    def abandon(self, optimizer: torch.optim.Optimizer, arrivals: Iterable[Arrival]) -> None:
        """A step raised: put each bucket's state back as it was before its journey (the
        host copies, unchanged; a state its step had begun to create, dropped), so that a
        retry steps from it."""
        for arrival in arrivals:
            if not arrival.installed:
                self.backend.finish_to_device(arrival.transfer)  # before its blocks are freed
            for param, key, host in arrival.keys:
                optimizer.state[param][key] = host
            for param, had in zip(arrival.params, arrival.had_state, strict=True):
                if not had:
                    optimizer.state.pop(param, None)

    def keep_on_device(self, params: Iterable[Param]) -> None:
        """From the next step on, ``params``' state stays on the device (their host copies
        stay allocated: they share slabs with the others')."""
        self.on_device.update(params)

    def bytes_by_param(self) -> dict[Param, int]:
        """Each parameter's host copies, in bytes."""
        return {
            param: nbytes(leaf for host in copies.values() for leaf in leaves(host))
            for param, copies in self.host.items()
        }

    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        """The plain tensors of every host copy (memory accounting)."""
        hosts = [host for copies in self.host.values() for host in copies.values()]
        return tuple(leaf for host in hosts for leaf in leaves(host))

    def settle(self) -> None:
        """The step's end: wait until the host copies are complete, so that the host reads
        them (``state_dict()``, a checkpoint) and the next step brings them whole."""
        if self._sent:
            self.backend.settle(self._sent[-1])  # the copies back run in order
        self._sent.clear()

    def _allocate(self, items: list[tuple[Param, str, torch.Tensor]]) -> None:
        """Host copies like ``items``' values (each plain tensor inside with its shape,
        strides and dtype), cut from new slabs (`Backend.host_layout`), after the host
        budget check."""
        inner = [leaves(value) for _, _, value in items]
        flat = [leaf for values in inner for leaf in values]
        sizes = [aligned(leaf.numel() * leaf.element_size()) for leaf in flat]
        if not sum(sizes):
            return
        layout = self.backend.host_layout(sizes)
        total = sum(size for size, _ in layout)
        check_host_budget(total, fraction=self.fraction, what="the optimizer's state")
        hosts: list[torch.Tensor] = [torch.empty(0)] * len(flat)
        for size, placed in layout:
            slab = self.backend.host_slab(size)
            for index, offset in placed:
                leaf = flat[index]
                region = slab[offset : offset + leaf.numel() * leaf.element_size()]
                hosts[index] = region.view(leaf.dtype).as_strided(
                    leaf.shape, gradient_strides(leaf)
                )
        taken = iter(hosts)
        for param, key, value in items:
            self.host.setdefault(param, {})[key] = rebuilt(value, taken)
        self.host_bytes += total

    # --- optimizer.load_state_dict -------------------------------------------------------

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A fused step begins: its moved bytes count from zero, and ``optimizer``'s
        loads put their state on the host (`attach`)."""
        self.moved_bytes = 0
        self.attach(optimizer)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """From now on ``optimizer.load_state_dict`` puts the offloaded state in host
        memory, never on the device (the loaded values, cast as the optimizer casts them);
        once per optimizer."""
        if id(optimizer) in self._attached:
            return
        self._attached.add(id(optimizer))
        optimizer.register_load_state_dict_pre_hook(self._take_tensors)
        optimizer.register_load_state_dict_post_hook(self._place_on_host)

    def _take_tensors(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> Any:
        """Take the tensors the cache offloads out of the loaded state, before the
        optimizer moves them to the parameters' device. A state whose groups do not match
        the optimizer's is refused as ``load_state_dict`` refuses it, before anything
        changes (this hook runs before torch's own check)."""
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
            taken[index] = {k: v for k, v in values.items() if offloaded(v)}
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
        by_index: dict[int, Param] = dict(zip(saved, params, strict=True))
        self._loading.append({by_index[index]: values for index, values in taken.items()})
        return {**state_dict, "state": kept}

    def _place_on_host(self, optimizer: torch.optim.Optimizer) -> None:
        """The taken tensors into host copies (an existing one of the same shape and dtype
        is reused), cast as the optimizer casts a loaded state: floating values to a
        floating parameter's dtype."""
        taken = self._loading.pop()
        new = []
        for param, values in taken.items():
            for key, value in values.items():
                if param.is_floating_point() and value.is_floating_point():
                    values[key] = value = value.to(dtype=param.dtype)
                if not self._has_copy_for(param, key, value):
                    new.append((param, key, value))
        self._allocate(new)
        for param, values in taken.items():
            for key, value in values.items():
                host = self.host[param][key]
                for host_leaf, leaf in zip(leaves(host), leaves(value), strict=True):
                    host_leaf.copy_(leaf)
                optimizer.state[param][key] = host
