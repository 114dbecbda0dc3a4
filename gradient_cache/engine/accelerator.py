"""The accelerator backend: encode on a side stream, copy into pinned slots on another.

One code path for torch's current accelerator (CUDA, XPU, a PrivateUse1 device) through
`torch.Stream` and `torch.Event`. At most ``staging_depth`` buckets are between launch and
a known-finished copy: the bound on the device memory the copies hold. Streams and events
come from a `StreamApi`, so tests/test_stream_order.py runs this code with stand-ins. Each
wait and what it guarantees: docs/ARCHITECTURE.md, "Streams and events".
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..codecs import Payload
from .backend import Backend, Copies, Encoded, Grads, Param, Restore, Transfer
from .pool import HostPool
from .residuals import DeviceResiduals, HostSlotResiduals
from .route import Route


class StreamApi(Protocol):
    """`TorchStreams`, or tests/stream_checker.py's stand-in (typed as the torch classes it
    imitates)."""

    def new_stream(self, device: torch.device) -> torch.Stream: ...

    def new_event(self, device: torch.device) -> torch.Event: ...

    def current_stream(self, device: torch.device) -> torch.Stream: ...


class TorchStreams:
    """`StreamApi` on torch's device-generic streams (``device``: the accelerator's)."""

    def new_stream(self, device: torch.device) -> torch.Stream:
        return torch.Stream(device=device)

    def new_event(self, device: torch.device) -> torch.Event:
        # Timing off, non-blocking synchronize: as torch.cuda.Event's defaults.
        return torch.Event(device=device)

    def current_stream(self, device: torch.device) -> torch.Stream:
        return torch.accelerator.current_stream(device)


TORCH_STREAMS = TorchStreams()


@dataclass
class Landing:
    """A bucket's copies in flight: their event, and the device tensors they read."""

    copied: torch.Event  # recorded on the copy stream after the bucket's copies
    tensors: list[torch.Tensor]  # kept alive until it is known safe


