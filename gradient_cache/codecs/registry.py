"""The one list of codec names: what each name builds, whether ``codec=None`` may choose
it, from what size a tensor takes it, and which options object configures it.

Everything that names codecs reads it: `EngineConfig(codec=...)`'s accepted names
(`CODEC_NAMES`), the ladder ``codec=None`` climbs (`LADDER`), the engine's codec instances
(`Codecs`), ``gradient-cache plan --codec`` and the tests. Adding a codec is a module with
its `Codec` subclass and one entry in `CODECS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import torch

from .base import Codec, shapes_bytes
from .block import BlockQuantized
from .dither import Dither, NoiseTables
from .generators import RandomSource
from .int8 import Int8Values
from .lossless import Lossless
from .options import Ladder, TopK
from .topk import TopKCodec

# Tensors smaller than this travel whole unless min_compress_numel says otherwise: one block
# of the block codecs and int8.
BLOCK_MIN_NUMEL = 128


@dataclass(frozen=True)
class CodecEntry:
    """One codec name.

    ``make(ratio, selection, options, seed)``: the working codec; ``selection`` is
    "threshold" or "exact" (the backend resolved "auto"); ``options`` is the codec's options
    object (None for the ladder's rung of a codec that has options: its defaults for a
    byte budget). ``ladder``: ``codec=None`` may choose it (the order of `CODECS` is the
    ladder's: best training first, each smaller than the one before). ``min_numel``: the
    default size from which a tensor takes it. ``options``: its options class, if any.
    ``block``: a block codec (`BlockQuantized`: every entry a low-bit code after a
    rotation, no residual).
    """

    make: Callable[..., Codec]
    ladder: bool
    min_numel: int = BLOCK_MIN_NUMEL
    options: type[TopK] | None = None
    block: bool = False


def _block(bits: int, rounding: str) -> Callable[..., Codec]:
    """Every entry a ``bits``-bit code after the randomised 128-point Hadamard rotation."""

    def make(name: str, *, seed: int = 0, **_: Any) -> Codec:
        return BlockQuantized(name=name, bits=bits, rotate=True, rounding=rounding, seed=seed)

    return make


def _topk(
    name: str, *, ratio: float, selection: str, options: TopK | None, seed: int = 0, **_: Any
) -> Codec:
    if options is None:  # the ladder's: as many entries as fit the byte budget, no residual
        return TopKCodec(
            ratio=ratio,
            selection=selection,
            error_feedback=False,
            residual_dtype=TopK().residual_dtype,
            int8_values=False,
            byte_budget=True,
            seed=seed,
        )
    return TopKCodec(
        ratio=ratio,
        selection=selection,
        error_feedback=options.error_feedback,
        residual_dtype=options.residual_dtype,
        int8_values=options.value_dtype == "int8",
        seed=seed,
    )


#: Every codec name ``EngineConfig(codec=...)`` accepts. The ladder's order is this order.
CODECS: dict[str, CodecEntry] = {
    "lossless": CodecEntry(lambda name, **_: Lossless(), ladder=False),
    "int8": CodecEntry(lambda name, *, seed=0, **_: Int8Values(seed=seed), ladder=True),
    "q4": CodecEntry(_block(4, "stochastic"), ladder=True, block=True),
    "q3": CodecEntry(_block(3, "stochastic"), ladder=True, block=True),
    "q2": CodecEntry(_block(2, "stochastic"), ladder=True, block=True),
    "q1": CodecEntry(_block(1, "stochastic"), ladder=False, block=True),
    "sign": CodecEntry(_block(1, "sign"), ladder=True, block=True),
    # 16384 (64 KiB of fp32): below it, keeping 1% saves little while the selection's fixed
    # cost stays, and biases and norm weights are both small and sensitive to sparsification.
    "topk": CodecEntry(_topk, ladder=True, min_numel=16384, options=TopK),
}

#: Names `EngineConfig(codec=...)` accepts.
CODEC_NAMES = tuple(CODECS)
#: The codecs ``codec=None`` chooses from, best-training first (perf/RESULTS.md, "Codec
#: frontier"): a tensor takes the first whose bytes fit ``1 / compression_ratio`` of its
#: lossless bytes.
LADDER = tuple(name for name, entry in CODECS.items() if entry.ladder)
#: The block codecs (q4, q3, q2, q1, sign), in the registry's order.
BLOCK_CODECS = tuple(name for name, entry in CODECS.items() if entry.block)
#: Each codec's default smallest tensor (``EngineConfig.min_compress_numel=None``).
DEFAULT_MIN_NUMEL = {name: entry.min_numel for name, entry in CODECS.items()}

#: What ``EngineConfig.codec`` holds: a name, an options object, or None (the ladder).
CodecChoice: TypeAlias = str | TopK | Ladder | None


def make_codec(
    name: str,
    *,
    ratio: float = 1.0,
    selection: str = "exact",
    options: TopK | None = None,
    seed: int = 0,
) -> Codec:
    """The working codec ``name`` (tests and benchmarks build single codecs with it)."""
    return CODECS[name].make(name, ratio=ratio, selection=selection, options=options, seed=seed)


def codec_name(codec: CodecChoice) -> str | None:
    """The registry name of an `EngineConfig.codec` value (None: the ladder)."""
    if isinstance(codec, (TopK, Ladder)):
        return codec.name
    return codec


def codec_options(codec: CodecChoice) -> TopK | Ladder | None:
    """The options object in effect for an `EngineConfig.codec` value: the one given, the
    defaults of the named codec's options class (``"topk"``: ``TopK()``), ``Ladder()`` for
    None, or None for a codec without options."""
    if codec is None:
        return Ladder()
    if isinstance(codec, (TopK, Ladder)):
        return codec
    options = CODECS[codec].options
    return None if options is None else options()


def check_codec(codec: Any) -> None:
    """Raise naming what is accepted unless ``codec`` is a valid `EngineConfig.codec`."""
    if codec is None or isinstance(codec, (TopK, Ladder)):
        return
    if isinstance(codec, type) and codec in (TopK, Ladder):
        raise TypeError(
            f"codec={codec.__name__} is the class; pass an instance: codec={codec.__name__}()."
        )
    if not isinstance(codec, str) or codec not in CODECS:
        raise ValueError(
            f"Invalid codec: {codec!r}; expected one of {list(CODEC_NAMES)}, a "
            "gradient_cache.TopK(...) or None."
        )


class HasCodec(Protocol):
    """What `Codecs.for_options` reads of an `EngineConfig`."""

    @property
    def codec(self) -> CodecChoice: ...


@dataclass(frozen=True)
class Codecs:
    """The codec instances one pipeline uses, shared by its parameters (as their random
    generators are), and how a parameter chooses among them.

    ``candidates``: best-training first. ``budget``: None, the first candidate a tensor is
    large enough for; a ratio r, the first whose payload is at most ``1 / r`` of the
    tensor's lossless bytes, or, if none is, the most compact one.
    """

    lossless: Codec
    candidates: tuple[Codec, ...]
    budget: float | None

    def __post_init__(self) -> None:
        # One noise table a device for every dither of the pipeline (`NoiseTables`): the
        # ladder's four lossy codecs held four of the same 4 MiB through a backward.
        shared = NoiseTables()
        for source in self.random_sources().values():
            if isinstance(source, Dither):
                source.tables_held = shared

    @classmethod
    def for_options(cls, config: HasCodec, *, ratio: float, selection: str) -> Codecs:
        """``selection``: "threshold" or "exact" (the backend resolves "auto")."""
        options = codec_options(config.codec)
        if isinstance(options, Ladder):
            if ratio > 1:
                candidates = tuple(
                    make_codec(name, ratio=ratio, selection=selection) for name in LADDER
                )
                return cls(Lossless(), candidates, ratio)
            return cls(Lossless(), (), None)
        name = codec_name(config.codec)
        assert name is not None
        if name == "lossless":
            return cls(Lossless(), (), None)
        codec = make_codec(name, ratio=ratio, selection=selection, options=options)
        return cls(Lossless(), (codec,), None)

    def all(self) -> list[Codec]:
        return [self.lossless, *self.candidates]

    def scratch_tensors(self) -> list[torch.Tensor]:
        """The codecs' reusable buffers, each once (their dithers share a noise table)."""
        unique = {id(t): t for codec in self.all() for t in codec.scratch_tensors()}
        return list(unique.values())

    def random_sources(self) -> dict[str, RandomSource]:
        """The codecs' own random generators, by the part that draws from them."""
        return {
            f"{codec.name}.{part}": generators
            for codec in self.all()
            for part, generators in codec.generators().items()
        }

    def random_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The generators' states on ``device`` (never the global RNG's)."""
        states = {
            name: generators.get_state(device) for name, generators in self.random_sources().items()
        }
        return {name: state for name, state in states.items() if state is not None}

    def set_random_state(self, device: torch.device, states: dict[str, torch.Tensor]) -> None:
        """Put back what `random_state` returned (a generator it lacks restarts from its seed)."""
        for name, generators in self.random_sources().items():
            generators.set_state(device, states.get(name))

    def continuable(
        self, device: torch.device, states: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Of ``states``, saved by `random_state` on another kind of device, those ``device``
        continues from: the ones its sources take (a dither's draw counter anywhere; a
        generator's where ``device``'s generator is of its kind: a CPU one's on the emulated
        device)."""
        sources = self.random_sources()
        return {
            name: state
            for name, state in states.items()
            if name in sources and sources[name].state_problem(device, state) is None
        }

    def choose(self, numel: int, dtype: torch.dtype, *, min_numel: int | None) -> Codec:
        """The codec of a gradient of ``numel`` entries of ``dtype``."""
        # The lossy codecs code real entries: their cast to real drops a complex gradient's
        # imaginary part (the block codecs, int8), or top-k's error feedback fails on it.
        if dtype.is_complex:
            return self.lossless
        dense = numel * dtype.itemsize
        fitting = []
        for codec in self.candidates:
            floor = min_numel or DEFAULT_MIN_NUMEL.get(codec.name, BLOCK_MIN_NUMEL)
            if numel < floor:
                continue
            size = shapes_bytes(codec.payload_shapes(numel, dtype))
            if self.budget is None or size * self.budget <= dense:
                return codec
            fitting.append((size, codec))
        if fitting:
            return min(fitting, key=lambda pair: pair[0])[1]
        return self.lossless
