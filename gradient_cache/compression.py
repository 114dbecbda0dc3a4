"""Gradient codecs: top-k sparsification (exact or threshold) with error feedback.

A codec turns a flat gradient into a payload (`DensePayload` or `SparsePayload`) and back.
Everything here is plain tensor code that runs on whatever device its input lives on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# The threshold selection accepts a kept count within this band around the wanted count.
THRESHOLD_TOLERANCE = 0.10
# Sampled entries expected above the threshold: ~200 gives a count error of about 7%;
# the correction passes catch the rest.
_SAMPLE_HITS = 200
_MIN_SAMPLE = 1 << 13
SELECTIONS = ("threshold", "exact")
# Signed integers of each float width, to compare magnitudes by their bit patterns.
_BITS_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements per |x| pass of the threshold selection on a CPU (1 MiB of fp32).
_CPU_CHUNK = 1 << 18
# Up to this kept fraction, scanning the mask word by word first pays (`_true_positions`):
# 1.8x faster than torch.nonzero at 1%, 1.6x slower at 10% (16M elements).
_WORD_SCAN_MAX_DENSITY = 1 / 25


@dataclass
class DensePayload:
    """A whole gradient, kept as it is."""

    tensor: torch.Tensor  # flat, the gradient's dtype

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class SparsePayload:
    """Selected entries of a flat gradient: ``dense[indices] = values``, zero elsewhere."""

    values: torch.Tensor  # [k], the gradient's dtype
    indices: torch.Tensor  # [k], int32 where the tensor allows, else int64; unique
    numel: int

    @property
    def nbytes(self) -> int:
        return (
            self.values.numel() * self.values.element_size()
            + self.indices.numel() * self.indices.element_size()
        )


@dataclass
class QuantizedPayload:
    """Kept entries stored as int8 codes with a per-block scale (`int8_blocks_encode`).

    ``indices`` None: every entry, in order (a dense gradient); else as `SparsePayload`.
    """

    packed: torch.Tensor  # uint8: `int8_blocks_encode` of the kept values
    indices: torch.Tensor | None
    numel: int
    count: int  # values packed
    dtype: torch.dtype  # the gradient's

    @property
    def nbytes(self) -> int:
        index_bytes = (
            0 if self.indices is None else self.indices.numel() * self.indices.element_size()
        )
        return self.packed.numel() + index_bytes


Payload = DensePayload | SparsePayload | QuantizedPayload


class DeviceGenerators:
    """One seeded generator per device, so random draws never touch the global RNG."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def uniform_like(self, x: torch.Tensor) -> torch.Tensor:
        """Uniform noise in [0, 1) shaped like ``x``, on its device, in fp32."""
        return torch.rand(x.shape, generator=self(x.device), device=x.device)

    def get_state(self, device: torch.device) -> torch.Tensor | None:
        """``device``'s generator state (a CPU uint8 tensor); None if nothing drew there."""
        generator = self._generators.get(device)
        return None if generator is None else generator.get_state()

    def set_state(self, device: torch.device, state: torch.Tensor | None) -> None:
        """Put back what `get_state` returned; None: as new, from the seed."""
        self._generators.pop(device, None)
        if state is not None:
            self(device).set_state(state)


def keep_count(numel: int, ratio: float) -> int:
    """How many entries ratio ``ratio`` keeps of ``numel``: ``ceil(numel / ratio)``.

    The tiny shrink keeps float noise (1 / (1 - 0.99) is 99.999...) from adding one.
    """
    return max(1, min(numel, math.ceil(numel / ratio * (1 - 1e-12))))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


