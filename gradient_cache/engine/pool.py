"""Host memory: how much the engine will need, and whether the host can give it.

psutil does not see container (cgroup) limits, so the available figure is the lower of
psutil's and the cgroup's headroom where one is set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import psutil
import torch

from ..compression import THRESHOLD_TOLERANCE, index_dtype, keep_count
from .config import EngineConfig

MIB = 2**20
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
    ),
)


class HostMemoryError(MemoryError):
    """The host store would not fit in the host memory the engine may use."""


def cgroup_headroom_bytes(files: Sequence[tuple[str, str]] = _CGROUP_FILES) -> int | None:
    """Bytes left under this process's cgroup memory limit, or None if it has none."""
    for limit_file, usage_file in files:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:  # v1 reports "no limit" as a huge number
            return None
        return max(0, int(limit) - usage)
    return None


def available_host_bytes() -> int:
    """Host RAM this process can still take: psutil's figure, capped by the cgroup."""
    available = psutil.virtual_memory().available
    headroom = cgroup_headroom_bytes()
    return available if headroom is None else min(available, headroom)


def estimate_host_bytes(
    params: Sequence[torch.nn.Parameter],
    *,
    ratio: float,
    config: EngineConfig,
    count_payloads: bool,
) -> int:
    """Host bytes the engine holds for one step of ``params``.

    ``count_payloads`` is False when the host is the device (the CPU backend): the
    stored gradients then replace the ones plain PyTorch would hold, and only the
    error-feedback residuals are extra.
    """
    total = 0
    for param in params:
        numel = param.numel()
        compressed = ratio > 1 and numel >= config.min_compress_numel
        if count_payloads:
            if compressed:
                kept = math.ceil(keep_count(numel, ratio) * (1 + THRESHOLD_TOLERANCE))
                index_size = torch.empty((), dtype=index_dtype(numel)).element_size()
                total += kept * (param.element_size() + index_size)
            else:
                total += numel * param.element_size()
        if compressed and config.error_feedback and config.residual_location == "host":
            total += numel * 4  # fp32 residual
    return total


def check_host_budget(needed_bytes: int, config: EngineConfig) -> None:
    """Raise HostMemoryError, with the figures and the remedies, if the store will not fit."""
    available = available_host_bytes()
    allowed = int(available * config.host_memory_fraction)
    if needed_bytes > allowed:
        raise HostMemoryError(
            f"gradient-cache needs about {needed_bytes / MIB:.0f} MiB of host memory but may "
            f"use {allowed / MIB:.0f} MiB (host_memory_fraction={config.host_memory_fraction} "
            f"of {available / MIB:.0f} MiB available). Raise compression_ratio, set "
            "error_feedback=False, list large layers in exclude_layers, or raise "
            "host_memory_fraction."
        )
