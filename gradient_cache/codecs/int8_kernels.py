"""Int8 block quantization: an int8 code per entry and an fp32 scale per block of 64.

The kernels shared by int8 values (`values.Int8Quantizer`) and the int8 residual
(`residual.ResidualCodec`). Rounding is stochastic, so decoding is unbiased.

On CUDA, where Triton is installed, each tensor's encode and each decode is one operation
(`int8_encode` / `int8_decode` in the ``gradient_cache`` op namespace, one Triton kernel
each: `int8_triton`), whatever the tensor's size. On a CPU, tensors go through the compiled
one-pass kernels (`_int8_cpu.c`, built by setup.py) when they were built. Both give the
same bytes as the eager PyTorch code here, which serves every other case: a chunk at a
time, a fixed number of operations per chunk.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from .dither import WINDOW, Dither, DrawsFrom, as_int64


class CompiledKernels(Protocol):
    """The compiled module `_int8_cpu` (typed in ``_int8_cpu.pyi``): addresses are
    ``data_ptr()`` integers."""

    MIN_PARALLEL: int

    def encode(
        self,
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

    def decode(self, codes: int, scales: int, out: int, count: int, threads: int, /) -> None: ...

    def use_avx2(self, enabled: bool, /) -> bool: ...


# Read at each call, never cached: setting it to None sends CPU tensors down the eager path
# (the stand-in stream checker does, so that it sees every write the CUDA path makes).
CPU_KERNELS: CompiledKernels | None
try:
    from . import _int8_cpu
except ImportError:  # built without a C compiler: the eager path does the same, slower
    CPU_KERNELS = None
else:
    CPU_KERNELS = _int8_cpu

# Device types whose encodes and decodes run as one fused operation per tensor: CUDA where
# Triton is installed (imported at the first such call). Read at each call: the stand-in
# stream checker adds "cpu", where the operations run the eager path inside, so that it
# checks the operations a GPU dispatches.
FUSED_DEVICE_TYPES: frozenset[str] = (
    frozenset({"cuda"}) if importlib.util.find_spec("triton") is not None else frozenset()
)

# Entries per scale: 64 keeps the scales at 1/16 of the int8 bytes.
INT8_BLOCK = 64
# Entries the codecs work on at a time (a multiple of INT8_BLOCK, at most a dither window):
# their fp32 temporaries stay within a few MiB of device memory however large the tensor.
CODEC_CHUNK = WINDOW
# Each scale is its block's largest magnitude times SCALE_STEP, a hair above 1 / 127: the
# largest entry then scales to just under 127 (never above it through rounding), and with
# noise below 1 its code floors to at most 127. The error bound grows by a part in 10^6.
SCALE_MARGIN = 2**-20
SCALE_STEP = (1 + SCALE_MARGIN) / 127


class UniformNoise(Protocol):
    """Where stochastic rounding's noise comes from: `dither.Dither` (a table window, no
    random number per entry) or `generators.DeviceGenerators` (``torch.rand``)."""

    def uniform(self, count: int, device: torch.device) -> torch.Tensor:
        """``count`` (at most `CODEC_CHUNK`) uniform numbers in [0, 1) on ``device``, fp32."""
        ...


def int8_blocks_bytes(numel: int) -> int:
    """Bytes of `int8_blocks_encode`'s output: a code per entry in whole blocks, a scale each."""
    blocks = -(-numel // INT8_BLOCK)
    return blocks * INT8_BLOCK + 4 * blocks


def chunks(numel: int, size: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive ``size``-entry slices (default `CODEC_CHUNK`, read at
    the call) covering ``numel`` entries."""
    size = CODEC_CHUNK if size is None else size
    for start in range(0, numel, size):
        yield start, min(start + size, numel)


def on_cpu_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels can take ``tensors`` (contiguous, in CPU memory)."""
    return CPU_KERNELS is not None and all(
        t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


def int8_blocks_encode(x: torch.Tensor, noise: UniformNoise) -> torch.Tensor:
    """Flat ``x`` (any float dtype) as int8 codes per block of `INT8_BLOCK`, times the
    block's fp32 scale.

    The scale is the block's largest magnitude / 127 (raised by `SCALE_MARGIN`); uniform
    noise from ``noise`` rounds each code stochastically, so decoding is unbiased and off by
    less than the scale. Codes and fp32 scales are packed into one uint8 tensor. A window
    of noise serves each `CODEC_CHUNK` entries, drawn in order, whichever path runs.
    """
    numel = x.numel()
    packed = torch.empty(int8_blocks_bytes(numel), dtype=torch.uint8, device=x.device)
    if isinstance(noise, Dither) and x.device.type in FUSED_DEVICE_TYPES and x.is_contiguous():
        first = noise.take(noise_windows(numel))
        if numel:
            table, seed = noise.table(x.device), as_int64(noise.seed)
            torch.ops.gradient_cache.int8_encode(x, table, seed, first, packed)
        return packed
    x = x.float()
    if on_cpu_kernels(x):
        encode_on_cpu(x, noise, packed)
    else:
        encode_eagerly(x, noise, packed)
    return packed


def noise_windows(numel: int) -> int:
    """The dither draws (noise windows) an encode of ``numel`` entries takes: one a chunk,
    as the eager path draws them."""
    return -(-numel // CODEC_CHUNK)


def encode_eagerly(x: torch.Tensor, noise: UniformNoise, packed: torch.Tensor) -> None:
    """`int8_blocks_encode` of flat fp32 ``x`` into ``packed`` in PyTorch operations.

    Works through ``x`` a chunk at a time in one reused fp32 buffer of a chunk, so its
    temporaries stay a few MiB however large ``x`` is and no chunk allocates: per chunk
    |x|, the block maxima (straight into the packed scales), the scaled value plus noise,
    floor, the cast.
    """
    numel = x.numel()
    blocks = -(-numel // INT8_BLOCK)
    codes = packed[: blocks * INT8_BLOCK].view(torch.int8)
    scales = packed[blocks * INT8_BLOCK :].view(torch.float32)
    work = torch.empty(min(blocks * INT8_BLOCK, CODEC_CHUNK), dtype=torch.float32, device=x.device)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    for start, stop in chunks(numel):
        part_blocks = -(-(stop - start) // INT8_BLOCK)
        part = x[start:stop]
        if part.numel() < part_blocks * INT8_BLOCK:  # the last chunk: zeros fill its block
            part = torch.nn.functional.pad(part, (0, part_blocks * INT8_BLOCK - part.numel()))
        part = part.view(part_blocks, INT8_BLOCK)
        level = work[: part.numel()].view_as(part)
        part_scales = scales[start // INT8_BLOCK : start // INT8_BLOCK + part_blocks]
        # NaN and inf propagate (amax keeps NaN); an all-zero block's scale is +0. abs then
        # amax: about 5x faster on a CPU than aminmax over 64-entry rows.
        torch.amax(torch.abs(part, out=level), dim=1, out=part_scales).mul_(SCALE_STEP)
        # A divide, not a multiply by 1 / s: that inverse overflows for subnormal scales.
        # An all-zero block keeps codes 0; an inf scale makes the block non-finite.
        safe = torch.where(part_scales > 0, part_scales, one).unsqueeze(1)
        noise_part = noise.uniform(part.numel(), x.device).view_as(part)
        # |x| / scale is at most 127 / (1 + SCALE_MARGIN) and the noise below 1, so the
        # floor of their sum lies in [-127, 127] for every finite entry: no clamp is needed.
        torch.addcdiv(noise_part, part, safe, out=level).floor_()
        codes[start : start + level.numel()].view_as(level).copy_(level)


# The fused kernels, each with its compile-time arguments, that have built and run once in
# this process: an error from one of them later is the call's own and raises.
_BUILT: set[tuple[object, ...]] = set()


def run_fused(
    kernel: tuple[object, ...], launch: Callable[[], None], eager: Callable[[], object]
) -> None:
    """Run a fused operation's Triton ``launch``, which imports the Triton module itself.

    The first launch of each ``kernel`` (a name and the arguments Triton compiles for) can
    fail for reasons of the machine, not of the call: Triton too old or broken, no C
    compiler for its launcher, a lowering Triton lacks for this GPU, too few resources.
    Each raises before anything is written, and Triton gives them no common type; so any
    error there warns, sends every later call down the eager path, and runs ``eager`` now,
    which writes the same bytes. Once a kernel has run, its errors raise.
    """
    global FUSED_DEVICE_TYPES
    if kernel in _BUILT:
        launch()
        return
    try:
        launch()
    except Exception as error:
        warnings.warn(
            f"gradient-cache: Triton could not build or launch the codec kernel {kernel[0]} "
            f"on this machine ({error!r}); the codecs run their PyTorch path from now on "
            "(the same bytes, more launches). Please report it with your GPU, CUDA and "
            "Triton versions.",
            RuntimeWarning,
            stacklevel=2,
        )
        FUSED_DEVICE_TYPES = FUSED_DEVICE_TYPES - {"cuda"}
        eager()
        return
    _BUILT.add(kernel)


@torch.library.custom_op("gradient_cache::int8_encode", mutates_args=("packed",))
def _fused_encode(
    x: torch.Tensor, table: torch.Tensor, seed: int, first_draw: int, packed: torch.Tensor
) -> None:
    """`int8_blocks_encode` of flat contiguous ``x`` into ``packed`` as one operation, with
    the windows of draws ``first_draw`` on of the dither seeded ``seed`` (``table``: its
    `dither.noise_table`): one Triton kernel on CUDA, the eager path elsewhere."""

    def eager() -> None:
        encode_eagerly(x.float(), DrawsFrom(seed, first_draw, table), packed)

    if x.device.type == "cuda":

        def launch() -> None:
            from . import int8_triton  # Triton loads at the first CUDA launch, not at import

            int8_triton.encode(
                x,
                table,
                seed,
                first_draw,
                packed,
                block=INT8_BLOCK,
                scale_step=SCALE_STEP,
                chunk=CODEC_CHUNK,
            )

        run_fused(("int8_encode", x.dtype), launch, eager)
    else:
        eager()


@torch.library.custom_op("gradient_cache::int8_decode", mutates_args=("out",))
def _fused_decode(packed: torch.Tensor, out: torch.Tensor) -> None:
    """`int8_blocks_decode` into flat contiguous fp32 ``out`` as one operation: one Triton
    kernel on CUDA, the eager path elsewhere."""

    def eager() -> None:
        decode_eagerly(packed, out.numel(), out)

    if packed.device.type == "cuda":

        def launch() -> None:
            from . import int8_triton

            int8_triton.decode(packed, out, block=INT8_BLOCK)

        run_fused(("int8_decode",), launch, eager)
    else:
        eager()


def encode_on_cpu(x: torch.Tensor, noise: UniformNoise, packed: torch.Tensor) -> None:
    """`int8_blocks_encode` into ``packed`` by the compiled kernel, in one pass.

    It draws the same noise windows as the eager loop, in the same order and sizes (each
    chunk's entries padded to whole blocks), so the bytes and the generators' states after
    the call are the same too.
    """
    kernels = CPU_KERNELS
    if kernels is None:
        raise RuntimeError("encode_on_cpu: gradient-cache was installed without its int8 kernels")
    padded = -(-x.numel() // INT8_BLOCK) * INT8_BLOCK
    windows = []
    for start, stop in chunks(padded):
        window = noise.uniform(stop - start, x.device)
        # The kernel reads raw memory: a window must hold what it reads.
        if window.dtype != torch.float32 or window.numel() < stop - start:
            raise RuntimeError(
                f"noise window of {window.numel()} {window.dtype} entries; the int8 kernel "
                f"needs {stop - start} fp32 entries"
            )
        windows.append(window.contiguous())
    kernels.encode(
        x.data_ptr(),
        x.numel(),
        tuple(window.data_ptr() for window in windows),
        CODEC_CHUNK,
        packed.data_ptr(),  # the codes, then the fp32 scales
        packed.data_ptr() + padded,
        SCALE_STEP,
        torch.get_num_threads(),
    )


def int8_blocks_decode(
    packed: torch.Tensor, numel: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 values `int8_blocks_encode` packed: into ``out`` (flat fp32, ``numel``
    entries, on ``packed``'s device) if given, else a new tensor."""
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    # Else the eager path, which raises on a mismatch a kernel would write past.
    fits = (
        out.dtype == torch.float32
        and out.numel() == numel
        and packed.numel() == int8_blocks_bytes(numel)
    )
    contiguous = packed.is_contiguous() and out.is_contiguous()
    if fits and contiguous and packed.device.type in FUSED_DEVICE_TYPES:
        if numel:
            torch.ops.gradient_cache.int8_decode(packed, out)
        return out
    kernels = CPU_KERNELS
    if kernels is not None and fits and on_cpu_kernels(packed, out):
        blocks = -(-numel // INT8_BLOCK)
        codes, scales = packed[: blocks * INT8_BLOCK], packed[blocks * INT8_BLOCK :]
        threads = torch.get_num_threads()
        kernels.decode(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), numel, threads)
        return out
    return decode_eagerly(packed, numel, out)


def decode_eagerly(packed: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
    """`int8_blocks_decode` of ``numel`` entries into ``out`` in PyTorch operations, a
    chunk at a time."""
    blocks = -(-numel // INT8_BLOCK)
    codes = packed[: blocks * INT8_BLOCK].view(torch.int8)
    scales = packed[blocks * INT8_BLOCK :].view(torch.float32)
    for start, stop in chunks(numel):
        part_blocks = -(-(stop - start) // INT8_BLOCK)
        part = codes[start : start + part_blocks * INT8_BLOCK].view(part_blocks, INT8_BLOCK)
        part_scales = scales[start // INT8_BLOCK : start // INT8_BLOCK + part_blocks].unsqueeze(1)
        if stop - start == part.numel():  # whole blocks: written in place
            # Convert, then scale in place: faster on a CPU than one mixed-dtype multiply.
            target = out[start:stop].view_as(part)
            target.copy_(part).mul_(part_scales)
        else:
            out[start:stop] = (part.float() * part_scales).view(-1)[: stop - start]
    return out