class TopKSelector:
    """Picks the indices of the largest-magnitude entries of a flat tensor.

    Holds reusable scratch buffers (allocating 64 MB afresh costs more than the
    selection itself on a CPU) until `release_scratch()`, and a seeded generator, so
    one selector must not be used from two threads at once.
    """

    def __init__(self, *, method: str, seed: int = 0) -> None:
        if method not in SELECTIONS:
            raise ValueError(f"Invalid selection: {method!r}; expected one of {list(SELECTIONS)}.")
        self.method = method
        self.generators = DeviceGenerators(seed)
        self._abs_buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._mask_buffers: dict[torch.device, torch.Tensor] = {}

    def select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Int64 indices of about ``k`` largest |entries|.

        NaN and inf rank above every finite magnitude, so if ``flat`` holds any, at least
        one of them is among the indices: callers detect non-finite input by checking
        the selected values alone.
        """
        if self.method == "threshold" and flat.numel() > 2 * self._sample_size(flat.numel(), k):
            indices = self._threshold(flat, k)
            if indices is not None:
                return indices
        return torch.topk(flat.abs(), k, sorted=False).indices  # ranks NaN above inf

    def scratch_tensors(self) -> list[torch.Tensor]:
        """The scratch buffers held between calls (memory accounting counts them)."""
        return [*self._abs_buffers.values(), *self._mask_buffers.values()]

    def release_scratch(self) -> None:
        """Drop the scratch buffers (the engine does after each backward's last bucket)."""
        self._abs_buffers.clear()
        self._mask_buffers.clear()

    def _threshold(self, flat: torch.Tensor, k: int) -> torch.Tensor | None:
        """Threshold from a random sample, corrected until the count is within tolerance.

        Returns None when it cannot bracket ``k`` (exact selection then takes over).
        """
        n = flat.numel()
        low = math.floor(k * (1 - THRESHOLD_TOLERANCE))
        high = math.ceil(k * (1 + THRESHOLD_TOLERANCE))
        sample_size = self._sample_size(n, k)
        positions = torch.randint(
            n, (sample_size,), generator=self.generators(flat.device), device=flat.device
        )
        sample = flat.index_select(0, positions).abs_()  # index_select: ~2x faster than []
        if not bool(sample.amax() < math.inf):  # amax propagates NaN
            return positions[~torch.isfinite(sample)].unique()  # non-finite: they must be kept
        expected_hits = k * sample_size / n
        # First aim at k, then at 2k if too few were found; trimming handles too many.
        for widen in (1, 2):
            hits = min(sample_size, max(1, round(widen * expected_hits)))
            # The hits-th largest sampled magnitude: topk(hits) is ~2x faster than kthvalue
            # on 20k samples and ~7x on 200k (ratio 1000).
            threshold = torch.topk(sample, hits).values[-1]
            indices = self._at_least(
                flat, threshold, word_scan=hits <= sample_size * _WORD_SCAN_MAX_DENSITY
            )
            if indices.numel() > high:
                # Trim to exactly k; topk keeps any NaN or inf among the candidates.
                candidates = flat.index_select(0, indices).abs_()
                return indices.index_select(0, torch.topk(candidates, k, sorted=False).indices)
            if indices.numel() >= low:
                return indices
        return None

    def _at_least(
        self, flat: torch.Tensor, threshold: torch.Tensor, *, word_scan: bool
    ) -> torch.Tensor:
        """Indices of the entries with ``|x| >= threshold``, and of any NaN."""
        n = flat.numel()
        # On a CPU |x| is taken a chunk at a time: the chunk is still in cache when it is
        # compared, and the |x| scratch stays at 1 MiB whatever the tensor's size.
        # Elsewhere each chunk costs kernel launches, so one pass takes the whole tensor.
        chunk = min(n, _CPU_CHUNK) if flat.device.type == "cpu" else n
        magnitude = self._scratch(self._abs_buffers, (flat.dtype, flat.device), flat, chunk)
        # Non-negative floats order like their bit patterns, and NaN's bits sort above inf's:
        # one integer `>=` keeps NaN as well as every entry >= t, so no bad value hides.
        bits = magnitude.view(_BITS_DTYPES[flat.element_size()])
        limit = threshold.view(bits.dtype)
        # The mask is padded to whole 8-byte words for `_true_positions`; the pad stays False.
        padded = -(-n // 8) * 8
        mask = self._scratch(self._mask_buffers, flat.device, flat, padded, dtype=torch.bool)
        mask[n:].zero_()
        for part, part_mask in zip(flat.split(chunk), mask[:n].split(chunk), strict=True):
            size = part.numel()
            torch.abs(part, out=magnitude[:size])
            torch.ge(bits[:size], limit, out=part_mask)
        return _true_positions(mask) if word_scan else torch.nonzero(mask[:n]).squeeze(1)

    @staticmethod
    def _sample_size(n: int, k: int) -> int:
        return min(n, max(_MIN_SAMPLE, math.ceil(_SAMPLE_HITS * n / k)))

    @staticmethod
    def _scratch(
        cache: dict,
        key: object,
        like: torch.Tensor,
        numel: int | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        numel = like.numel() if numel is None else numel
        buffer = cache.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype or like.dtype, device=like.device)
            cache[key] = buffer
        return buffer[:numel]


def _true_positions(mask: torch.Tensor) -> torch.Tensor:
    """Indices of the True entries of a sparse bool mask whose length is a multiple of 8.

    torch.nonzero's cost grows with its input; scanning 8-byte words first and then only
    the bytes of the words that hold a True is about twice as fast at 1% density.
    """
    words = mask.view(torch.int64)
    hit_words = torch.nonzero(words).squeeze(1)
    hit_bytes = torch.nonzero(words.index_select(0, hit_words).view(torch.uint8)).squeeze(1)
    return hit_words.index_select(0, hit_bytes >> 3) * 8 + (hit_bytes & 7)


RESIDUAL_DTYPES = ("float32", "bfloat16", "int8")
# Entries per scale of the int8 residual: 64 keeps the scales at 1/16 of the int8 bytes.
INT8_BLOCK = 64
# Entries the residual and value codecs work on at a time (a multiple of INT8_BLOCK): their
# fp32 temporaries stay within a few MiB of device memory however large the tensor.
CODEC_CHUNK = 1 << 20


def int8_blocks_bytes(numel: int) -> int:
    """Bytes of `int8_blocks_encode`'s output: a code per entry in whole blocks, a scale each."""
    blocks = -(-numel // INT8_BLOCK)
    return blocks * INT8_BLOCK + 4 * blocks


def _chunks(numel: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive `CODEC_CHUNK`-entry slices covering ``numel`` entries."""
    for start in range(0, numel, CODEC_CHUNK):
        yield start, min(start + CODEC_CHUNK, numel)


def int8_blocks_encode(x: torch.Tensor, generators: DeviceGenerators) -> torch.Tensor:
    """Flat fp32 ``x`` as int8 codes per block of `INT8_BLOCK`, times the block's scale.

    The scale is the block's largest magnitude / 127; uniform noise from ``generators``
    rounds each code stochastically, so decoding is unbiased and off by less than the
    scale. Codes and fp32 scales are packed into one uint8 tensor. Works through ``x`` a
    chunk at a time, so its fp32 temporaries stay a few MiB however large ``x`` is.
    """
    numel = x.numel()
    blocks = -(-numel // INT8_BLOCK)
    packed = torch.empty(int8_blocks_bytes(numel), dtype=torch.uint8, device=x.device)
    codes = packed[: blocks * INT8_BLOCK].view(torch.int8)
    scales = packed[blocks * INT8_BLOCK :].view(torch.float32)
    for start, stop in _chunks(numel):
        part_blocks = -(-(stop - start) // INT8_BLOCK)
        padded = torch.nn.functional.pad(
            x[start:stop], (0, part_blocks * INT8_BLOCK - stop + start)
        )
        padded = padded.view(part_blocks, INT8_BLOCK)  # a copy: free to scale in place
        part_scales = padded.abs().amax(dim=1).div_(127)
        safe = torch.where(part_scales > 0, part_scales, torch.ones_like(part_scales))
        # |x / s| <= 127 and noise < 1, so floor stays within [-127, 127].
        padded.div_(safe.unsqueeze(1)).add_(generators.uniform_like(padded)).floor_()
        codes[start : start + padded.numel()].copy_(padded.view(-1))
        scales[start // INT8_BLOCK : start // INT8_BLOCK + part_blocks].copy_(part_scales)
    return packed


def int8_blocks_decode(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values `int8_blocks_encode` packed (a new tensor), a chunk at a time."""
    blocks = -(-numel // INT8_BLOCK)
    codes = packed[: blocks * INT8_BLOCK].view(torch.int8)
    scales = packed[blocks * INT8_BLOCK :].view(torch.float32)
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    for start, stop in _chunks(numel):
        part_blocks = -(-(stop - start) // INT8_BLOCK)
        part = codes[start : start + part_blocks * INT8_BLOCK].view(part_blocks, INT8_BLOCK)
        part_scales = scales[start // INT8_BLOCK : start // INT8_BLOCK + part_blocks]
        out[start:stop] = (part.float() * part_scales.unsqueeze(1)).view(-1)[: stop - start]
    return out


class ResidualCodec:
    """How an error-feedback residual is stored between steps: fp32, bf16 or int8.

    The residual is computed in fp32 and stored as one flat tensor (``stored_shape``):
    ``"float32"`` as it is (4 bytes an entry); ``"bfloat16"`` rounded stochastically
    (2 bytes); ``"int8"`` as blocks of `INT8_BLOCK` entries, each an int8 code times the
    block's fp32 scale (its largest magnitude / 127), rounded stochastically, packed with
    the scales into one uint8 tensor (1.0625 bytes). Stochastic rounding keeps the stored
    residual unbiased: ``E[decode(encode(x))] == x``, so what compression holds back
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
        return count * torch.empty((), dtype=dtype).element_size()

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
        for start, stop in _chunks(residual.numel()):
            noise = self.generators.uniform_like(bits[start:stop]).mul_(65536)
            bits[start:stop].add_(noise.to(torch.int32)).bitwise_and_(-65536)
        return residual.to(torch.bfloat16)  # exact: the low 16 bits are zero


class Int8Quantizer:
    """Stores a payload's values as `int8_blocks_encode` codes: about a quarter of fp32.

    Rounding is stochastic (unbiased), from the quantizer's own seeded generator.
    """

    def __init__(self, *, seed: int = 0) -> None:
        self.generators = DeviceGenerators(seed)

    def quantize(self, payload: DensePayload | SparsePayload) -> QuantizedPayload:
        if isinstance(payload, DensePayload):
            values, indices, numel = payload.tensor, None, payload.tensor.numel()
        else:
            values, indices, numel = payload.values, payload.indices, payload.numel
        packed = int8_blocks_encode(values.float(), self.generators)
        return QuantizedPayload(packed, indices, numel, values.numel(), values.dtype)


class TopKEncoder:
    """Encodes flat gradients at a fixed ratio, with optional error feedback.

    Error feedback keeps, per tensor, the residual ``r``: each step encodes ``g + r`` and
    sets ``r`` to what was not sent, so what is delivered plus the new residual always
    equals the gradients seen plus the old residual (exactly in fp32; on average with a
    bf16 or int8 residual, whose rounding is stochastic). NaN and inf outrank every
    finite magnitude, so they are always kept and delivered (GradScaler sees them and
    skips the step); they reset that tensor's residual to zero.
    """

    def __init__(
        self,
        *,
        ratio: float,
        selection: str,
        residual_dtype: str = "float32",
        seed: int = 0,
    ) -> None:
        self.ratio = ratio
        self.selector = TopKSelector(method=selection, seed=seed)
        self.residual_codec = ResidualCodec(residual_dtype, seed=seed)

    def encode(
        self,
        flat: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        loss_scale: torch.Tensor | None = None,
    ) -> tuple[SparsePayload, torch.Tensor | None]:
        """The payload of ``flat`` (plus ``residual``, stored form) and the new residual.

        ``residual`` is read, never written: the new one is a fresh tensor, so a failure
        halfway (an out-of-memory error, say) leaves the old residual as it was.
        ``loss_scale`` (a GradScaler's current scale, a 0-dim tensor): ``flat`` is scaled
        by it, so the residual is kept unscaled, multiplied by the scale of the gradient
        it joins and divided by it again when stored. A scale change then leaves the
        held-back gradient's weight as it was.
        """
        k = keep_count(flat.numel(), self.ratio)
        source = flat
        if residual is not None:  # fp32, a new tensor
            source = self.residual_codec.decode(residual, flat.numel())
            if loss_scale is not None:
                source.mul_(loss_scale)
            source.add_(flat)
        indices = self.selector.select(source, k)
        selected = source.index_select(0, indices)
        values = selected.to(flat.dtype)
        payload = SparsePayload(values, indices.to(index_dtype(flat.numel())), flat.numel())
        if residual is None:
            return payload, None
        # What rounding to the gradient's dtype lost stays in the residual too.
        source.index_put_((indices,), selected - values.to(source.dtype))
        # Non-finite input is always among the selected entries (see `select`). Such a
        # step is skipped or ruined, so the residual restarts from zero. The 0-dim mask
        # stays on the device: no host sync, which would stall backward on a GPU.
        source.masked_fill_(~torch.isfinite(selected).all(), 0)
        if loss_scale is not None:
            source.div_(loss_scale)
        return payload, self.residual_codec.encode(source)


def kept_values(payload: Payload) -> torch.Tensor:
    """The values a payload keeps (decoded if quantized), in its indices' order."""
    if isinstance(payload, DensePayload):
        return payload.tensor
    if isinstance(payload, SparsePayload):
        return payload.values
    return int8_blocks_decode(payload.packed, payload.count).to(payload.dtype)


def entries_kept(payload: Payload) -> int:
    if isinstance(payload, DensePayload):
        return payload.tensor.numel()
    if isinstance(payload, SparsePayload):
        return payload.values.numel()
    return payload.count


def payload_tensors(payload: Payload) -> list[torch.Tensor]:
    """The tensors a payload is made of (what a copy reads, what memory accounting counts)."""
    if isinstance(payload, DensePayload):
        return [payload.tensor]
    if isinstance(payload, SparsePayload):
        return [payload.values, payload.indices]
    return [payload.packed] + ([] if payload.indices is None else [payload.indices])


def add_into(flat: torch.Tensor, payload: Payload) -> torch.Tensor:
    """``flat + payload`` (``payload`` on ``flat``'s device): in place if dense, else new.

    Gradient accumulation adds the cached payload into the next micro-batch's gradient.
    ``new + old`` gives the bits of plain PyTorch's ``old + new``: float addition commutes.
    """
    if isinstance(payload, DensePayload):
        return flat.add_(payload.tensor)
    values = kept_values(payload).to(flat.dtype)
    if payload.indices is None:
        return flat + values
    return flat.index_add(0, payload.indices.long(), values)


def fill_from(payload: Payload, out: torch.Tensor) -> torch.Tensor:
    """Overwrite the flat tensor ``out`` with ``payload``'s gradient.

    A dense payload may be in (pinned) host memory: the copy moves it. Any other must be
    on ``out``'s device already.
    """
    if isinstance(payload, DensePayload):
        return out.copy_(payload.tensor, non_blocking=True)
    values = kept_values(payload).to(out.dtype)
    if payload.indices is None:
        return out.copy_(values)
    # Indices are unique, so a copy does: 3x faster than index_add_ on a CPU.
    return out.zero_().index_copy_(0, payload.indices.long(), values)


def moved(payload: Payload, move: Callable[[torch.Tensor], torch.Tensor]) -> Payload:
    """``payload`` with ``move`` applied to each of its tensors."""
    if isinstance(payload, DensePayload):
        return DensePayload(move(payload.tensor))
    if isinstance(payload, SparsePayload):
        return SparsePayload(move(payload.values), move(payload.indices), payload.numel)
    indices = None if payload.indices is None else move(payload.indices)
    return dataclasses.replace(payload, packed=move(payload.packed), indices=indices)


class GradientCompressor:
    """Top-k compression of a single tensor, for use without the engine.

    ``GradientCompressor(sparsity=0.99)`` keeps the largest-magnitude 1% of entries.
    ``compress(grad)`` returns ``(values, indices)`` with int64 indices into the
    flattened tensor; ``decompress(values, indices, shape)`` rebuilds the dense tensor.
    """

    def __init__(self, sparsity: float = 0.99, *, selection: str = "exact") -> None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
            raise TypeError(f"sparsity must be a number in [0, 1), got {sparsity!r}.")
        if not 0 <= sparsity < 1:
            raise ValueError(
                f"Invalid sparsity: {sparsity!r}; expected 0 <= sparsity < 1 "
                "(0.99 keeps the largest 1% of entries)."
            )
        self.sparsity = float(sparsity)
        self._selector = TopKSelector(method=selection)

    def compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = grad.detach().reshape(-1)
        k = keep_count(flat.numel(), 1 / (1 - self.sparsity))
        indices = self._selector.select(flat, k)
        if not bool(torch.isfinite(flat[indices]).all()):
            # Non-finite entries: keep everything, so none is hidden from the caller.
            indices = torch.arange(flat.numel(), device=flat.device)
        return flat[indices], indices

    def decompress(
        self, values: torch.Tensor, indices: torch.Tensor, shape: torch.Size | tuple[int, ...]
    ) -> torch.Tensor:
        dense = torch.zeros(math.prod(shape), dtype=values.dtype, device=values.device)
        return dense.index_add_(0, indices.to(values.device), values).reshape(shape)
