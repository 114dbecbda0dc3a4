"""``python -m gradient_cache.testing``: build (or load from the cache) the emulated device,
and say how long it took: the test command runs it once before the tests on the device."""

from __future__ import annotations

import time

import torch

from .emulated import emulated_device


def main() -> None:
    start = time.perf_counter()
    device = emulated_device()
    seconds = time.perf_counter() - start
    print(f"emulated device {device} ready in {seconds:.1f} s (torch {torch.__version__})")


if __name__ == "__main__":
    main()
