"""A bucket: gradients that leave the device together, from backward until their restore.

Life of a bucket (docs/ARCHITECTURE.md draws it with the streams and events):

1. assembling: the hooks collect ``(param, gradient)`` pairs until they hold
   ``bucket_size_mb`` (`BucketAssembler`), or until an FSDP2 group's last gradient is in
   (the pipeline flushes then); the gradients are still device tensors.
2. launched: the backend encodes them and copies the payloads into each parameter's
   host slot; `device_tensors` keeps what those copies read alive, and `copied` is the
   event after which the host payloads are complete.
3. cached: `payloads` holds each parameter's host payload, in arrival order.
4. restored: `apply_gradients()` or the fused step takes payloads out (`take`), all at
   once or one optimizer's parameters at a time; an empty bucket is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..compression import Payload

Item = tuple[torch.nn.Parameter, torch.Tensor]
Items = list[tuple[torch.nn.Parameter, Payload]]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Bucket:
    """Gradients offloaded together; see the module docstring for its life."""

    def __init__(self) -> None:
        self.payloads: dict[torch.nn.Parameter, Payload] = {}
        # Device tensors the copies still read; dropped only once that is known safe.
        self.device_tensors: list[torch.Tensor] = []
        self.copied: Any = None  # the backend's event: payloads complete in host memory

    def take(self, params: Iterable[torch.nn.Parameter]) -> Items:
        """Remove and return the payloads of ``params`` (all of them must be here)."""
        return [(param, self.payloads.pop(param)) for param in params]

    def __len__(self) -> int:
        return len(self.payloads)


class BucketAssembler:
    """Collects (parameter, gradient) pairs until they hold ``capacity_bytes``.

    Buckets follow each step's real backward order with no plan to keep in sync; a
    parameter that gets no gradient in a step never arrives. The drain flushes the rest.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._bytes = 0

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> list[Item] | None:
        """Add one gradient; return the bucket's items if it is now full.

        A parameter already waiting here (a second backward before the bucket filled)
        gets the new gradient added to its own: ``new + old`` has plain PyTorch's bits.
        """
        waiting = self._items.get(param)
        if waiting is not None:
            self._items[param] = grad.add_(waiting)
            return None
        self._items[param] = grad
        self._bytes += tensor_bytes(grad)
        return self.flush() if self._bytes >= self.capacity_bytes else None

    def __len__(self) -> int:
        """Gradients waiting here for their bucket to fill."""
        return len(self._items)

    def flush(self) -> list[Item] | None:
        """Return the partial bucket's items (None if empty) and start a new one."""
        items, self._items, self._bytes = list(self._items.items()), {}, 0
        return items or None
