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
    device: torch.Tensor  # D: its memory allocated only while in use
    nbytes: int  # D's storage when filled
    at: WeightAt = WeightAt.HOST
    arrival: Transfer | None = None


class HostWeights:
    """The masters and device tensors of ``named_params`` (see the module docstring).
    Construction copies each parameter's data into its master and frees the device copy:
    the host budget (``fraction``) is checked first, and nothing changes if it refuses."""

    def __init__(
        self, named_params: Sequence[tuple[str, Param]], backend: Backend, *, fraction: float
    ) -> None:
        self.backend = backend
        _check_own_storage(named_params)
        self._slabs = StateSlabs(
            backend.host_slab,
            fraction=fraction,
            round_up=backend.host_slabs_round_up,
            what="the weights' masters, offload_parameters=True",
        )
        params = [param for _, param in named_params]
        self._slabs.expect(params)
        regions = self._slabs.take([p.numel() * p.element_size() for p in params])
        self._weights: dict[Param, _Weight] = {}
        for param, region in zip(params, regions, strict=True):
            master = region.view(param.dtype).as_strided(param.shape, gradient_strides(param))
            master.copy_(param.detach())
            device = torch.empty_strided(
                param.shape, master.stride(), dtype=param.dtype, device=backend.device
            )
            nbytes = device.untyped_storage().nbytes()
            backend.resize_storage(device, 0)
            param.data = master
            self._weights[param] = _Weight(master, device, nbytes)
        # Host-to-device and back, counted as they start, since the last step ended; and
        # the last step's (its forward and backward passes, and the step).
        self.moved_bytes = 0
        self.moved_last_step = 0

    @property
    def host_bytes(self) -> int:
        """What the masters' slabs take (on CUDA: what they pin)."""
        return self._slabs.reserved_bytes

    def where(self, param: Param) -> WeightAt:
        return self._weights[param].at

    def device_bytes(self) -> int:
        """The device memory the weights hold now (arriving or in use)."""
        return sum(w.nbytes for w in self._weights.values() if w.at is not WeightAt.HOST)

    def bring(self, params: Iterable[Param]) -> None:
        """Start filling the device tensors of those of ``params`` at home (a block
        ahead: the copies run while the device computes)."""
        pairs = []
        for param in params:
            weight = self._weights[param]
            if weight.at is WeightAt.HOST:
                self.backend.resize_storage(weight.device, weight.nbytes)  # compute stream
                pairs.append((param, weight))
        if not pairs:
            return
        transfer = self.backend.start_refill([(w.device, w.master) for _, w in pairs])
        self.moved_bytes += sum(w.nbytes for _, w in pairs)
        for _, weight in pairs:
            weight.at, weight.arrival = WeightAt.ARRIVING, transfer

    def ensure(self, params: Iterable[Param]) -> None:
        """``params`` on the device, safe for work queued from now on: each one's
        ``P.data`` is its filled device tensor."""
        params = list(params)
        self.bring(params)
        for param in params:
            weight = self._weights[param]
            if weight.at is WeightAt.ARRIVING:
                self._arrived(weight)
                param.data = weight.device
                weight.at = WeightAt.DEVICE

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
            self.backend.resize_storage(weight.device, 0)
            weight.at = WeightAt.HOST

    def store(self, params: Iterable[Param]) -> None:
        """After ``params`` stepped on the device: their weights copied into their
        masters, then their device memory given up once the copies have read it."""
        present = [p for p in params if self._weights[p].at is WeightAt.DEVICE]
        if not present:
            return
        pairs = [(self._weights[p].device, self._weights[p].master) for p in present]
        transfer = self.backend.start_to_host(pairs)
        self.moved_bytes += sum(self._weights[p].nbytes for p in present)
        # The compute stream waits for the copies back before the memory goes.
        self.backend.release(transfer)
        self.free(present)

    def step_ended(self) -> None:
        """A step ended: what moved since the last one is its figure."""
        self.moved_last_step, self.moved_bytes = self.moved_bytes, 0

    def masters(self) -> tuple[torch.Tensor, ...]:
        """The masters, in host memory (memory accounting)."""
        return tuple(w.master for w in self._weights.values())

    def device_tensors(self) -> tuple[torch.Tensor, ...]:
        """The device tensors, whose memory is allocated and given up by resizing their
        storages in place (memory accounting: a storage's size now is what it holds)."""
        return tuple(w.device for w in self._weights.values())

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
            size = sum(w.nbytes for w in self._weights.values())
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
