"""bf16 weights over the host-to-device link from fp32 masters on the host (issue 51, item 1):
what each exact transport costs the host CPU, the link and host RAM, measured on this CPU.

    python -m perf.bf16_transport            # three block shapes, the largest when RAM allows
    python -m perf.bf16_transport --quick    # the two small shapes, fewer repeats

With ``compute_dtype=torch.bfloat16`` forward and backward need, per pass, the bf16 copy of
each weight that PyTorch's cast gives (``master.to(torch.bfloat16)``: round to nearest, ties
to even). Sending the fp32 master costs 4 bytes per parameter over the link. Two exact
transports send less:

* (A) a host bf16 copy of each master, refreshed when the master changes (after the
  optimizer step, ``bf16.copy_(master)``): 2 bytes/param over the link per pass, 2 bytes/param
  more host RAM, one cast per parameter per optimizer step.
* (B) the carry-bit transport (`carry_encode`, `carry_decode`): the upper 16 bits of each
  master (2 bytes/param) and one bit-packed carry bit per parameter (1/8 byte/param) that
  says whether rounding takes the upper half up; the device adds the carry to the upper
  half. 2.125 bytes/param over the link, no extra host RAM, but the host encodes per pass
  (forward and backward each, every micro-batch).

For comparison the byte table adds (C), not one of the two candidates: the same cast as
(A) run per pass into a staging buffer of the block in flight (the size (B) needs for its
upper halves), so its host time per pass is (A)'s refresh time.

Timed on the CPU with torch only (vectorized tensor operations, a Python loop over a block's
parameter tensors, never over elements), with as many threads as this process may use: the
median of several repeats after a warm-up. (B)'s decode is what a device would run; here it
runs on the CPU as a stand-in, and its times say nothing about a GPU's. Before timing, the
script checks that (B) gives the cast's bits exactly, on edge cases and random bits, and on
every timed block.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil
import torch

from perf.harness import cpu_model

# Bit i of carry byte j is the carry of element 8 j + i.
SHIFTS = torch.arange(8, dtype=torch.uint8)


def carry_bytes(numel: int) -> int:
    """Bytes of bit-packed carries for ``numel`` parameters: one bit each, rounded up."""
    return (numel + 7) // 8


def carry_encode(master: torch.Tensor, upper_out: torch.Tensor, carry_out: torch.Tensor) -> None:
    """Split a contiguous fp32 ``master`` into what the link carries: its upper 16 bits
    (``upper_out``, int16, ``master.numel()`` entries) and one carry bit per entry, packed
    eight to a byte (``carry_out``, uint8, ``carry_bytes(master.numel())`` entries).

    The bit arithmetic, on ``bits = master.view(torch.int32)`` (a view, no copy):

    * ``bits >> 16`` (arithmetic shift) is in int16's range and its two's-complement low 16
      bits are the fp32's upper half: sign, the 8 exponent bits, the 7 upper mantissa bits,
      exactly a bf16 truncated towards zero. Copied into ``upper_out``.
    * ``lower = bits & 0xFFFF`` is the dropped half, ``lsb = (bits >> 16) & 1`` the kept
      half's lowest bit. Round to nearest even rounds the magnitude up when ``lower >
      0x8000`` (above half way) or ``lower == 0x8000`` and ``lsb == 1`` (a tie, the kept half
      odd), which is ``lower + lsb > 0x8000`` (the same test as c10's ``bits + 0x7FFF + lsb``
      carrying into bit 16). A carry out of the mantissa into the exponent is right: the
      largest finite values round to inf, the largest subnormal to the smallest normal.
    * NaN (exponent all ones, mantissa not zero) must stay NaN, whatever it rounds to: an
      upper half with mantissa zero (``0x7F80``, ``0xFF80``: the payload is all in the lower
      half) would decode as inf, and ``0x7FFF + 1``, ``0xFFFF + 1`` wrap to -0 and +0. So a
      NaN's carry is 1 exactly when its upper half's mantissa (``bits & 0x7F0000``) is zero:
      it then decodes to ``0x7F81``/``0xFF81``, otherwise to its upper half, a NaN either
      way; its payload may differ from the cast's. No sum ``upper + carry`` overflows int16.
      Finding NaNs costs a pass (``isnan``), so it runs only when ``master.sum()`` is not
      finite: any NaN makes the sum NaN (an inf or an overflowing sum only costs the look).
    * Packing: the carries are computed as bools (bytes 0 or 1) into a buffer padded with
      zeros to a multiple of 8, viewed as int64 words of 8 bytes, byte k (bits 8k..8k+7,
      little-endian) holding the carry of element 8j+k. ``x |= x >> 7`` puts byte k+1's bit
      next to byte k's (bits 0-1 of each byte), ``x |= x >> 14`` brings bits 0-1 of byte k+2
      to bits 2-3, ``x |= x >> 28`` bits 0-3 of byte k+4 to bits 4-7, so byte 0 of each word
      holds its 8 carries, element 8j+i at bit i: ``x & 0xFF`` goes to ``carry_out[j]``. The
      words stay below 2**63 (each byte holds at most 0xFF, the top one at most 1): the
      shifts never see a sign bit.
    """
    if sys.byteorder != "little":
        raise RuntimeError("carry_encode reads int32 and int64 views: little-endian only")
    flat = master.reshape(-1)
    if master.dtype != torch.float32 or not master.is_contiguous():
        raise ValueError("master must be a contiguous float32 tensor")
    n = flat.numel()
    bits = flat.view(torch.int32)
    high = bits >> 16
    upper_out.view(-1).copy_(high)
    lower = bits & 0xFFFF
    lower += high.bitwise_and_(1)  # high is now lsb
    padded = torch.empty(8 * carry_bytes(n), dtype=torch.bool)
    padded[n:] = False
    carry = padded[:n]
    torch.gt(lower, 0x8000, out=carry)
    if not torch.isfinite(flat.sum()):  # a NaN makes the sum NaN; inf or overflow: a look
        nan = flat.isnan()
        carry[nan] = (bits[nan] & 0x7F0000) == 0
    words = padded.view(torch.uint8).view(torch.int64)
    words |= words >> 7
    words |= words >> 14
    words |= words >> 28
    carry_out.copy_(words & 0xFF)


def carry_decode(upper: torch.Tensor, carry: torch.Tensor, out: torch.Tensor) -> None:
    """What the device runs: the bf16 bits of ``out`` (contiguous, ``upper.numel()``
    entries) = ``upper`` (int16) + the unpacked carry bit of each entry.

    ``carry.unsqueeze(1) >> [0..7] & 1`` unpacks byte j into the 8 carries of elements
    8j..8j+7 (bit i of byte j is element 8j+i's carry, as `carry_encode` packs them); the
    padding past ``upper.numel()`` is dropped. The sum is done in int16 on the bf16's bits
    (``out.view(torch.int16)``): adding 1 to a bf16's bits is taking its magnitude to the
    next representable value (mantissa 0x7F + 1 carries into the exponent, 0x7F7F + 1 is
    inf), with the sign untouched; `carry_encode` never sets a carry that would wrap.
    """
    n = upper.numel()
    bits = (carry.unsqueeze(1) >> SHIFTS.to(carry.device)) & 1
    torch.add(upper.reshape(-1), bits.view(-1)[:n], out=out.view(-1).view(torch.int16))


def carry_roundtrip(master: torch.Tensor) -> torch.Tensor:
    """``master`` through `carry_encode` and `carry_decode` into a new bf16 tensor."""
    upper = torch.empty(master.shape, dtype=torch.int16)
    carry = torch.empty(carry_bytes(master.numel()), dtype=torch.uint8)
    carry_encode(master, upper, carry)
    out = torch.empty(master.shape, dtype=torch.bfloat16)
    carry_decode(upper, carry, out)
    return out


# ---------------------------------------------------------------------------------------
# Exactness


def _bits(values: Sequence[int]) -> torch.Tensor:
    """fp32 tensor from unsigned 32-bit patterns."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def edge_case_bits() -> dict[str, torch.Tensor]:
    """fp32 bit patterns (int32) where rounding to bf16 is easy to get wrong, by kind; both
    signs of each."""
    g = torch.Generator().manual_seed(51)
    # upper halves: both parities, normal, subnormal and the largest finite, in range
    uppers = torch.cat(
        [
            torch.tensor([0x0000, 0x0001, 0x007E, 0x007F, 0x0080, 0x0081, 0x3F80, 0x3F81]),
            torch.tensor([0x7F7E, 0x7F7F]),
            torch.randint(0, 0x7F80, (64,), generator=g),
        ]
    ).to(torch.int32)
    lowers = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0x0001, 0xFFFF], dtype=torch.int32)
    around = (uppers.unsqueeze(1) << 16 | lowers).reshape(-1)
    subnormal = torch.randint(1, 0x00800000, (256,), generator=g, dtype=torch.int32)
    kinds = {
        "ties and neighbours (lower 16 bits 0x8000, 0x7FFF, 0x8001, 0, 1, 0xFFFF)": around,
        "subnormals": torch.cat([subnormal, _bits([1, 0x8000, 0x18000, 0x7FFFFF, 0x7F8000])]),
        "+/-inf, largest finite (some round to inf)": _bits(
            [0x7F800000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F7F8001, 0x7F7E8000]
        ),
        "zeros": _bits([0]),
    }
    return {kind: torch.cat([b, b | _bits([0x80000000])]) for kind, b in kinds.items()}


