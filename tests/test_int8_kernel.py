"""The compiled int8 CPU kernels (`codecs/_int8_cpu.c`) against the eager PyTorch path.

The kernel is an optimisation of the eager code, not another codec: for every finite
input it must write the same bytes, draw the same noise (the generators end in the same
state) and decode to the same bits, on one thread or several. Blocks holding NaN or inf
may differ in their codes (the eager cast of a NaN is undefined), never in what they
decode to: non-finite.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from gradient_cache.codecs import int8_kernels
from gradient_cache.codecs.dither import Dither
from gradient_cache.codecs.generators import DeviceGenerators
from gradient_cache.codecs.int8_kernels import (
    CODEC_CHUNK,
    INT8_BLOCK,
    int8_blocks_bytes,
    int8_blocks_decode,
    int8_blocks_encode,
)

FAST = (Phase.explicit, Phase.reuse, Phase.generate)
# The kernel splits work over threads from this many entries.
PARALLEL = getattr(int8_kernels.CPU_KERNELS, "MIN_PARALLEL", 1 << 21)
# Whole blocks go through AVX2 where the CPU has it, else the portable loops: both run.
VECTOR_PATHS = pytest.mark.parametrize("avx2", [True, False], ids=["avx2", "portable"])


def eager(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the kernels switched off: the eager PyTorch path."""
    with mock.patch.object(int8_kernels, "CPU_KERNELS", None):
        return fn(*args, **kwargs)


@contextlib.contextmanager
def whole_blocks_through(avx2: bool) -> Iterator[None]:
    """The kernel's whole blocks through AVX2 (where the CPU has it) or its portable loops."""
    kernels = int8_kernels.CPU_KERNELS
    previous = kernels.use_avx2(avx2) if kernels else None
    try:
        yield
    finally:
        if kernels:
            kernels.use_avx2(previous)


def test_the_kernels_are_built():
    """setup.py builds them on every install with a C compiler (CI's included); without
    them the codec is correct but slower, so a silent fallback here would hide a failure."""
    assert int8_kernels.CPU_KERNELS is not None, (
        "gradient_cache.codecs._int8_cpu did not build: reinstall with a C compiler and "
        "Python's headers (pip install -e .) and read the build log"
    )


def test_the_portable_path_can_be_chosen_so_both_are_tested():
    """`whole_blocks_through(False)` really switches AVX2 off (the paths write the same
    bytes, so only the switch's own state shows it)."""
    with whole_blocks_through(False):
        assert int8_kernels.CPU_KERNELS.use_avx2(False) is False


def noise_source(kind: str, seed: int):
    return Dither(seed) if kind == "dither" else DeviceGenerators(seed)


def same_encoding(x: torch.Tensor, kind: str = "dither") -> torch.Tensor:
    """Encode ``x`` both ways from equal noise sources; check bytes and noise state."""
    fast_noise, slow_noise = noise_source(kind, 7), noise_source(kind, 7)
    fast = int8_blocks_encode(x, fast_noise)
    slow = eager(int8_blocks_encode, x, slow_noise)
    assert torch.equal(fast, slow)
    cpu = torch.device("cpu")
    fast_state, slow_state = fast_noise.get_state(cpu), slow_noise.get_state(cpu)
    assert (fast_state is None and slow_state is None) or torch.equal(fast_state, slow_state)
    return fast


# Gradients per vector path: 60 in the suite; a longer run sets the variable (150 found
# nothing more on 2026-12-03).
KERNEL_EXAMPLES = int(os.environ.get("GRADIENT_CACHE_KERNEL_EXAMPLES", "60"))


@st.composite
def finite_gradients(draw):
    """fp32 gradients of 0-700 entries: ordinary, huge, tiny, subnormal and zero values."""
    numel = draw(st.integers(0, 700))
    values = st.one_of(
        st.floats(allow_nan=False, allow_infinity=False, width=32),
        st.floats(-0.0009765625, 0.0009765625, allow_nan=False, allow_infinity=False, width=32),
        st.sampled_from([0.0, -0.0, 1e-45, -3e-42, 1.17e-38, 3.4028234663852886e38]),
    )
    return torch.tensor(draw(st.lists(values, min_size=numel, max_size=numel)))


@VECTOR_PATHS
@settings(max_examples=KERNEL_EXAMPLES, deadline=None, derandomize=True, phases=FAST)
@given(x=finite_gradients(), kind=st.sampled_from(["dither", "generator"]))
def test_kernel_writes_the_eager_bytes_for_finite_gradients(avx2, x, kind):
    with whole_blocks_through(avx2):
        packed = same_encoding(x, kind)
    fast = int8_blocks_decode(packed, x.numel())
    slow = eager(int8_blocks_decode, packed, x.numel())
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))  # bit for bit


