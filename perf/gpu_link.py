"""Pinned copy rates and what the host pool really pins, on the local GPU.

    python -m perf.gpu_link [--json PATH]

* D2H and H2D rates of pinned copies (`gradient_cache.linkrate.measure_link`, as
  `gradient-cache plan --measure-link` uses them);
* the pinned reservation: the process's resident memory before and after building the
  CUDA backend's host pool for layouts whose slots need 5.0 GiB-like odd sizes (scaled down:
  a few hundred MiB), against the pool's own figures (``needed_bytes``, ``capacity_bytes``)
  and against one slab of the whole rounded up by the caching host allocator.

Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gradient_cache.engine.accelerator import allocate_pinned
from gradient_cache.engine.pool import HostPool, SlotSpec
from gradient_cache.engine.units import MIB
from gradient_cache.linkrate import measure_link


def resident_bytes() -> int:
    """VmRSS of this process (pinned pages are resident: cudaHostAlloc maps them)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def pool_reservation(region_mib: list[float]) -> dict[str, float]:
    """Build a pinned pool of regions of ``region_mib`` MiB; its figures and the RSS growth."""
    layout = {i: SlotSpec(regions=(int(mib * MIB),)) for i, mib in enumerate(region_mib)}
    before = resident_bytes()
    pool = HostPool(layout, allocate_pinned=allocate_pinned)
    grown = resident_bytes() - before
    needed = pool.needed_bytes
    return {
        "needed_mib": needed / MIB,
        "reserved_mib": pool.capacity_bytes / MIB,
        "rss_growth_mib": grown / MIB,
        "one_slab_would_reserve_mib": (1 << (needed - 1).bit_length()) / MIB,
        "pinned": pool.pinned,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("perf.gpu_link needs a CUDA device; this torch sees none.")
    # First: the caching host allocator would hand the pool the link test's freed block.
    # 310 MiB needed (one slab would pin 512), in odd sizes like a GPT's tensors.
    pool = pool_reservation([98.3, 98.3, 60.1, 33.3, 12.7, 4.4, 2.25, 0.6, 0.6])
    rate = measure_link()
    figures = {
        "device": rate.device_name,
        "device_to_host_gbps": rate.device_to_host_gbps,
        "host_to_device_gbps": rate.host_to_device_gbps,
        "copy_mib": rate.copy_bytes / MIB,
        "pool": pool,
    }
    print(
        f"| pinned copy | GB/s |\n|---|---:|\n| device to host | {rate.device_to_host_gbps:.1f} |\n"
        f"| host to device | {rate.host_to_device_gbps:.1f} |\n\n"
        f"Host pool: needs {pool['needed_mib']:.1f} MiB, reserves {pool['reserved_mib']:.1f} "
        f"MiB (one slab would: {pool['one_slab_would_reserve_mib']:.0f}); the process grew by "
        f"{pool['rss_growth_mib']:.1f} MiB resident; pinned: {pool['pinned']}."
    )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
