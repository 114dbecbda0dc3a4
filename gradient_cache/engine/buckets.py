"""Which gradients travel together: buckets filled in the order backward produces them.

Buckets are assembled as gradients arrive, so they follow each step's real backward
order with no plan to keep in sync, and a parameter that gets no gradient in a step
simply never arrives. The partial bucket left at the end is flushed by the drain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

Item = tuple[torch.nn.Parameter, torch.Tensor]
T = TypeVar("T")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class BucketAssembler:
    """Collects (parameter, gradient) pairs until they hold ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: list[Item] = []
        self._bytes = 0

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> list[Item] | None:
        """Add one gradient; return the bucket if it is now full."""
        self._items.append((param, grad))
        self._bytes += tensor_bytes(grad)
        return self.flush() if self._bytes >= self.capacity_bytes else None

    def flush(self) -> list[Item] | None:
        """Return the partial bucket (None if empty) and start a new one."""
        items, self._items, self._bytes = self._items, [], 0
        return items or None


def chunk_by_bytes(
    items: Iterable[T], capacity_bytes: int, size_of: Callable[[T], int]
) -> Iterator[list[T]]:
    """Split ``items`` in order into runs of at most ``capacity_bytes``.

    An item larger than that gets a run of its own, so no run holds more than
    ``max(capacity_bytes, largest item)``: the fused step's bound on restored gradients.
    """
    chunk: list[T] = []
    total = 0
    for item in items:
        size = size_of(item)
        if chunk and total + size > capacity_bytes:
            yield chunk
            chunk, total = [], 0
        chunk.append(item)
        total += size
    if chunk:
        yield chunk
