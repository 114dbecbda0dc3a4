"""The compiled int8 kernels (`_int8_cpu.c`), for the type checker: addresses are
``data_ptr()`` integers, counts are entries."""

from collections.abc import Sequence

#: Entries below which a call runs on the calling thread alone.
MIN_PARALLEL: int

def encode(
    x: int,
    count: int,
    windows: Sequence[int],
    chunk: int,
    codes: int,
    scales: int,
    step: float,
    threads: int,
    /,
) -> None: ...
def decode(codes: int, scales: int, out: int, count: int, threads: int, /) -> None: ...
def use_avx2(enabled: bool, /) -> bool: ...
