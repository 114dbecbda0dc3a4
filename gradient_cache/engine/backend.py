"""What a backend does for the pipeline, and the CPU backend.

The pipeline decides what happens to a bucket; the backend decides where and when: it
gives the encode a place to run (`encoding`), puts the encoded payloads in host memory
(`store`), waits for them (`wait`, the one host wait), and brings them back
(`start_restore`, then `finish_restore` before anything reads the gradients).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..compression import DensePayload, Payload, fill_from
from .bucket import Bucket, Items
from .sharding import local_numel, local_shape


@dataclass
class Encoded:
    """One parameter's encoded gradient, still on the device, and its new residual."""

    param: torch.nn.Parameter
    payload: Payload
    residual: torch.Tensor | None


@dataclass
class Restore:
    """Gradients on their way back; `Backend.finish_restore` makes them safe to read."""

    grads: list[tuple[torch.nn.Parameter, torch.Tensor]]
    done: Any = None  # the backend's event: the gradients are written


def scaled(grad: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``grad * scale``, out of place: a payload a retried step reads again stays as it was."""
    return grad if scale is None else grad * scale.to(grad.device)


class Backend(ABC):
    """Runs a bucket's encode, keeps its payloads in host memory and restores them."""

    device: torch.device
    #: Buckets the fused step restores ahead while the optimizer steps the current one.
    restore_ahead: int = 0
    #: Top-k selection for ``selection="auto"``.
    default_selection: str = "threshold"

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a host payload or residual) where the encode or restore can read it."""
        return tensor

    def host_residuals(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Error-feedback residuals that live in this backend's host memory, as of the
        last completed step; `store` writes a pending step's new ones to a spare slot."""
        return {}

    def pending_host_residual(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Where `store` writes ``param``'s new residual: the spare slot, or the current
        one without ``keep_previous_residual`` (host residuals only)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no residual in host memory")

    def commit_host_residual(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Make the spare slot ``param``'s current residual; return it (host residuals only)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no residual in host memory")

    @contextlib.contextmanager
    def encoding(self, reads_host: Sequence[torch.nn.Parameter]) -> Iterator[None]:
        """Where a bucket's encode runs; ``reads_host``: parameters whose host slot it reads."""
        yield

    @abstractmethod
    def store(self, bucket: Bucket, encoded: list[Encoded], grads: list[torch.Tensor]) -> None:
        """Put ``encoded`` payloads (and host residuals) in host memory, filling ``bucket``.

        ``grads`` are the device gradients the encode read; a backend that reads them
        later keeps them alive.
        """

    def end_warmup(self) -> None:  # noqa: B027 - only a pool sized for warm-up shrinks
        """Release host memory kept for warm-up steps' dense payloads (nothing is cached)."""

    def wait(self) -> None:  # noqa: B027 - nothing to wait for where host memory is the device's
        """Block until every stored bucket's payloads are complete in host memory."""

    @abstractmethod
    def start_restore(self, items: Items, *, scale: torch.Tensor | None) -> Restore:
        """Start bringing ``items`` back as dense gradients (times ``scale``, if given)."""

    def finish_restore(self, restore: Restore) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The gradients, safe for work queued from now on to read."""
        return restore.grads

    def close(self) -> None:
        """Wait for work in flight; the backend is not used afterwards."""
        self.wait()


class CpuBackend(Backend):
    """Encodes in the backward hook itself; host memory is where the gradients already are.

    A lossless payload is the gradient tensor itself, and so is the restored gradient:
    nothing is copied.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def store(self, bucket: Bucket, encoded: list[Encoded], grads: list[torch.Tensor]) -> None:
        for item in encoded:
            bucket.payloads[item.param] = item.payload

    def start_restore(self, items: Items, *, scale: torch.Tensor | None) -> Restore:
        grads = []
        for param, payload in items:
            if isinstance(payload, DensePayload):
                grad = scaled(payload.tensor.view(local_shape(param)), scale)
            else:
                dense = torch.empty(local_numel(param), dtype=param.dtype, device=self.device)
                grad = fill_from(payload, dense).view(local_shape(param))
                if scale is not None:
                    grad.mul_(scale)  # a fresh tensor: scaling in place costs no copy
            grads.append((param, grad))
        return Restore(grads)