def nan_bits() -> torch.Tensor:
    """NaN patterns, both signs: quiet, signalling, payload in either half or both."""
    b = _bits([0x7FC00000, 0x7F800001, 0x7F808000, 0x7F80FFFF, 0x7FFFFFFF, 0x7FFF8000, 0x7FA00000])
    return torch.cat([b, b | _bits([0x80000000])])


def random_bits(seed: int, numel: int) -> torch.Tensor:
    """Uniformly random 32-bit patterns (about 0.4% NaN) and normal weights at several
    scales, as int32."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**31), 2**31, (numel,), generator=g, dtype=torch.int32)
    scales = torch.tensor([1e-30, 1e-3, 0.02, 1.0, 1e30]).repeat_interleave(numel // 5 + 1)
    weights = torch.randn(scales.numel(), generator=g) * scales
    return torch.cat([raw, weights.view(torch.int32)])


def mismatches(bits: torch.Tensor) -> int:
    """Entries of fp32 patterns ``bits`` where (B) differs from PyTorch's cast: the bits of
    a non-NaN value, the NaN-ness of a NaN."""
    master = bits.view(torch.float32)
    cast, carried = master.to(torch.bfloat16), carry_roundtrip(master)
    nan = master.isnan()
    differ = cast.view(torch.int16) != carried.view(torch.int16)
    return int((differ & ~nan).sum()) + int((carried.isnan() != nan).sum())


def hex16(t: torch.Tensor) -> str:
    """The distinct 16-bit patterns of a bf16 tensor, in hex."""
    return ", ".join(sorted({f"0x{v & 0xFFFF:04X}" for v in t.view(torch.int16).tolist()}))


def exactness_report() -> list[str]:
    """Lines saying that (A) and (B) equal the cast bit for bit; raises if one does not."""
    lines, values, nans = [], 0, 0
    cases = {**edge_case_bits(), **{f"random seed {s}": random_bits(s, 1 << 16) for s in range(4)}}
    for kind, bits in cases.items():
        master = bits.view(torch.float32)
        copy_a = torch.empty(master.shape, dtype=torch.bfloat16).copy_(master)
        cast = master.to(torch.bfloat16)
        bad_a = int((copy_a.view(torch.int16) != cast.view(torch.int16)).sum())
        bad_b = mismatches(bits)
        if bad_a or bad_b:
            raise AssertionError(f"{kind}: (A) {bad_a}, (B) {bad_b} values differ from the cast")
        values += bits.numel()
        nans += int(master.isnan().sum())
        lines.append(f"  {kind}: {bits.numel()} values, (A) and (B) equal the cast")
    special = nan_bits().view(torch.float32)
    cast, carried = special.to(torch.bfloat16), carry_roundtrip(special)
    if not bool(carried.isnan().all()):
        raise AssertionError("(B) turned a NaN into a number")
    lines += [
        f"  in all {values - nans} non-NaN values bit for bit (int16 views), and the {nans} "
        "random NaNs decode to NaN",
        f"  NaN ({special.numel()} patterns, both signs): PyTorch's CPU cast gives "
        f"{hex16(cast)}; (B) gives {hex16(carried)}",
        "  all NaN: NaN payloads may differ between (B) and the cast; (A)'s are the cast's",
    ]
    return lines


# ---------------------------------------------------------------------------------------
# Timing


@dataclass(frozen=True)
class BlockShape:
    name: str
    shapes: tuple[tuple[int, ...], ...]  # one per parameter tensor
    repeats: int

    @property
    def numel(self) -> int:
        return sum(torch.Size(s).numel() for s in self.shapes)


def gpt_block(d: int) -> tuple[tuple[int, ...], ...]:
    """A GPT-2 style block (TinyGPT's too): LayerNorms, qkv and projection, 4x MLP, biases."""
    attention = ((d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,))
    mlp = ((d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,))
    return (*attention, *mlp)


def llama_block(d: int, ffn: int) -> tuple[tuple[int, ...], ...]:
    """A Llama block: RMSNorm weights, q/k/v/o without bias, gated MLP without bias."""
    return ((d,), (d, d), (d, d), (d, d), (d, d), (d,), (ffn, d), (ffn, d), (d, ffn))


BLOCKS = (
    BlockShape("TinyGPT-like (d=96)", gpt_block(96), repeats=101),
    BlockShape("GPT-2-small (d=768)", gpt_block(768), repeats=21),
    BlockShape("Llama-7B-like (d=4096, ffn 11008)", llama_block(4096, 11008), repeats=7),
)


def bytes_needed(block: BlockShape) -> int:
    """Host RAM the timing of ``block`` holds at once, with margin: the masters (4 B/param),
    (A)'s copy, (B)'s upper halves and decoded output (2 each), the carries, and the
    temporaries of one encode of the largest tensor (about 24 B/param)."""
    largest = max(torch.Size(s).numel() for s in block.shapes)
    return int(10.2 * block.numel + 24 * largest) + (512 << 20)


def median_ms(action: Callable[[], None], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        action()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@dataclass(frozen=True)
class BlockTimes:
    block: BlockShape
    refresh_ms: float  # (A): bf16.copy_(master), per optimizer step
    encode_ms: float  # (B): carry_encode, per pass
    decode_ms: float  # (B): carry_decode on the CPU, a stand-in for the device's


@dataclass(frozen=True)
class Buffers:
    """One parameter's host buffers: its master, (A)'s bf16 copy, (B)'s upper halves and
    carries, and (B)'s decoded bf16."""

    master: torch.Tensor
    bf16: torch.Tensor
    upper: torch.Tensor
    carry: torch.Tensor
    decoded: torch.Tensor

    @classmethod
    def random(cls, shape: tuple[int, ...], g: torch.Generator) -> Buffers:
        return cls(
            torch.randn(shape, generator=g) * 0.02,
            torch.empty(shape, dtype=torch.bfloat16),
            torch.empty(shape, dtype=torch.int16),
            torch.empty(carry_bytes(torch.Size(shape).numel()), dtype=torch.uint8),
            torch.empty(shape, dtype=torch.bfloat16),
        )


def time_block(block: BlockShape, repeats: int, seed: int = 0) -> BlockTimes:
    g = torch.Generator().manual_seed(seed)
    params = [Buffers.random(shape, g) for shape in block.shapes]

    def refresh() -> None:
        for p in params:
            p.bf16.copy_(p.master)

    def encode() -> None:
        for p in params:
            carry_encode(p.master, p.upper, p.carry)

    def decode() -> None:
        for p in params:
            carry_decode(p.upper, p.carry, p.decoded)

    times = BlockTimes(
        block,
        refresh_ms=median_ms(refresh, repeats),
        encode_ms=median_ms(encode, repeats),
        decode_ms=median_ms(decode, repeats),
    )
    for p in params:  # the timed buffers: (B) decoded what (A) cast
        if not torch.equal(p.bf16.view(torch.int16), p.decoded.view(torch.int16)):
            raise AssertionError(f"{block.name}: (B) differs from the cast")
    return times


# ---------------------------------------------------------------------------------------
# Report


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def timing_table(rows: Sequence[BlockTimes]) -> list[str]:
    lines = [
        "| block | params | (A) refresh cast, ms per optimizer step | (B) encode, ms per pass "
        "| (B) encode / (A) refresh | (B) encode output, GB/s "
        "| (B) decode, ms per pass (CPU stand-in for the device) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r.block.numel
        link_gbs = (2 * n + carry_bytes(n)) / (r.encode_ms * 1e-3) / 1e9
        lines.append(
            f"| {r.block.name} | {n / 1e6:.3f}M | {r.refresh_ms:.3f} | {r.encode_ms:.3f} "
            f"| {r.encode_ms / r.refresh_ms:.1f}x | {link_gbs:.3g} | {r.decode_ms:.3f} |"
        )
    return lines


TRANSPORTS = (
    # name, link bytes/param per pass, extra host bytes/param, host CPU work
    ("fp32 master (today)", 4.0, "0", "none"),
    ("(A) host bf16 copy", 2.0, "2", "one cast per param per optimizer step"),
    ("(B) carry bits", 2.125, "0", "one encode per param per pass"),
    ("(C) cast per pass (not asked; for comparison)", 2.0, "0", "one cast per param per pass"),
)


def bytes_table(blocks: Sequence[BlockShape]) -> list[str]:
    head = "".join(f" link MB per pass, {b.name} |" for b in blocks)
    lines = [
        "| transport | link bytes/param per pass | extra host bytes/param | host CPU work |" + head,
        "|---|---:|---:|---|" + "---:|" * len(blocks),
    ]
    for name, link, host, work in TRANSPORTS:
        per_block = "".join(f" {link * b.numel / 1e6:.2f} |" for b in blocks)
        lines.append(f"| {name} | {link:g} | {host} | {work} |" + per_block)
    return lines


NOTES = """\
A pass is a forward or a backward: (B) encodes twice per micro-batch, so an optimizer step
of k micro-batches costs the host 2k encodes against (A)'s one refresh cast. Encode output
GB/s: the link bytes (2.125/param) (B)'s encode produces per second of host time; below
the link's rate, the host CPU and not the link bounds (B). (B)'s decode ran on this CPU as
a stand-in for the device (unpack the bits, add, view as bf16); every timed block's decode
equalled (A)'s cast bit for bit. (C): the cast (A) times, run per pass into a staging
buffer of the block in flight, the size (B) needs for its upper halves: host time per pass
= (A)'s refresh column, 2 bytes/param over the link, no per-parameter host RAM."""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the two small blocks, fewer repeats")
    args = parser.parse_args(argv)

    cores = usable_cores()
    torch.set_num_threads(cores)
    print(f"# bf16 transport from fp32 host masters ({'quick' if args.quick else 'full'} run)")
    print(
        f"machine: {cpu_model()}, {cores} cores usable ({os.cpu_count()} online), "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}), "
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
        f"1-min load {os.getloadavg()[0]:.2f}"
    )
    print("\nexactness, against master.to(torch.bfloat16):")
    print("\n".join(exactness_report()))

    blocks = BLOCKS[:2] if args.quick else BLOCKS
    rows, skipped = [], []
    for block in blocks:
        need, free = bytes_needed(block), psutil.virtual_memory().available
        if need > free:
            skipped.append(
                f"{block.name}: needs about {need / 2**30:.1f} GiB of host RAM, "
                f"{free / 2**30:.1f} GiB available"
            )
            continue
        repeats = max(3, block.repeats // 4) if args.quick else block.repeats
        rows.append(time_block(block, repeats))
    print(f"\nhost CPU time per block, median of repeats after 2 warm-ups ({cores} threads):\n")
    print("\n".join(timing_table(rows)))
    for line in skipped:
        print(f"skipped {line}")
    print("\n" + NOTES + "\n")
    print("\n".join(bytes_table([r.block for r in rows])))


if __name__ == "__main__":
    main()
