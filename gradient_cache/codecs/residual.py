"""How an error-feedback residual is stored between steps: fp32, bf16 or int8."""

from __future__ import annotations

import torch

from .generators import DeviceGenerators
from .int8_kernels import chunks, int8_blocks_bytes, int8_blocks_decode, int8_blocks_encode

RESIDUAL_DTYPES = ("float32", "bfloat16", "int8")


class ResidualCodec:
    """A residual's stored form: computed in fp32, stored as one flat tensor (``stored_shape``).

    ``"float32"`` as it is (4 bytes an entry); ``"bfloat16"`` rounded stochastically
    (2 bytes); ``"int8"`` as blocks of `int8_kernels.INT8_BLOCK` entries, each an int8 code times
    the block's fp32 scale (its largest magnitude / 127), rounded stochastically, packed
    with the scales into one uint8 tensor (1.0625 bytes). Stochastic rounding keeps the
    stored residual unbiased: ``E[decode(encode(x))] == x``, so what compression holds back
    drifts by no systematic amount, however small each step's addition is.
    Error bounds per entry: bf16 below one bf16 unit in the last place of the entry,
    int8 below its block's scale.

    Random draws come from the codec's own generator (seeded), never the global one.
    """

    def __init__(self, dtype: str, *, seed: int = 0) -> None:
        if dtype not in RESIDUAL_DTYPES:
            raise ValueError(
                f"Invalid residual_dtype: {dtype!r}; expected one of {list(RESIDUAL_DTYPES)}."
            )
        self.dtype = dtype
        self.generators = DeviceGenerators(seed)

    def stored_shape(self, numel: int) -> tuple[int, torch.dtype]:
        """(numel, dtype) of the flat tensor that stores a residual of ``numel`` entries."""
        if self.dtype == "float32":
            return numel, torch.float32
        if self.dtype == "bfloat16":
            return numel, torch.bfloat16
        return int8_blocks_bytes(numel), torch.uint8

    def stored_bytes(self, numel: int) -> int:
        count, dtype = self.stored_shape(numel)
        return count * dtype.itemsize

    def zeros(self, numel: int, device: torch.device) -> torch.Tensor:
        count, dtype = self.stored_shape(numel)
        return torch.zeros(count, dtype=dtype, device=device)  # all-zero bytes decode to 0

    def decode(self, stored: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 residual, always a new tensor (the caller may write to it)."""
        if self.dtype == "float32":
            return stored.clone()
        if self.dtype == "bfloat16":
            return stored.float()
        return int8_blocks_decode(stored, numel)

    def encode(self, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` (flat fp32, which this may overwrite) in its stored form."""
        if self.dtype == "float32":
            return residual
        if self.dtype == "int8":
            return int8_blocks_encode(residual, self.generators)
        # Adding uniform noise below the 16 bits bf16 drops, then truncating, rounds up
        # with probability equal to the dropped fraction (on the magnitude: the sign bit
        # is untouched, so negative values round without bias too).
        bits = residual.view(torch.int32)
        for start, stop in chunks(residual.numel()):
            noise = self.generators.uniform_like(bits[start:stop]).mul_(65536)
            bits[start:stop].add_(noise.to(torch.int32)).bitwise_and_(-65536)
        return residual.to(torch.bfloat16)  # exact: the low 16 bits are zero
