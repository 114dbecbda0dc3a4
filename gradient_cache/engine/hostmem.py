"""Host memory: how much this process may still take, and the engine's budget check.

psutil does not see container limits, so the cgroups' headroom caps its figure (a parent's
limit caps its children). The check runs before anything is allocated: a refusal leaves nothing.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from .units import MIB

# cgroup v1 reports "no limit" as a huge number (the page-rounded maximum of a signed 64-bit).
_NO_LIMIT = 2**60


class HostMemoryError(MemoryError):
    """The engine's host memory would not fit in what the host lets it use."""


def _read_int(path: Path) -> int | None:
    """The number in ``path``; None where it is missing, ``max`` (v2) or unlimited (v1)."""
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return None if value >= _NO_LIMIT else value


def _headrooms(directory: Path, stop: Path, limit_file: str, usage_file: str) -> list[int]:
    """Headroom (limit - usage) of ``directory`` and each parent up to ``stop``, where set."""
    found = []
    while True:
        limit = _read_int(directory / limit_file)
        usage = _read_int(directory / usage_file)
        if limit is not None and usage is not None:
            found.append(max(0, limit - usage))
        if directory == stop or stop not in directory.parents:
            return found
        directory = directory.parent


def cgroup_headroom_bytes(
    proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup"
) -> int | None:
    """Smallest headroom of this process's memory cgroup and its ancestors, or None.

    ``proc_cgroup`` names the cgroup: ``0::/path`` under v2 (``memory.max`` / ``memory.current``),
    ``N:...memory...:/path`` under v1 (``memory.limit_in_bytes`` / ``memory.usage_in_bytes``).
    """
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        found += _headrooms(base / path.lstrip("/"), base, *files)
    return min(found, default=None)


def available_host_bytes() -> int:
    """Host RAM this process can still take: psutil's figure, capped by the cgroups."""
    available = psutil.virtual_memory().available
    headroom = cgroup_headroom_bytes()
    return available if headroom is None else min(available, headroom)


def check_host_budget(needed_bytes: int, *, fraction: float, what: str, released: int = 0) -> None:
    """Raise HostMemoryError, with the figures and the remedies, if ``needed_bytes`` won't fit
    in ``fraction`` of the available host RAM and the ``released`` bytes that come back to
    it as the cache fills (a model's own host memory, given up weight by weight)."""
    available = available_host_bytes() + released
    allowed = int(available * fraction)
    if needed_bytes > allowed:
        freed = f", {released / MIB:.0f} MiB of them the model's own" if released else ""
        raise HostMemoryError(
            f"gradient-cache needs about {needed_bytes / MIB:.0f} MiB of host memory ({what}) "
            f"but may use {allowed / MIB:.0f} MiB (host_memory_fraction={fraction} of "
            f"{available / MIB:.0f} MiB available{freed}). Raise compression_ratio, drop top-k's "
            "residual (codec=gradient_cache.TopK(error_feedback=False)), list large layers "
            "in exclude_layers, or raise host_memory_fraction."
        )
