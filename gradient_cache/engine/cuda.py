"""The CUDA backend: encode on a side stream, copy to pinned host memory on another.

Per bucket, while backward keeps the compute stream busy:

    compute stream ──(event: bucket's gradients written)──► encode stream: top-k / identity
    encode stream  ──(event: payload written)──────────────► copy stream: D2H into the pool
    copy stream    ──(event: copy done)────────────────────► host: payload may be read

At most ``staging_depth`` buckets sit between encode and a finished copy, which bounds the
device memory held by payloads in flight; `wait()` completes the rest. `apply()` restores
on the compute stream, so the optimizer, which runs there too, reads them in order. The
fused `step()` restores bucket i+1 on a restore stream while the optimizer steps bucket i:

    compute stream ──(wait: work queued so far)──► restore stream: H2D + decode of i+1
    restore stream ──(event: bucket i+1 written)──► compute stream: optimizer on i+1
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from ..compression import DensePayload, Payload, SparsePayload, fill_from
from .backend import Backend, Deliver, Delivery, Restoring, Work
from .pool import HostPool


class CudaBackend(Backend):
    """Overlaps encoding and device-to-host copies with backward on one CUDA device."""

    def __init__(
        self, deliver: Deliver, device: torch.device, *, staging_depth: int, pool: HostPool
    ) -> None:
        super().__init__(deliver)
        self.device = device
        self.pool = pool
        self.staging_depth = staging_depth
        # Persistent streams: creating streams per step would cost more than the work.
        self.encode_stream = torch.cuda.Stream(device=device)
        self.copy_stream = torch.cuda.Stream(device=device)
        # `step()` restores bucket i+1 here while the optimizer steps bucket i.
        self.restore_stream = torch.cuda.Stream(device=device)
        self._in_flight: deque[tuple[torch.cuda.Event, Delivery]] = deque()
        # Set to [] to record (encode start, encode end, copy start, copy end) per bucket;
        # perf/gpu_report.py does, to measure how much of this work backward hides.
        self.timings: list[tuple[torch.cuda.Event, ...]] | None = None

    def launch(self, grads: Sequence[torch.Tensor], work: Work) -> None:
        compute = torch.cuda.current_stream(self.device)
        # Guarantees the encode stream starts only after backward has written these grads.
        self.encode_stream.wait_stream(compute)
        timed = self.timings is not None
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if timed else []
        with torch.cuda.stream(self.encode_stream):
            if timed:
                marks[0].record()
            delivery = work()
            if timed:
                marks[1].record()
        for grad in grads:
            # The caching allocator may otherwise reuse a freed gradient's memory for the
            # compute stream while the encode stream is still reading it.
            grad.record_stream(self.encode_stream)
        encoded = torch.cuda.Event()
        encoded.record(self.encode_stream)

        while len(self._in_flight) >= self.staging_depth:
            self._complete_oldest()  # bounds the device memory held by payloads in flight
        # Guarantees the copy reads a payload only after the encode stream wrote it.
        self.copy_stream.wait_event(encoded)
        host_delivery: Delivery = []
        with torch.cuda.stream(self.copy_stream):
            if timed:
                marks[2].record()
            for param, payload in delivery:
                host_delivery.append((param, self._copy_to_host(payload)))
            if timed:
                marks[3].record()
                self.timings.append(tuple(marks))
        copied = torch.cuda.Event()
        copied.record(self.copy_stream)
        self._in_flight.append((copied, host_delivery))

    def _copy_to_host(self, payload: Payload) -> Payload:
        """Issue a non-blocking D2H copy of ``payload`` on the current (copy) stream."""
        if isinstance(payload, DensePayload):
            return DensePayload(self._host_copy(payload.tensor))
        return SparsePayload(
            self._host_copy(payload.values), self._host_copy(payload.indices), payload.numel
        )

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = self.pool.take(tensor.numel(), tensor.dtype)
        host.copy_(tensor, non_blocking=self.pool.pinned)
        # The device tensor is dropped after this call; keep its memory from the allocator
        # until the copy stream has read it.
        tensor.record_stream(self.copy_stream)
        return host

    def _complete_oldest(self) -> None:
        copied, delivery = self._in_flight.popleft()
        copied.synchronize()  # a non-blocking D2H copy is readable only after its event
        for param, payload in delivery:
            self._deliver(param, payload)

    def wait(self) -> None:
        while self._in_flight:
            self._complete_oldest()

    def restore(self, payload: Payload, param: torch.nn.Parameter) -> torch.Tensor:
        # Issued on the compute stream: H2D from pinned memory does not block the host, and
        # the optimizer, on the same stream, sees the gradient after the copy and decode.
        return super().restore(payload, param)

    def restore_ahead(self, items: Delivery, *, scale: torch.Tensor | None) -> Restoring:
        compute = torch.cuda.current_stream(self.device)
        # Allocated for the compute stream, which reads and frees them: the allocator then
        # reuses their memory in compute-stream order, as for any gradient.
        outs = [torch.empty(p.numel(), dtype=p.dtype, device=self.device) for p, _ in items]
        # Guarantees the restore stream writes these blocks only after the compute-stream
        # work queued so far (which may have used them before they were freed) is done.
        self.restore_stream.wait_stream(compute)
        with torch.cuda.stream(self.restore_stream):
            for (_, payload), out in zip(items, outs, strict=True):
                fill_from(payload, out)
                if scale is not None:
                    out.mul_(scale)
        restored = torch.cuda.Event()
        restored.record(self.restore_stream)
        grads = [(p, out.view_as(p)) for (p, _), out in zip(items, outs, strict=True)]
        return Restoring(items, scale, grads, restored)

    def ready(self, restoring: Restoring) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        # Guarantees the optimizer, queued next on the compute stream, reads the gradients
        # only after the restore stream has written them.
        torch.cuda.current_stream(self.device).wait_event(restoring.done)
        return restoring.grads

    def restored(self) -> None:
        """Every payload has been restored: the pool may be reused after those copies."""
        # Guarantees the event follows the H2D copies of both streams that read the pool.
        self.restore_stream.wait_stream(torch.cuda.current_stream(self.device))
        released = torch.cuda.Event()
        released.record(self.restore_stream)
        self.pool.reset(after=released)

    def close(self) -> None:
        self.wait()