@pytest.mark.parametrize(
    "numel",
    [
        CODEC_CHUNK * 3 + 5 * INT8_BLOCK + 17,  # several noise windows, a partial block
        PARALLEL,  # the first size split over threads, more than 2^20 entries
        PARALLEL + CODEC_CHUNK // 2 + 17,  # split mid-window, a partial block
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
@VECTOR_PATHS
def test_large_gradients_match_on_any_number_of_threads(numel, threads, avx2):
    """Threads split the blocks; the noise of each block still comes from its chunk's
    window. A few outliers and zeros make blocks of every kind."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::100_003] = 3e4
    x[INT8_BLOCK : 3 * INT8_BLOCK] = 0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with whole_blocks_through(avx2):
            packed = same_encoding(x)
        out = torch.full((numel,), math.nan)
        int8_blocks_decode(packed, numel, out=out)
    finally:
        torch.set_num_threads(before)
    slow = eager(int8_blocks_decode, packed, numel)
    assert torch.equal(out.view(torch.int32), slow.view(torch.int32))
    scales = packed[-4 * (-(-numel // INT8_BLOCK)) :].view(torch.float32)
    bound = scales.repeat_interleave(INT8_BLOCK)[:numel]
    assert ((out - x).abs() <= bound).all()  # within a scale of the gradient, every entry


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("numel", [1, 130, PARALLEL + 70])
@VECTOR_PATHS
def test_non_finite_blocks_decode_non_finite_and_the_rest_exactly_as_eager(special, numel, avx2):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    x[numel // 2] = special
    with whole_blocks_through(avx2):
        fast_packed = int8_blocks_encode(x, Dither(3))
    slow_packed = eager(int8_blocks_encode, x, Dither(3))
    fast = int8_blocks_decode(fast_packed, numel)
    slow = eager(int8_blocks_decode, slow_packed, numel)
    bad_block = torch.zeros(numel, dtype=torch.bool)
    first = numel // 2 // INT8_BLOCK * INT8_BLOCK
    bad_block[first : first + INT8_BLOCK] = True
    assert not torch.isfinite(fast[bad_block]).any()
    assert not torch.isfinite(slow[bad_block]).any()
    assert torch.equal(fast[~bad_block], slow[~bad_block])


def test_encode_reads_a_strided_gradient_through_the_eager_path():
    """A non-contiguous tensor is not handed to the kernel (it reads flat memory)."""
    base = torch.randn(2 * 1000)
    strided = base[::2]
    assert not int8_kernels.on_cpu_kernels(strided)
    decoded = int8_blocks_decode(int8_blocks_encode(strided, Dither(0)), 1000)
    assert torch.allclose(decoded, strided, atol=float(strided.abs().max()) / 100)


def test_decode_into_a_wrong_sized_output_raises_instead_of_writing_past_it():
    x = torch.randn(1000)
    packed = int8_blocks_encode(x, Dither(0))
    assert packed.numel() == int8_blocks_bytes(1000)
    with pytest.raises(RuntimeError):
        int8_blocks_decode(packed, 1000, out=torch.empty(999))


def test_a_short_noise_window_is_refused_before_the_kernel_reads_it():
    class Short:
        def uniform(self, count: int, device: torch.device) -> torch.Tensor:
            return torch.rand(count - 1)

    with pytest.raises(RuntimeError, match="noise window"):
        int8_blocks_encode(torch.randn(100), Short())


def test_the_kernel_refuses_too_few_windows_or_a_chunk_off_the_blocks():
    """Its own checks on what it is handed, before it reads any memory."""
    kernels = int8_kernels.CPU_KERNELS
    x, packed = torch.randn(CODEC_CHUNK + 1), torch.empty(int8_blocks_bytes(CODEC_CHUNK + 1))
    window = torch.rand(CODEC_CHUNK)
    args = (x.data_ptr(), x.numel(), (window.data_ptr(),), CODEC_CHUNK, packed.data_ptr())
    with pytest.raises(ValueError, match="1 noise windows for 2 chunks"):
        kernels.encode(*args, packed.data_ptr() + CODEC_CHUNK + INT8_BLOCK, 0.01, 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.encode(x.data_ptr(), 10, (window.data_ptr(),), 100, packed.data_ptr(), 0, 0.01, 1)
