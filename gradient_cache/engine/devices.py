"""Which devices are the accelerator's: the one question that picks the accelerator backend
(`factory`) and the memory statistics a budget reads (`budget`).

torch's device-generic API (`torch.Stream`, `torch.Event`, `torch.accelerator`, pinned
memory) serves one device type per process: `torch.accelerator.current_accelerator()`'s,
which is a registered PrivateUse1 device ahead of CUDA, XPU and the others.
"""

from __future__ import annotations

import torch


def current_accelerator_type() -> str | None:
    """The current accelerator's device type (``"cuda"``, ``"xpu"``, a PrivateUse1
    backend's name), or None where there is none."""
    try:
        accelerator = torch.accelerator.current_accelerator()
    except RuntimeError:  # torch 2.6 raises where there is none; later releases return None
        return None
    return None if accelerator is None else accelerator.type


def is_accelerator(device: torch.device) -> bool:
    """``device`` is of the current accelerator's type: its streams, events, pinned host
    memory and allocator statistics are `torch.accelerator`'s."""
    return device.type == current_accelerator_type()
