"""The host link's copy rates, measured on the local GPU for `gradient-cache plan`.

Times pinned device-to-host and host-to-device copies of a few hundred MiB with CUDA
events (the copies the engine makes: pinned host memory, non-blocking, on a side stream),
a median over a few repeats after one warm-up copy each way.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from .engine.units import MIB

DEFAULT_COPY_BYTES = 256 * MIB
DEFAULT_REPEATS = 5


@dataclass(frozen=True, kw_only=True)
class LinkRate:
    """Copy rates in GB/s (1e9 bytes a second) per direction, and what was measured."""

    device_to_host_gbps: float
    host_to_device_gbps: float
    copy_bytes: int
    device_name: str

    @property
    def slower_gbps(self) -> float:
        """The slower direction: what the planner's time floor assumes for both."""
        return min(self.device_to_host_gbps, self.host_to_device_gbps)


def measure_link(
    *,
    copy_bytes: int = DEFAULT_COPY_BYTES,
    repeats: int = DEFAULT_REPEATS,
    cuda: Any = torch.cuda,
    device: torch.device | None = None,
    allocate_pinned: Any = None,
) -> LinkRate:
    """Time pinned copies each way on ``device`` (the current CUDA device by default).

    ``cuda`` and ``allocate_pinned`` stand in for `torch.cuda` and pinned allocation in
    tests. Raises RuntimeError where no CUDA device is available.
    """
    if not cuda.is_available():
        raise RuntimeError("no CUDA device is available to measure the host link on")
    if copy_bytes < 1 or repeats < 1:
        raise ValueError(
            f"Invalid copy_bytes={copy_bytes!r} or repeats={repeats!r}; expected both >= 1."
        )
    if device is None:
        device = torch.device("cuda", cuda.current_device())
    if allocate_pinned is None:

        def allocate_pinned(nbytes: int) -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    host = allocate_pinned(copy_bytes)
    on_device = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    stream = cuda.Stream(device)
    rates = {}
    for name, target, source in (
        ("device_to_host", host, on_device),
        ("host_to_device", on_device, host),
    ):
        seconds = []
        for attempt in range(repeats + 1):  # the first copy warms the path up, untimed
            start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            with cuda.stream(stream):
                start.record(stream)
                target.copy_(source, non_blocking=True)
                end.record(stream)
            end.synchronize()  # the host waits here: nothing else runs on this stream
            if attempt:
                seconds.append(start.elapsed_time(end) / 1e3)
        rates[name] = copy_bytes / statistics.median(seconds) / 1e9
    return LinkRate(
        device_to_host_gbps=rates["device_to_host"],
        host_to_device_gbps=rates["host_to_device"],
        copy_bytes=copy_bytes,
        device_name=cuda.get_device_name(device),
    )
