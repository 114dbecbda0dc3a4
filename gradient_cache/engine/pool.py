"""Host memory: how much the engine will need, and whether the host can give it.

psutil does not see container (cgroup) limits, so the available figure is the lower of
psutil's and the cgroup's headroom where one is set.
"""

from __future__ import annotations

import math
import warnings
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


def _aligned(nbytes: int) -> int:
    """``nbytes`` as `HostPool.take` lays it out: each view starts on a 64-byte boundary."""
    return -(-nbytes // HostPool.ALIGN) * HostPool.ALIGN


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
                total += _aligned(kept * param.element_size()) + _aligned(kept * index_size)
            else:
                total += _aligned(numel * param.element_size())
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


class HostPool:
    """Host memory for payloads: one slab allocated once, handed out by bumping an offset.

    The caching host allocator rounds every pinned request up to a power of two, so many
    small pinned tensors waste up to half their memory; one slab does not. The slab is
    reused every step: `reset()` (when the store is empty) records an event on the
    current stream, and the next `take()` waits for it, so a host-to-device copy still
    reading the slab finishes before its bytes are handed out again. Requests that do not
    fit get an ordinary allocation of the same kind.
    """

    ALIGN = 64  # bytes; keeps every view aligned for any dtype and for fast copies

    def __init__(self, capacity_bytes: int, *, pin: bool) -> None:
        self.pinned = pin
        self.overflow_bytes = 0  # since the last reset
        self.step_used_bytes = self.step_overflow_bytes = 0  # of the last completed step
        self._slab = self._allocate(max(self.ALIGN, capacity_bytes))
        self._offset = 0
        self._released: torch.cuda.Event | None = None

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pinned:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as error:  # no CUDA driver, or the OS refused to lock pages
                warnings.warn(
                    f"gradient-cache could not pin host memory ({error}); using pageable "
                    "memory, so device-to-host copies will block. Set pin_memory=False to "
                    "silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.pinned = False
        return torch.empty(nbytes, dtype=torch.uint8)

    @property
    def capacity_bytes(self) -> int:
        return self._slab.numel()

    @property
    def used_bytes(self) -> int:
        return self._offset

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised flat host tensor of ``numel`` elements of ``dtype``."""
        if self._released is not None:
            self._released.synchronize()  # the last restore's copies have read the slab
            self._released = None
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = -(-self._offset // self.ALIGN) * self.ALIGN
        if start + nbytes > self._slab.numel():
            self.overflow_bytes += nbytes
            return self._allocate(nbytes).view(dtype)[:numel]
        self._offset = start + nbytes
        return self._slab[start : start + nbytes].view(dtype)

    def reset(self, *, after: torch.cuda.Event | None = None) -> None:
        """Hand the whole slab out again, once ``after`` (if given) has completed.

        What the step that ends here used is kept in ``step_used_bytes`` and
        ``step_overflow_bytes`` for the summary.
        """
        self.step_used_bytes, self.step_overflow_bytes = self._offset, self.overflow_bytes
        self._offset = 0
        self.overflow_bytes = 0
        self._released = after
