"""Which devices are the accelerator's (the backend and a budget's statistics follow it).

torch's device-generic API serves one device type per process, `current_accelerator()`'s: a
registered PrivateUse1 device ahead of CUDA, XPU and the others.
"""

from __future__ import annotations

import torch


def current_accelerator_type() -> str | None:
    """The current accelerator's device type (``"cuda"``, ``"xpu"``, ...), or None."""
    try:
        accelerator = torch.accelerator.current_accelerator()
    except RuntimeError:  # torch 2.6 raises where there is none; later releases return None
        return None
    return None if accelerator is None else accelerator.type


def is_accelerator(device: torch.device) -> bool:
    """``device`` is of the current accelerator's type (`torch.accelerator`'s streams)."""
    return device.type == current_accelerator_type()
