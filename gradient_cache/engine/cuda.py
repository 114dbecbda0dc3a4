"""The CUDA backend: encode on a side stream, copy into pinned slots on another.

Per bucket, while backward keeps the compute stream busy (docs/ARCHITECTURE.md has the
whole picture and the reasons):

    compute ──(wait_stream)──► encode stream: top-k / identity, + residual
    encode  ──(event `encoded`)──► copy stream: D2H into each parameter's pinned slot
    copy    ──(event `copied`)──► host: `wait()` synchronizes, the one host wait

At most ``staging_depth`` buckets are between launch and a known-finished copy: launching
one more makes the compute stream wait on the oldest bucket's `copied` event, then drops
that bucket's device tensors. The caching allocator reuses a freed block on the host's
say-so, so only this host-side bound limits device memory. Under FSDP2 a gradient may come
from another stream than the hook's: `record_stream` then covers it (see `store`).

Restores run on a restore stream into blocks allocated on the compute stream:

    compute ──(wait_stream)──► restore stream: H2D + decode (+ clip scale)
    restore ──(event `done`)──► compute: the optimizer reads the gradients

`torch.cuda` is reached through ``cuda`` (and pinned memory through ``allocate_pinned``),
so tests/test_stream_order.py can run this very code on CPU tensors with stand-in
streams and events and check every ordering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections import deque
from collections.abc import Iterator, Sequence

import torch

from ..compression import (
    DensePayload,
    Payload,
    QuantizedPayload,
    SparsePayload,
    fill_from,
    moved,
    payload_tensors,
)
from .backend import Backend, Encoded, Restore
from .bucket import Bucket, Items
from .pool import HostPool, Slot
from .sharding import local_numel, local_shape


class CudaBackend(Backend):
    """Overlaps encoding and device-to-host copies with backward on one CUDA device."""

    restore_ahead = 1
    default_selection = "exact"  # torch.topk needs no host sync; the threshold's count does

    def __init__(
        self,
        device: torch.device,
        pool: HostPool,
        *,
        staging_depth: int,
        cuda: types.ModuleType | object = torch.cuda,
        record_gradients: bool = False,
    ) -> None:
        """``record_gradients``: the gradients may have been allocated on another stream
        than the one current in the hook (FSDP2: see `store`)."""
        self.device = device
        self.pool = pool
        self.staging_depth = staging_depth
        self.cuda = cuda
        # Persistent streams: creating streams per step would cost more than the work.
        self.encode_stream = cuda.Stream(device=device)
        self.copy_stream = cuda.Stream(device=device)
        self.restore_stream = cuda.Stream(device=device)
        self.record_gradients = record_gradients
        # Tensor.record_stream, or the stand-in's (which tells its checker).
        self.record_stream = getattr(cuda, "record_stream", torch.Tensor.record_stream)
        self._in_flight: deque[Bucket] = deque()
        # The `copied` event of the last copy into each slot not yet waited for by the host.
        self._unwaited: dict[torch.nn.Parameter, object] = {}

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        # An explicit H2D copy on the current stream, into a block allocated for it.
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        return out.copy_(tensor, non_blocking=self.pool.pinned)

    def host_residuals(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        return {p: s.residual for p, s in self.pool.slots.items() if s.residual is not None}

    def pending_host_residual(self, param: torch.nn.Parameter) -> torch.Tensor:
        slot = self.pool.slots[param]
        return slot.residual if slot.spare_residual is None else slot.spare_residual

    def commit_host_residual(self, param: torch.nn.Parameter) -> torch.Tensor:
        # Runs after the restore of ``param``, so after `wait()`: no copy is writing
        # either slot, and the old one is rewritten only by a later step's copy.
        slot = self.pool.slots[param]
        if slot.spare_residual is not None:
            slot.residual, slot.spare_residual = slot.spare_residual, slot.residual
        return slot.residual

    @contextlib.contextmanager
    def encoding(self, reads_host: Sequence[torch.nn.Parameter]) -> Iterator[None]:
        compute = self.cuda.current_stream(self.device)
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
            retired.device_tensors = []  # safe now: both allocating streams are past the copy
        for copied in {id(e): e for p in reads_host if (e := self._unwaited.get(p))}.values():
            # Guarantees the encode reads a slot (an accumulated payload, a host residual)
            # only after the copy that wrote it, which the host has not waited for.
            self.encode_stream.wait_event(copied)
        with (
            torch.profiler.record_function("gradient_cache.encode"),
            self.cuda.stream(self.encode_stream),
        ):
            yield

    def store(self, bucket: Bucket, encoded: list[Encoded], grads: list[torch.Tensor]) -> None:
        encoded_event = self.cuda.Event()
        encoded_event.record(self.encode_stream)
        # Guarantees the copy reads payloads only after the encode stream wrote them.
        self.copy_stream.wait_event(encoded_event)
        kept: list[torch.Tensor] = list(grads)
        if self.record_gradients:
            # FSDP2 runs the hooks on its post-reduce stream; under HSDP that is the
            # all-reduce stream, while the gradient was allocated on the reduce-scatter
            # stream, which the retirement wait in `encoding` (on the current stream) does
            # not order. Guarantees the allocator hands a gradient's block to its stream
            # again only after the encode and the copy that read it.
            for grad in grads:
                self.record_stream(grad, self.encode_stream)
                self.record_stream(grad, self.copy_stream)
        with (
            torch.profiler.record_function("gradient_cache.copy"),
            self.cuda.stream(self.copy_stream),
        ):
            for item in encoded:
                slot = self.pool.slots[item.param]
                bucket.payloads[item.param] = self._copy_payload(item.payload, slot)
                kept += payload_tensors(item.payload)
                if slot.residual is not None and item.residual is not None:
                    target = self.pending_host_residual(item.param)
                    target.copy_(item.residual, non_blocking=self.pool.pinned)
                    kept.append(item.residual)
        copied = self.cuda.Event()
        copied.record(self.copy_stream)
        bucket.copied = copied
        bucket.device_tensors = kept
        for item in encoded:
            self._unwaited[item.param] = copied
        self._in_flight.append(bucket)

    def _copy_payload(self, payload: Payload, slot: Slot) -> Payload:
        """Issue the D2H copies of ``payload`` into ``slot`` on the current (copy) stream."""
        pinned = self.pool.pinned  # pageable memory: the copy blocks the host
        if isinstance(payload, DensePayload):
            return DensePayload(slot.values.copy_(payload.tensor, non_blocking=pinned))
        if isinstance(payload, QuantizedPayload):
            region = slot.values.view(torch.uint8)[: payload.packed.numel()]
            packed = region.copy_(payload.packed, non_blocking=pinned)
            indices = payload.indices
            if indices is not None:
                indices = slot.indices[: payload.count].copy_(indices, non_blocking=pinned)
            return dataclasses.replace(payload, packed=packed, indices=indices)
        kept = payload.values.numel()  # exact selection: always the slot's size
        values = slot.values[:kept].copy_(payload.values, non_blocking=pinned)
        indices = slot.indices[:kept].copy_(payload.indices, non_blocking=pinned)
        return SparsePayload(values, indices, payload.numel)

    def wait(self) -> None:
        while self._in_flight:
            bucket = self._in_flight.popleft()
            bucket.copied.synchronize()  # a non-blocking D2H copy is readable only after this
            bucket.device_tensors = []
        self._unwaited.clear()

    def end_warmup(self) -> None:
        """Shrink the pool once warm-up steps (dense payloads) are over.

        The old slab is freed once no payload views it, while restores may still copy
        from it: the caching host allocator keeps a pinned block that non-blocking
        copies read from reuse until their streams have passed those copies.
        """
        if self.pool.warmup_sized:
            self.wait()
            self.pool = self.pool.without_warmup_room()

    def start_restore(self, items: Items, *, scale: torch.Tensor | None) -> Restore:
        compute = self.cuda.current_stream(self.device)
        # Allocated for the compute stream, which reads and frees them: the allocator then
        # reuses their blocks in compute-stream order, as for any gradient.
        outs = [torch.empty(local_numel(p), dtype=p.dtype, device=self.device) for p, _ in items]
        # Guarantees the restore writes these blocks (and reads ``scale``) only after the
        # compute-stream work queued so far, which may have used the blocks before.
        self.restore_stream.wait_stream(compute)
        with self.cuda.stream(self.restore_stream):
            for (_, payload), out in zip(items, outs, strict=True):
                # A dense payload's copy moves it; any other is moved, then decoded.
                dense = isinstance(payload, DensePayload)
                fill_from(payload if dense else moved(payload, self.to_device), out)
                if scale is not None:
                    out.mul_(scale)
        done = self.cuda.Event()
        done.record(self.restore_stream)
        grads = [(p, out.view(local_shape(p))) for (p, _), out in zip(items, outs, strict=True)]
        return Restore(grads, done)

    def finish_restore(self, restore: Restore) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        # Guarantees work queued next on the current stream (the optimizer; or the free of
        # an abandoned restore's blocks) starts after the restore stream wrote them.
        self.cuda.current_stream(self.device).wait_event(restore.done)
        return restore.grads


def allocate_pinned(nbytes: int) -> torch.Tensor:
    """A pinned host slab (the caller falls back to pageable memory if this raises)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
