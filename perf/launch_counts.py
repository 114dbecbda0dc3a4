"""How many operations each codec dispatches to encode and to decode one tensor, by size:
the eager path (what CUDA runs without Triton) against the fused one (with Triton).

    python -m perf.launch_counts [--sizes 18 20 22 24] [--codecs int8 q4 q3 q2 q1 sign]

Counted on the CPU with the compiled int8 kernels off, as the stand-in stream checker
counts: on CUDA each operation is at least one kernel launch, and each costs host time on
the thread that launches backward's own kernels. The fused path's operations run the
eager code inside on a CPU; here only their number matters, not their speed.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradient_cache.codecs import int8_kernels
from gradient_cache.codecs.registry import BLOCK_CODECS, make_codec


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def count(action: Callable[[], object]) -> int:
    with Counter() as counter:
        action()
    return counter.calls


@contextlib.contextmanager
def cuda_path(*, fused: bool) -> Iterator[None]:
    """CPU tensors take the path CUDA tensors take: fused operations or the eager code,
    never the compiled CPU kernels; put back afterwards."""
    saved = int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES
    int8_kernels.CPU_KERNELS = None
    int8_kernels.FUSED_DEVICE_TYPES = frozenset({"cpu"}) if fused else frozenset()
    try:
        yield
    finally:
        int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES = saved


def counts(name: str, numel: int, *, fused: bool) -> tuple[int, int]:
    """(encode, decode) operations for one ``numel``-entry fp32 tensor."""
    with cuda_path(fused=fused):
        codec = make_codec(name)
        codec.encode(torch.ones(1), None, loss_scale=None)  # the noise table: once a backward
        flat = torch.randn(numel)
        out = torch.empty(numel)
        encoded: list = []
        encode = count(lambda: encoded.append(codec.encode(flat, None, loss_scale=None)[0]))
        decode = count(lambda: encoded[0].decode_into(out))
    return encode, decode


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[18, 20, 22, 24], help="log2")
    # The codecs with fused kernels: int8 and every block codec.
    parser.add_argument("--codecs", nargs="+", default=["int8", *BLOCK_CODECS])
    args = parser.parse_args(argv)
    header = f"{'codec':<6} {'entries':>8} {'eager encode':>13} {'decode':>7}"
    print(f"{header} {'fused encode':>13} {'decode':>7}")
    for name in args.codecs:
        for size in args.sizes:
            eager = counts(name, 1 << size, fused=False)
            fused = counts(name, 1 << size, fused=True)
            row = f"{name:<6} {f'2^{size}':>8} {eager[0]:>13} {eager[1]:>7}"
            print(f"{row} {fused[0]:>13} {fused[1]:>7}")


if __name__ == "__main__":
    main()
