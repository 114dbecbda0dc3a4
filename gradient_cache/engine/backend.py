"""What a backend does for the pipeline, and the CPU backend.

The pipeline decides what happens to a bucket; the backend, where and when: the encode's
place (`encoding`), host memory (`store`), the one host wait (`drain`), and the way back
(`start_restore`, then `finish_restore` before anything reads the gradients).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..codecs import Payload
from .pool import HostPool
from .residuals import DeviceResiduals, ResidualStore
from .route import Route

Param = torch.nn.Parameter
Grads = list[tuple[Param, torch.Tensor]]
Copies = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (device tensor, host or source) pairs


@dataclass
class Encoded:
    """One parameter's encoded gradient, still on the device, and its new residual."""

    param: Param
    payload: Payload
    residual: torch.Tensor | None
    # Device tensors the encode read besides the gradient (the residual it started from):
    # queued kernels may still read them after the residual store lets them go.
    reads: tuple[torch.Tensor, ...] = ()


@dataclass
class Restore:
    """Gradients on their way back; `Backend.finish_restore` makes them safe to read."""

    grads: Grads
    done: torch.Event | None = None  # the gradients are written


@dataclass
class Transfer:
    """Device tensors copied to or from the host, kept until ``done`` (None: copied at once)."""

    tensors: list[torch.Tensor]
    done: torch.Event | None = None


class Backend(ABC):
    """Runs a bucket's encode, keeps its payloads in host memory and restores them."""

    device: torch.device
    residuals: ResidualStore
    #: Each parameter's route at the current step (`follow_routes`): what a restore gives.
    routes: Mapping[Param, Route]
    #: Buckets the fused step restores ahead while the optimizer steps the current one.
    restore_ahead: int = 0
    #: Top-k selection for ``selection="auto"``.
    default_selection: str = "threshold"
    #: Whether `host_slab` rounds up to a power of two (pinned memory: see `state_slabs`).
    host_slabs_round_up: bool = False

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a host payload's) where the encode or restore can read it."""
        return tensor

    @contextlib.contextmanager
    def encoding(self, params: Sequence[Param]) -> Iterator[None]:
        """Where the encode of ``params``' gradients runs (it may read their host slots)."""
        yield

    @abstractmethod
    def store(self, encoded: list[Encoded], grads: list[torch.Tensor]) -> dict[Param, Payload]:
        """Put ``encoded`` payloads in host memory and their residuals in `residuals`;
        return the host payloads. ``grads`` are the device gradients the encode read; a
        backend that reads them later keeps them alive."""

    def follow_routes(self, routes: Mapping[Param, Route]) -> None:
        """The routes from now on; a backend with host memory sized by them re-lays it."""
        self.routes = routes

    def host_pool(self) -> HostPool[Param] | None:
        """Its pinned pool of payload slots, if it has one."""
        return None

    def drain(self) -> None:  # noqa: B027 - nothing to wait for where host memory is the device's
        """Block until every stored payload is complete in host memory."""

    @abstractmethod
    def start_restore(
        self, items: list[tuple[Param, Payload]], *, clip_factor: torch.Tensor | None
    ) -> Restore:
        """Start bringing ``items`` back as dense gradients (times ``clip_factor``, if given)."""

    def finish_restore(self, restore: Restore) -> Grads:
        """The gradients, safe for work queued from now on to read."""
        return restore.grads

    # --- an optimizer's state between host and device (`optimizer_state`) ---------------

    def host_slab(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory (uint8) for optimizer state (`StateSlabs` cuts them)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def start_to_device(self, hosts: list[torch.Tensor]) -> Transfer:
        """Start copying ``hosts`` into new device tensors of their strides (as on a GPU:
        the accounting counts them as device memory), for the compute stream to free."""
        outs = [
            torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=self.device)
            for h in hosts
        ]
        try:
            return self.start_refill(list(zip(outs, hosts, strict=True)))
        except BaseException:  # an interrupt part-way: ``outs`` freed after their copies
            self.abandon_refills()
            raise

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        """``tensor``'s memory allocated (``nbytes``) or given up (0), on the current
        stream; the storage object, which autograd's saved views share, stays."""
        tensor.untyped_storage().resize_(nbytes)

    def start_refill(self, pairs: Copies, *, casts: Copies = ()) -> Transfer:
        """Start copying each (device, host) pair into its device tensor (allocated by the
        caller on the current stream), then each (device, copied) cast (another dtype: a
        shard widened from its wire). The device tensors live as long as the `Transfer`."""
        copies = [*pairs, *casts]  # the casts after the copies they read
        for device, source in copies:
            device.copy_(source)
        return Transfer([device for device, _ in copies])

    def abandon_refills(self) -> None:  # noqa: B027 - on the CPU the copies are done at once
        """Order work queued from now on (the frees of a refill that failed part-way, or
        whose `Transfer` never reached its caller) after every refill's copies so far."""

    def finish_to_device(self, transfer: Transfer) -> list[torch.Tensor]:
        """The device tensors, safe for work queued from now on to read and write."""
        return transfer.tensors

    def start_to_host(self, pairs: Copies) -> Transfer:
        """Start copying each (device, host) pair's device tensor into its host one."""
        for device, host in pairs:
            host.copy_(device)
        return Transfer([])

    def release(self, transfer: Transfer) -> None:
        """Let ``transfer``'s device tensors go, safely for the copies that read them."""
        transfer.tensors.clear()

    def let_read(  # noqa: B027 - on the CPU work runs in order
        self, stream: Any, refills: Sequence[Transfer] = ()
    ) -> None:
        """Order ``stream`` (FSDP2's all-gather copy-in) after ``refills``, or without them
        after the compute stream, which waited for them (`finish_to_device`)."""

    def join(self, stream: Any) -> None:  # noqa: B027 - on the CPU work runs in order
        """Order the compute stream's work from now on (a block given back, then reused)
        after ``stream``'s work so far (FSDP2's copy-in reading a shard)."""

    def wait_for_state_copies(self) -> None:  # noqa: B027 - the CPU's copies are done at once
        """Block until every copy `start_to_device` and `start_to_host` started is complete."""


class CpuBackend(Backend):
    """Encodes in the hook, where the gradients are: a lossless payload is the gradient."""

    def __init__(self, device: torch.device, *, keep_previous_residual: bool) -> None:
        self.device = device
        self.residuals = DeviceResiduals(device, keep_previous=keep_previous_residual)

    def store(self, encoded: list[Encoded], grads: list[torch.Tensor]) -> dict[Param, Payload]:
        for item in encoded:
            if item.residual is not None:
                self.residuals.write(item.param, item.residual, non_blocking=False)
        return {item.param: item.payload for item in encoded}

    def start_restore(
        self, items: list[tuple[Param, Payload]], *, clip_factor: torch.Tensor | None
    ) -> Restore:
        grads = []
        for param, payload in items:
            route = self.routes[param]
            whole = payload.as_gradient()
            if whole is not None:  # lossless: the gradient itself, no copy (but a widening)
                grad = whole.to(route.dtype)
            else:
                grad = payload.decode_into(
                    torch.empty(route.numel, dtype=route.dtype, device=self.device)
                )
            if clip_factor is not None:
                # In place on a decoded tensor only: a retried step reads the payload again.
                grad = grad * clip_factor if whole is not None else grad.mul_(clip_factor)
            grads.append((param, route.shaped(grad)))
        return Restore(grads)
