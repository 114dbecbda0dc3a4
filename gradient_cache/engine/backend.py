"""Where and when buckets are encoded, and how payloads reach the host.

The pipeline hands a backend a unit of work (encode one bucket, returning device-side
payloads); the backend runs it, moves the payloads to host memory and delivers them to
the store, at once or later. `wait()` returns only when every launched bucket has been
delivered. The pipeline never touches streams, threads or copies itself.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..compression import DensePayload, Payload, SparsePayload, fill_from
from .config import EngineConfig

Delivery = list[tuple[torch.nn.Parameter, Payload]]
Work = Callable[[], Delivery]
Deliver = Callable[[torch.nn.Parameter, Payload], None]


@dataclass
class Restoring:
    """One bucket on its way back to the device; `Backend.ready` hands out its gradients."""

    items: Delivery
    scale: torch.Tensor | None
    grads: list[tuple[torch.nn.Parameter, torch.Tensor]] | None = None  # once started
    done: Any = None  # the backend's completion marker (a CUDA event), if any


def payload_to_host(payload: Payload) -> Payload:
    """Synchronous copy to host memory; a no-op for CPU tensors."""
    if isinstance(payload, DensePayload):
        return DensePayload(payload.tensor.cpu())
    return SparsePayload(payload.values.cpu(), payload.indices.cpu(), payload.numel)


class Backend(ABC):
    """Runs encode work and delivers host payloads to the store."""

    #: The device the backend's gradients live on.
    device: torch.device

    def __init__(self, deliver: Deliver) -> None:
        self._deliver = deliver

    @abstractmethod
    def launch(self, grads: Sequence[torch.Tensor], work: Work) -> None:
        """Start encoding one bucket; its payloads are delivered by the next `wait()`.

        ``grads`` are the device gradients ``work`` reads; the caller drops them after
        this call, so a backend that reads them later must keep them alive.
        """

    @abstractmethod
    def wait(self) -> None:
        """Block until every launched bucket is delivered; re-raise any encode error."""

    @abstractmethod
    def close(self) -> None:
        """Release threads, streams or pools; the backend is not used afterwards."""

    def restore(self, payload: Payload, param: torch.nn.Parameter) -> torch.Tensor:
        """A fresh dense gradient for ``param`` from ``payload``, on the parameter's device.

        Copies are issued on the current stream without blocking (from pinned memory they
        are asynchronous), so work queued after them on that stream sees the gradient.
        """
        if isinstance(payload, DensePayload):
            # On the CPU backend this is the gradient tensor itself: no copy at all.
            return payload.tensor.to(param.device, non_blocking=True).view_as(param)
        dense = torch.empty(param.numel(), dtype=param.dtype, device=param.device)
        return fill_from(payload, dense).view_as(param)

    def restore_ahead(self, items: Delivery, *, scale: torch.Tensor | None) -> Restoring:
        """Start restoring one bucket (times ``scale``, if given) for a later `ready()`.

        Here nothing starts: with no stream to overlap on, restoring early would only
        hold one more bucket in memory. The CUDA backend restores it on a side stream
        while the optimizer steps the bucket before.
        """
        return Restoring(items, scale)

    def ready(self, restoring: Restoring) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The bucket's gradients, safe for work queued from now on to read."""
        grads = []
        for param, payload in restoring.items:
            dense = self.restore(payload, param)
            grads.append((param, dense if restoring.scale is None else dense.mul_(restoring.scale)))
        return grads

    def restored(self) -> None:
        """Called when the store is empty: host memory holding payloads may be reused."""
        return None


class InlineBackend(Backend):
    """Encodes in the backward hook itself and copies to the host synchronously.

    Correct on any device. On the CPU the "host copy" is free (the payload already
    lives in host memory); on a GPU every copy blocks, which is what the stream-based
    CUDA backend is meant to avoid.
    """

    def __init__(self, deliver: Deliver, device: torch.device) -> None:
        super().__init__(deliver)
        self.device = device

    def launch(self, grads: Sequence[torch.Tensor], work: Work) -> None:
        for param, payload in work():
            self._deliver(param, payload_to_host(payload))

    def wait(self) -> None:
        return None  # launch() delivered everything already

    def close(self) -> None:
        return None  # holds nothing to release


class ThreadedCPUBackend(Backend):
    """Encodes buckets on one worker thread while backward goes on (CPU only).

    One thread and a FIFO queue: buckets are encoded and delivered in launch order, so
    accumulation into the store and error-feedback residuals see one writer. The main
    thread reads the store only after `wait()`, which joins the queue.
    """

    def __init__(self, deliver: Deliver) -> None:
        super().__init__(deliver)
        self.device = torch.device("cpu")
        self._queue: queue.Queue[Work | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gradient-cache-encode", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                if work is None:
                    return
                if self._error is None:
                    for param, payload in work():
                        self._deliver(param, payload)
            except BaseException as error:  # re-raised on the caller's thread by wait()
                self._error = error
            finally:
                self._queue.task_done()

    def launch(self, grads: Sequence[torch.Tensor], work: Work) -> None:
        self._queue.put(work)  # `work` holds the gradients until the worker is done

    def wait(self) -> None:
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                "gradient-cache failed to encode a gradient bucket on its worker thread; "
                "the gradients of that bucket and of later ones in the step were not kept."
            ) from error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def parameter_device(params: Sequence[torch.nn.Parameter]) -> torch.device:
    """The one device all ``params`` live on, or a ValueError naming them all."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) != 1:
        raise ValueError(
            f"The cached parameters live on several devices {devices}; one manager serves "
            "one device. Create one manager per device, or list the other device's layers "
            "in exclude_layers."
        )
    return torch.device(devices[0])


def create_backend(
    params: Sequence[torch.nn.Parameter], config: EngineConfig, deliver: Deliver, *, ratio: float
) -> Backend:
    """Pick the backend for the parameters' device, honouring ``config.backend``."""
    device = parameter_device(params)
    if config.backend != "auto" and config.backend != device.type:
        raise ValueError(
            f"backend={config.backend!r} does not match the parameters' device {device}; "
            f"use backend='auto' or move the model to {config.backend}."
        )
    if device.type == "cuda":
        return _cuda_backend(params, config, deliver, device, ratio=ratio)
    if device.type == "cpu" and config.cpu_worker_thread:
        return ThreadedCPUBackend(deliver)
    return InlineBackend(deliver, device)


def _cuda_backend(
    params: Sequence[torch.nn.Parameter],
    config: EngineConfig,
    deliver: Deliver,
    device: torch.device,
    *,
    ratio: float,
) -> Backend:
    from .cuda import CudaBackend  # imports torch.cuda machinery only when needed
    from .pool import HostPool, estimate_host_bytes

    if config.error_feedback and config.residual_location == "host":
        raise ValueError(
            "error_feedback=True with residual_location='host' is not supported on the CUDA "
            "backend yet (the residual would cross PCIe densely twice a step). Use "
            "residual_location='device' (one fp32 copy of each compressed gradient on the "
            "device) or error_feedback=False."
        )
    if config.host_pool_mb is not None:
        capacity = int(config.host_pool_mb * 2**20)
    else:
        capacity = estimate_host_bytes(params, ratio=ratio, config=config, count_payloads=True)
    pool = HostPool(capacity, pin=config.pin_memory)
    return CudaBackend(deliver, device, staging_depth=config.staging_depth, pool=pool)
