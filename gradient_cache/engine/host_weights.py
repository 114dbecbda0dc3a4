"""The weights in host memory, on the device only while in use (``offload_parameters``).

Each parameter ``P`` the model holds keeps its fp32 *master* in host memory (cut from
slabs as the optimizer state's host copies are: pinned on CUDA, the host budget checked
before any is allocated) and, at rest, ``P.data`` *is* that master: ``model.parameters()``,
``model.state_dict()`` and ``load_state_dict`` read and write the masters, on the host.

While ``P`` is in use (its block's forward and backward, its bucket's optimizer step) it
holds a device tensor ``D`` of its own, the same one every time: ``D``'s memory is
allocated and filled from the master (`bring`, `ensure`), then given up
(``untyped_storage().resize_(0)``, `free`) when the use ends, and the storage object stays.
Tensors autograd saved in forward (``P`` itself, or a view of it such as ``P.t()``) share
that storage, so backward reads them again once it is refilled. A refill writes ``D``,
not ``P``: the version counter the saved tensors check (``P``'s, shared by its views) does
not change. Forward and backward only read the weights: a use ends without a copy back;
the step's use ends with one (`store`).

Streams (CUDA): ``D``'s memory is allocated on the compute stream and filled on the
restore stream, which first waits for the compute stream (`Backend.start_refill`); the
compute stream waits for the copy before the block uses it (`ensure`, through
`Backend.finish_to_device`). A weight brought but never used waits for its copy too
before its memory goes (`free`): the allocator hands freed blocks on in compute-stream
order. After the step the copy back runs on the copy stream, and the compute stream waits
for it before ``D``'s memory goes (`Backend.release`); the next refill's restore stream
waits on the compute stream, so it reads the master only after the copy back wrote it.
The host reads or writes a master only after `wait_on_host`.

With a compute dtype (``compute_dtype=torch.bfloat16``) the host also keeps a *shadow* of
each floating master in that dtype, and forward and backward get a device copy of the
shadow (half the link's bytes), while the step gets the fp32 master in a device tensor of
its own: the optimizer steps the master, and `store` sends it back with a new shadow,
cast from it on the device (``.to(dtype)``: the same bits as FSDP2's cast of its fp32
shards before its all-gather).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .backend import Backend, Transfer
from .layout import gradient_strides
from .state_slabs import StateSlabs

Param = torch.nn.Parameter


class WeightAt(enum.Enum):
    """Where a parameter's weights are: ``P.data`` is the host master (HOST), its device
    tensor is being filled (ARRIVING), or ``P.data`` is the filled device tensor (DEVICE)."""

    HOST = "host"
    ARRIVING = "arriving"
    DEVICE = "device"


@dataclass
class _Weight:
    master: torch.Tensor  # on the host: P.data at rest
    shadow: torch.Tensor  # on the host, in the compute dtype (the master itself without one)
    compute: torch.Tensor  # D for forward and backward: memory only while in use
    full: torch.Tensor  # D for the step, the master's dtype (``compute`` without one)
    at: WeightAt = WeightAt.HOST
    in_use: torch.Tensor | None = None  # ``compute`` or ``full``, while not HOST
    arrival: Transfer | None = None

    def place(self) -> torch.Tensor:
        """What ``P.data`` is: the device tensor in use once arrived, else the master."""
        if self.at is WeightAt.DEVICE and self.in_use is not None:
            return self.in_use
        return self.master

    def copy_for(self, *, step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(device tensor, host source) of the step's copy or of forward and backward's."""
        return (self.full, self.master) if step else (self.compute, self.shadow)


