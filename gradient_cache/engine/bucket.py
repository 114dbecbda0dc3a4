"""A bucket: gradients that leave the device together, from backward until their restore.

Assembled on the device (`BucketAssembler`), then ``LANDING`` (encoded, host copies issued),
``CACHED`` (drained), restored out of the store (docs/ARCHITECTURE.md draws it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..codecs import Payload

Param = torch.nn.Parameter
Item = tuple[Param, torch.Tensor]


class BucketState(enum.Enum):
    LANDING = "landing"  # host copies issued, not yet waited for
    CACHED = "cached"  # host payloads complete


@dataclass(eq=False)  # by identity, as the store's lists and maps hold it
class Bucket:
    """Host payloads offloaded together, in arrival order; `store.GradientStore` owns it."""

    payloads: dict[Param, Payload]
    state: BucketState = BucketState.LANDING


class BucketAssembler:
    """Collects (parameter, gradient) pairs until they hold ``capacity_bytes``, in each
    step's real backward order (no plan to keep in sync). The drain flushes the rest."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: dict[Param, torch.Tensor] = {}
        self._bytes = 0

    def add(self, param: Param, grad: torch.Tensor, dtype: torch.dtype) -> list[Item] | None:
        """Add one gradient, counted in ``dtype``, the one it is stepped in (a bf16 gradient
        fills a bucket as its fp32 sum will at the step); return the items if now full. A
        parameter already waiting (a second backward) gets ``new + old``: plain's bits."""
        waiting = self._items.get(param)
        if waiting is not None:
            self._items[param] = grad.add_(waiting)
            return None
        self._items[param] = grad
        self._bytes += grad.numel() * dtype.itemsize
        return self.flush() if self._bytes >= self.capacity_bytes else None

    def holds(self, param: Param) -> bool:
        return param in self._items

    def __len__(self) -> int:
        """Gradients waiting here for their bucket to fill."""
        return len(self._items)

    def params(self) -> list[Param]:
        """The parameters whose gradients wait here, in arrival order."""
        return list(self._items)

    def waiting(self) -> list[torch.Tensor]:
        """The device gradients waiting here (memory accounting reads them)."""
        return list(self._items.values())

    def flush(self) -> list[Item] | None:
        """Return the partial bucket's items (None if empty) and start a new one."""
        items, self._items, self._bytes = list(self._items.items()), {}, 0
        return items or None
