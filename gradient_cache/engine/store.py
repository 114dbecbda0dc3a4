"""The host store: one payload per parameter, summed across backward passes."""

from __future__ import annotations

import torch

from ..compression import Payload, merge


class HostStore:
    """Holds the offloaded gradient of each parameter until it is restored.

    Insertion order is arrival order (backward order), which `step()` reuses to restore
    bucket by bucket. A second payload for the same parameter (gradient accumulation)
    is merged into the first, so the store always holds the sum.
    """

    def __init__(self) -> None:
        self._payloads: dict[torch.nn.Parameter, Payload] = {}

    def add(self, param: torch.nn.Parameter, payload: Payload) -> None:
        held = self._payloads.get(param)
        self._payloads[param] = payload if held is None else merge(held, payload)

    def pop(self, param: torch.nn.Parameter) -> Payload:
        return self._payloads.pop(param)

    def clear(self) -> None:
        self._payloads.clear()

    def items(self) -> list[tuple[torch.nn.Parameter, Payload]]:
        return list(self._payloads.items())

    def __contains__(self, param: torch.nn.Parameter) -> bool:
        return param in self._payloads

    def __len__(self) -> int:
        return len(self._payloads)

    @property
    def nbytes(self) -> int:
        return sum(payload.nbytes for payload in self._payloads.values())