class AcceleratorBackend(Backend):
    """Overlaps encoding and device-to-host copies with backward on one accelerator device."""

    restore_ahead = 1
    host_slabs_round_up = True  # the caching host allocator rounds pinned blocks up
    default_selection = "exact"  # torch.topk needs no host sync; the threshold's count does

    def __init__(
        self,
        device: torch.device,
        pool: HostPool[Param],
        *,
        staging_depth: int,
        host_residuals: bool,
        keep_previous_residual: bool,
        streams: StreamApi,
        record_gradients: bool = False,
    ) -> None:
        """``host_residuals``: in the pool's slots, else on the device. ``record_gradients``:
        a gradient may come from another stream than the hook's (FSDP2: see `store`)."""
        self.device = device
        self.pool = pool
        self.staging_depth = staging_depth
        self.streams = streams
        # Persistent: streams made per step would cost more than the work.
        self.encode_stream = streams.new_stream(device)
        self.copy_stream = streams.new_stream(device)
        self.restore_stream = streams.new_stream(device)
        self.record_gradients = record_gradients
        # Tensor.record_stream, or the stand-in's (which tells its checker).
        self.record_stream: Callable[[torch.Tensor, Any], None] = getattr(
            streams, "record_stream", torch.Tensor.record_stream
        )
        # A storage's resize_, or the stand-in's (which tells its checker). Neither holds
        # the backend, nor does the residual store below: no cycle keeps the model alive.
        self._resize_storage: Callable[[torch.Tensor, int], None] = getattr(
            streams, "resize_storage", _resize_storage
        )
        keep = keep_previous_residual
        backend = weakref.proxy(self)
        self.residuals = (
            HostSlotResiduals(
                lambda: backend.pool, lambda host: backend.to_device(host), keep_previous=keep
            )
            if host_residuals
            else DeviceResiduals(device, keep_previous=keep)
        )
        self._in_flight: deque[Landing] = deque()
        # The `copied` event of the last copy into each slot not yet waited for by the host.
        self._unwaited: dict[Param, torch.Event] = {}
        # The last copy of optimizer state each way not yet waited for by the host.
        self._unwaited_state: dict[str, torch.Event] = {}

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        # An explicit H2D copy on the current stream, into a block allocated for it.
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        return out.copy_(tensor, non_blocking=self.pool.is_pinned(tensor))

    @contextlib.contextmanager
    def encoding(self, params: Sequence[Param]) -> Iterator[None]:
        compute = self.streams.current_stream(self.device)
        retired = None
        if len(self._in_flight) >= self.staging_depth:
            retired = self._in_flight.popleft()
            # Guarantees compute-stream work queued from now on (which may reuse the
            # retired bucket's freed gradients) starts after its copy has read them.
            compute.wait_event(retired.copied)
        # Guarantees the encode reads gradients only after backward has written them, and
        # (through the wait above) reuses the retired bucket's blocks only after its copy.
        self.encode_stream.wait_stream(compute)
        if retired is not None:
            retired.tensors.clear()  # safe now: both allocating streams are past the copy
        for copied in {id(e): e for p in params if (e := self._unwaited.get(p))}.values():
            # Guarantees the encode reads a slot (an accumulated payload, a host residual)
            # only after the copy that wrote it, which the host has not waited for.
            self.encode_stream.wait_event(copied)
        with torch.profiler.record_function("gradient_cache.encode"), self.encode_stream:
            yield

    def store(self, encoded: list[Encoded], grads: list[torch.Tensor]) -> dict[Param, Payload]:
        encoded_event = self.streams.new_event(self.device)
        encoded_event.record(self.encode_stream)
        # Guarantees the copy reads payloads only after the encode stream wrote them.
        self.copy_stream.wait_event(encoded_event)
        kept: list[torch.Tensor] = list(grads)
        if self.record_gradients:
            # Under HSDP the hook's stream is not the one that allocated the gradient, so
            # the retirement wait does not order it. Guarantees the allocator hands its
            # block back only after the encode and the copy that read it.
            for grad in grads:
                self.record_stream(grad, self.encode_stream)
                self.record_stream(grad, self.copy_stream)
        payloads: dict[Param, Payload] = {}
        with torch.profiler.record_function("gradient_cache.copy"), self.copy_stream:
            for item in encoded:
                slot = self.pool.slots[item.param]
                tensors = item.payload.tensors()
                hosts = []
                for tensor, (region, offset) in zip(tensors, item.payload.placement(), strict=True):
                    host = slot.region_for(region, tensor, offset)
                    # An earlier micro-batch's part is there already (`Payload.followed_by`).
                    there = tensor.data_ptr() == host.data_ptr()
                    hosts.append(host if there else self._to_host(host, tensor))
                payloads[item.param] = item.payload.with_tensors(hosts)
                # Its device tensors, and the residual a `write` drops (allocated on compute):
                # kept until the retirement wait orders compute after the encode that read them.
                kept += [*tensors, *item.reads]
                if item.residual is not None:
                    self.residuals.write(item.param, item.residual, non_blocking=True)
                    kept.append(item.residual)
        copied = self.streams.new_event(self.device)
        copied.record(self.copy_stream)
        for item in encoded:
            self._unwaited[item.param] = copied
        self._in_flight.append(Landing(copied, kept))
        return payloads

    def host_pool(self) -> HostPool[Param]:
        return self.pool

    def _to_host(self, host: torch.Tensor, device: torch.Tensor) -> torch.Tensor:
        """``device`` into ``host`` on the current stream; blocking into a pageable slab."""
        return host.copy_(device, non_blocking=self.pool.is_pinned(host))

    def drain(self) -> None:
        while self._in_flight:
            landing = self._in_flight.popleft()
            landing.copied.synchronize()  # a non-blocking D2H copy is readable only after this
            landing.tensors.clear()
        self._unwaited.clear()

    def follow_routes(self, routes: Mapping[Param, Route]) -> None:
        """Cut the steady slots from the pool's slabs at the warm-up's end (`HostPool.relaid`).
        Slots shrink in place, so the next copy into one follows its restores as at any step
        (copy <- encode <- compute <- restore)."""
        super().follow_routes(routes)
        layout = {param: route.slot for param, route in routes.items()}
        if layout != self.pool.layout:
            # Guarantees no copy still writes a slot, nor an encode reads a host residual,
            # when the host zeroes the residual slots (the restores never read those).
            self.drain()
            self.pool = self.pool.relaid(layout)

    def start_restore(
        self, items: list[tuple[Param, Payload]], *, clip_factor: torch.Tensor | None
    ) -> Restore:
        compute = self.streams.current_stream(self.device)
        # Allocated for the compute stream, which reads and frees them, as any gradient.
        routes = [self.routes[p] for p, _ in items]
        outs = [torch.empty(r.numel, dtype=r.dtype, device=self.device) for r in routes]
        # Guarantees the restore writes these blocks (and reads ``clip_factor``) only after the
        # compute-stream work queued so far, which may have used the blocks before.
        self.restore_stream.wait_stream(compute)
        with self.restore_stream:
            for (_, payload), out in zip(items, outs, strict=True):
                payload.restore_into(out, self.to_device)  # H2D, then decoded on the device
                if clip_factor is not None:
                    out.mul_(clip_factor)
        done = self.streams.new_event(self.device)
        done.record(self.restore_stream)
        grads = [(p, r.shaped(out)) for (p, _), r, out in zip(items, routes, outs, strict=True)]
        return Restore(grads, done)

    def finish_restore(self, restore: Restore) -> Grads:
        # Guarantees work queued next on the current stream (the optimizer; or the free of
        # an abandoned restore's blocks) starts after the restore stream wrote them.
        assert restore.done is not None  # every restore and copy here records one
        self.streams.current_stream(self.device).wait_event(restore.done)
        return restore.grads

    # --- an optimizer's state between host and device ----------------------------------

    def host_slab(self, nbytes: int) -> torch.Tensor:
        return self.pool.allocate_slab(nbytes)  # pinned where it can be, as the pool's slabs

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        # On the compute stream: the allocator reuses a freed block in its order, so other
        # streams' accesses must be ordered before the free (`HostWeights.free`, `store`).
        self._resize_storage(tensor, nbytes)

    def start_refill(self, pairs: Copies, *, casts: Copies = ()) -> Transfer:
        compute = self.streams.current_stream(self.device)
        # Guarantees the copies write the device blocks only after the compute stream's
        # earlier use of them, and read the host copies only after the copies back that
        # wrote them (compute waited on each: `release`), though the host did not wait.
        self.restore_stream.wait_stream(compute)
        with self.restore_stream:
            for out, host in pairs:
                out.copy_(host, non_blocking=self.pool.is_pinned(host))
            for out, copied in casts:  # after their copies, in this stream's order
                out.copy_(copied)
        done = self.streams.new_event(self.device)
        done.record(self.restore_stream)
        self._unwaited_state["to the device"] = done
        return Transfer([out for out, _ in pairs] + [out for out, _ in casts], done)

    def abandon_refills(self) -> None:
        # Guarantees the caller's frees of the blocks, queued next on the compute stream,
        # come after every copy queued to them (an interrupt part-way, or as it returned).
        self.streams.current_stream(self.device).wait_stream(self.restore_stream)

    def finish_to_device(self, transfer: Transfer) -> list[torch.Tensor]:
        # Guarantees the step, queued next on the current stream, reads and updates the
        # state only after the restore stream wrote it.
        assert transfer.done is not None  # every restore and copy here records one
        self.streams.current_stream(self.device).wait_event(transfer.done)
        return transfer.tensors

    def start_to_host(self, pairs: Copies) -> Transfer:
        # Guarantees the copies read the state only after the step updated it, and overwrite
        # the host copies only after the copies to the device read them (`finish_to_device`).
        self.copy_stream.wait_stream(self.streams.current_stream(self.device))
        with self.copy_stream:
            for device, host in pairs:
                self._to_host(host, device)
        done = self.streams.new_event(self.device)
        done.record(self.copy_stream)
        self._unwaited_state["to the host"] = done
        return Transfer([device for device, _ in pairs], done)

    def release(self, transfer: Transfer) -> None:
        # Guarantees compute-stream work queued from now on (which may reuse the device
        # copies' freed blocks) starts after the copies back have read them.
        assert transfer.done is not None  # every restore and copy here records one
        self.streams.current_stream(self.device).wait_event(transfer.done)
        transfer.tensors.clear()

    def let_read(self, stream: Any, refills: Sequence[Transfer] = ()) -> None:
        # Guarantees work queued on ``stream`` (FSDP2's all-gather copy-in) reads the
        # refilled shards only after their copies; on their events alone, so the all-gather
        # overlaps the forward before it. Without refills, on the compute stream, which
        # waited for them (`finish_to_device`).
        events = [refill.done for refill in refills if refill.done is not None]
        if not events:
            stream.wait_stream(self.streams.current_stream(self.device))
        for event in events:
            stream.wait_event(event)

    def join(self, stream: Any) -> None:
        # Guarantees a block given back next (a shard) is reused only after ``stream``'s work
        # so far read it (FSDP2's copy-in of an all-gather it has not waited for).
        self.streams.current_stream(self.device).wait_stream(stream)

    def wait_for_state_copies(self) -> None:
        # Each stream's copies complete in order: its last event covers the ones before.
        for done in self._unwaited_state.values():
            # A non-blocking D2H copy is readable on the host only after this; and a host
            # copy is rewritten by the host only after the H2D copies reading it.
            done.synchronize()
        self._unwaited_state.clear()


def allocate_pinned(nbytes: int) -> torch.Tensor:
    """A pinned host slab (for CUDA where present, else the current accelerator); the
    caller falls back to pageable memory if this raises."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    tensor.untyped_storage().resize_(nbytes)