class HostWeights:
    """The masters and device tensors of ``named_params`` (see the module docstring).
    Construction copies each parameter's data into its master and frees the device copy:
    the host budget (``fraction``) is checked first, and nothing changes if it refuses."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, Param]],
        backend: Backend,
        *,
        fraction: float,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.backend = backend
        self.compute_dtype = compute_dtype
        _check_own_storage(named_params)
        self._slabs = StateSlabs(
            backend.host_slab,
            fraction=fraction,
            round_up=backend.host_slabs_round_up,
            what="the weights' masters, offload_parameters=True",
        )
        params = [param for _, param in named_params]
        shadowed = [p for p in params if self._shadowed(p)]
        self._slabs.expect(params)
        regions = iter(
            self._slabs.take(
                [p.numel() * p.element_size() for p in params]
                + [p.numel() * _itemsize(compute_dtype) for p in shadowed]
            )
        )
        masters = [self._view(next(regions), param, param.dtype) for param in params]
        shadows = {}
        if compute_dtype is not None:
            shadows = {p: self._view(next(regions), p, compute_dtype) for p in shadowed}
        self._weights: dict[Param, _Weight] = {}
        for param, master in zip(params, masters, strict=True):
            master.copy_(param.detach())
            shadow = shadows.get(param, master)
            if shadow is not master:
                shadow.copy_(param.detach())  # the cast FSDP2 makes of its fp32 shards
            full = self._device_like(master)
            compute = self._device_like(shadow) if shadow is not master else full
            param.data = master
            self._weights[param] = _Weight(master, shadow, compute, full)
        # Host-to-device and back, counted as they start, since the last step ended; and
        # the last step's (its forward and backward passes, and the step).
        self.moved_bytes = 0
        self.moved_last_step = 0

    def _shadowed(self, param: Param) -> bool:
        return self.compute_dtype is not None and param.is_floating_point()

    @staticmethod
    def _view(region: torch.Tensor, param: Param, dtype: torch.dtype) -> torch.Tensor:
        """``region`` as a tensor of ``param``'s shape and strides, in ``dtype``."""
        return region.view(dtype).as_strided(param.shape, gradient_strides(param))

    def _device_like(self, host: torch.Tensor) -> torch.Tensor:
        """A device tensor like ``host`` (shape, strides, dtype), its memory given up."""
        device = torch.empty_strided(
            host.shape, host.stride(), dtype=host.dtype, device=self.backend.device
        )
        self.backend.resize_storage(device, 0)
        return device

    @property
    def host_bytes(self) -> int:
        """What the masters' slabs take (on CUDA: what they pin)."""
        return self._slabs.reserved_bytes

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of the masters' slabs (a detached master), not a
        Parameter."""
        return not isinstance(tensor, Param) and self._slabs.holds(tensor)

    def where(self, param: Param) -> WeightAt:
        return self._weights[param].at

    def in_place(self, param: Param) -> bool:
        """Whether ``param.data`` is where these weights put it (its master, or its device
        tensor in use), not moved since (``model.to(...)``)."""
        weight = self._weights.get(param)
        if weight is None:
            return False
        place = weight.place()
        return param.data_ptr() == place.data_ptr() and param.dtype == place.dtype

    def device_bytes(self) -> int:
        """The device memory the weights hold now (arriving or in use)."""
        return sum(_nbytes(w.in_use) for w in self._weights.values() if w.in_use is not None)

    def bring(self, params: Iterable[Param], *, step: bool = False) -> None:
        """Start filling the device tensors of those of ``params`` at home (a block
        ahead: the copies run while the device computes); ``step``: the masters, for the
        optimizer, else their copies in the compute dtype."""
        chosen = []
        for param in params:
            weight = self._weights[param]
            device, host = weight.copy_for(step=step)
            if weight.at is not WeightAt.HOST and weight.in_use is not device:
                self.free([param])  # in use the other way (never between the step's phases)
            if weight.at is WeightAt.HOST:
                chosen.append((weight, device, host))
        if not chosen:
            return
        for _, device, _ in chosen:
            self.backend.resize_storage(device, _nbytes(device))  # on the compute stream
        try:
            transfer = self.backend.start_refill([(device, host) for _, device, host in chosen])
        except BaseException:
            for _, device, _ in chosen:  # nothing started: they stay home
                self.backend.resize_storage(device, 0)
            raise
        self.moved_bytes += sum(_nbytes(device) for _, device, _ in chosen)
        for weight, device, _ in chosen:
            weight.at, weight.in_use, weight.arrival = WeightAt.ARRIVING, device, transfer

    def ensure(self, params: Iterable[Param], *, step: bool = False) -> None:
        """``params`` on the device, safe for work queued from now on: each one's
        ``P.data`` is its filled device tensor (``step``: the master's)."""
        params = list(params)
        self.bring(params, step=step)
        for param in params:
            weight = self._weights[param]
            if weight.at is WeightAt.ARRIVING:
                self._arrived(weight)
                weight.at = WeightAt.DEVICE
                param.data = weight.place()

    def free(self, params: Iterable[Param]) -> None:
        """``params``' device memory given up, ``P.data`` the master again (no copy
        back: forward and backward do not change the weights)."""
        for param in params:
            weight = self._weights[param]
            if weight.at is WeightAt.HOST:
                continue
            if weight.at is WeightAt.ARRIVING:
                self._arrived(weight)  # before its memory can be handed on
            param.data = weight.master
            assert weight.in_use is not None  # set with ARRIVING
            self.backend.resize_storage(weight.in_use, 0)
            weight.at, weight.in_use = WeightAt.HOST, None

    def store(self, params: Iterable[Param]) -> None:
        """After ``params`` stepped on the device: their weights copied into their
        masters, then their device memory given up once the copies have read it."""
        present = [p for p in params if self._weights[p].at is WeightAt.DEVICE]
        if not present:
            return
        pairs = []
        for param in present:
            weight = self._weights[param]
            pairs.append((weight.full, weight.master))
            if weight.shadow is not weight.master:  # a new shadow, cast on the device
                pairs.append((weight.full.to(weight.shadow.dtype), weight.shadow))
        transfer = self.backend.start_to_host(pairs)
        self.moved_bytes += sum(_nbytes(device) for device, _ in pairs)
        # The compute stream waits for the copies back before the memory goes.
        self.backend.release(transfer)
        self.free(present)

    def refresh_shadows(self) -> None:
        """Each shadow cast again from its master (the host wrote the masters: a load)."""
        self.wait_on_host()
        for weight in self._weights.values():
            if weight.shadow is not weight.master:
                weight.shadow.copy_(weight.master)

    def step_ended(self) -> None:
        """A step ended: what moved since the last one is its figure."""
        self.moved_last_step, self.moved_bytes = self.moved_bytes, 0

    def masters(self) -> tuple[torch.Tensor, ...]:
        """The masters and their copies in the compute dtype, in host memory (memory
        accounting)."""
        return tuple(
            t
            for w in self._weights.values()
            for t in {id(t): t for t in (w.master, w.shadow)}.values()
        )

    def device_tensors(self) -> tuple[torch.Tensor, ...]:
        """The device tensors, whose memory is allocated and given up by resizing their
        storages in place (memory accounting: a storage's size now is what it holds)."""
        return tuple(
            t
            for w in self._weights.values()
            for t in {id(t): t for t in (w.compute, w.full)}.values()
        )

    def present(self) -> list[Param]:
        """The parameters whose weights are on the device or on their way."""
        return [p for p, w in self._weights.items() if w.at is not WeightAt.HOST]

    def wait_on_host(self) -> None:
        """Block the host until every copy to or from a master is complete: before the
        host reads one (``model.state_dict()``) or writes one (``load_state_dict``)."""
        self.backend.wait_for_state_copies()

    def close(self) -> None:
        """Every weight back on the device for good, as plain PyTorch keeps it (``P.data``
        a new device tensor), the masters let go. Weights the device has no room for stay
        on the host, with a warning: the end of a run must not fail."""
        self.wait_on_host()
        params = list(self._weights)
        try:
            homes = self.backend.finish_to_device(
                self.backend.start_to_device([self._weights[p].master for p in params])
            )
        except torch.OutOfMemoryError:
            self.free(params)
            size = sum(w.master.nbytes for w in self._weights.values())
            warnings.warn(
                f"The gradient cache closed, and the model's weights ({size / 2**20:.1f} "
                "MiB) did not fit on the device, where plain PyTorch keeps them: they stay "
                "in host memory (model.parameters() are host tensors). Save them "
                "(model.state_dict()) or hand the model to a new cache with "
                "offload_parameters=True.",
                UserWarning,
                stacklevel=4,
            )
        else:
            for param, home in zip(params, homes, strict=True):
                self.free([param])
                param.data = home
        self._weights = {}

    def _arrived(self, weight: _Weight) -> None:
        assert weight.arrival is not None  # ARRIVING is set with its arrival
        self.backend.finish_to_device(weight.arrival)
        weight.arrival = None


def _nbytes(tensor: torch.Tensor) -> int:
    """A dense tensor's bytes (what its storage takes when filled)."""
    return tensor.numel() * tensor.element_size()


def _itemsize(dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else dtype.itemsize


def _check_own_storage(named_params: Sequence[tuple[str, Param]]) -> None:
    """Each parameter must own its memory, all of it: its device copy is freed and
    refilled whole, which would take a view's base (or a parameter sharing it) along."""
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
