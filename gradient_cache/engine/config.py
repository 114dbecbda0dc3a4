"""Engine options: one validated dataclass, every option documented once.

`create_gradient_cache(model, **options)` maps its keyword options onto `EngineConfig`;
`GradientCacheHookManager(model, config=EngineConfig(...))` takes it whole.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from ..codecs import CODEC_NAMES, RESIDUAL_DTYPES, SELECTIONS

# create_gradient_cache's compression_ratio: gradients take at most a third of lossless
# offload's bytes. fp32 gradients meet it with int8 codes (3.8x fewer), which trained
# within 1% of plain PyTorch with both AdamW and SGD with a margin; bf16 gradients with the
# 4-bit codec. perf/RESULTS.md ("Codec frontier") has the table and why not more yet.
DEFAULT_COMPRESSION_RATIO = 3.0
RESIDUAL_LOCATIONS = ("host", "device")
VALUE_DTYPES = ("int8",)
BACKENDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the offload engine groups, encodes and stores gradients.

    Attributes:
        codec: Which codec encodes the gradients. None (default): at
            ``compression_ratio=r > 1``, per tensor the best-training codec of the ladder
            (``route.LADDER``: int8, q4, q3, q2, sign, top-k) whose payload fits ``1 / r``
            of the tensor's lossless bytes; at ratio 1, lossless (int8 with
            ``value_dtype="int8"``). A name picks one whatever the ratio: ``"q4"``,
            ``"q3"``, ``"q2"``, ``"q1"`` (every entry as a 4, 3, 2 or 1-bit code after a
            randomised 128-point Hadamard rotation, rounded stochastically, an fp32 scale
            per 128 entries, no residual), ``"sign"`` (the rotated entries' signs times
            each block's mean magnitude), ``"int8"`` (int8 codes, an fp32 scale per 64
            entries), ``"topk"`` (keeps ``numel / compression_ratio`` entries, with
            ``selection``, ``error_feedback``, ``residual_dtype`` and ``value_dtype``) or
            ``"lossless"``. perf/RESULTS.md has what each costs in validation loss. The
            top-k options below apply to ``codec="topk"`` only: the ladder's top-k keeps
            values in the gradient's dtype and no residual, which would break the budget.
        bucket_size_mb: Dense gradient megabytes (2**20 bytes) gathered before a bucket is
            encoded and sent off the device. Smaller buckets free memory sooner during
            backward (the device holds about two buckets plus the largest gradient at
            once) at the cost of more, smaller launches. Default 4.
        selection: How top-k entries are chosen. ``"auto"`` (default) is ``"threshold"``
            on the CPU and ``"exact"`` on CUDA, where ``torch.topk`` needs no host
            synchronisation and the threshold's count does (so CUDA refuses
            ``"threshold"``: nothing in a backward hook may wait on the host).
            ``"threshold"`` estimates the magnitude threshold from a random sample, keeps
            every entry at or above it and trims or widens the pick until the count is
            within ``±10%`` of the wanted count; what it keeps is always the
            largest-magnitude entries.
            ``"exact"`` keeps exactly ``ceil(numel / ratio)`` entries with
            ``torch.topk``: exact, and much slower on a CPU (perf/RESULTS.md).
        error_feedback: ``codec="topk"``: add what compression dropped back into the next
            gradient (the residual), so that dropped mass is delayed, not lost. Default
            True, chosen by the "Compression recipes" table of perf/RESULTS.md. Its cost:
            the residual's host memory and PCIe traffic (``residual_dtype``) and, while a
            tensor is encoded, a
            dense fp32 copy of it (gradient plus residual) on the device.
        residual_dtype: How the residual is stored between steps: ``"int8"`` (default;
            1.0625 bytes an entry: an int8 code per entry and an fp32 scale per block of
            64), ``"bfloat16"`` (2 bytes) or ``"float32"`` (4 bytes an entry: as much host
            memory as lossless offload, and on CUDA twice its PCIe traffic). bf16 and
            int8 round stochastically, so the stored residual is unbiased
            (codecs.residual.ResidualCodec); perf/RESULTS.md compares them.
        warmup_steps: Optimizer steps sent uncompressed at the start of training, as
            Deep Gradient Compression does, while gradients change fastest (what it gained
            is in perf/RESULTS.md, "Compression recipes"). Default 0: a good length depends on the
            run's, and while it lasts host memory and PCIe traffic are those of lossless
            offload (on CUDA the pinned pool is sized for dense gradients until the
            warm-up ends, then rebuilt smaller).
        value_dtype: ``codec="topk"`` or ratio 1: how kept values are stored: None
            (default) as the gradient's dtype,
            or ``"int8"``: an int8 code per value and an fp32 scale per block of 64 values,
            rounded stochastically (unbiased; off by less than the block's largest
            magnitude / 127), about a quarter of fp32's bytes. It applies to every tensor
            of at least ``min_compress_numel`` entries, at any ``compression_ratio``:
            with ``compression_ratio=1`` every entry is kept, quantized (no longer
            lossless); with top-k it shrinks the kept values. perf/RESULTS.md has what it
            costs in validation loss.
        residual_location: Where the residual lives on the CUDA backend: ``"host"``
            (default; a pinned slot per compressed tensor, no device memory kept, but it
            crosses PCIe densely twice a step: in for the encode, out after it) or
            ``"device"`` (no round trip; every compressed gradient's residual stays on the
            device in its stored form, ``residual_dtype``, which undoes much of the
            saving). On the CPU backend the device is the host: both choices keep the
            residual in host RAM.
        keep_previous_residual: With error feedback, keep the last completed step's
            residual until the pending step is restored, so that ``discard_gradients()``
            undoes the pending step's residual update and leaves no trace. Default True.
            Its cost is a second residual's host memory (on CUDA, a second pinned slot
            per residual: with int8 residuals about a quarter of lossless offload's
            host bytes), not PCIe traffic. False saves that memory; a discarded step's
            held-back part (about 99% of its gradient at ratio 100) then stays in the
            residual and reaches later steps.
        min_compress_numel: Tensors with fewer elements travel uncompressed. None
            (default): 16384 for top-k (64 KiB of fp32: below it, keeping 1% saves little
            while the selection's fixed cost stays, and biases and norm weights are both
            small and sensitive to sparsification) and 128 (one block) for the block
            codecs and int8.
        host_memory_fraction: Largest share of the host's available RAM (psutil, or the
            cgroup limit where lower) the host store may need; the engine refuses to
            start if its estimate is larger. Default 0.5.
        backend: ``"auto"`` (default) picks by the parameters' device; ``"cpu"`` or
            ``"cuda"`` insist on one.
        staging_depth: CUDA backend: how many buckets may be between encode and a
            completed device-to-host copy at once. 2 (default) double-buffers: bucket
            i+1 encodes while bucket i copies. Larger hides more latency and holds more
            device memory; 1 serialises encode and copy.
        pin_memory: CUDA backend: keep payloads in page-locked host memory, so copies run
            without blocking. Default True; falls back to pageable memory, with one
            warning, where pinning fails.
        host_pool_mb: CUDA backend: the most the pinned pool may take. The pool holds one
            slot per parameter, sized for its largest payload (and its host residual),
            allocated once before training; construction fails, naming the size
            needed, if that exceeds ``host_pool_mb``. None (default): no cap beyond
            ``host_memory_fraction``.
    """

    codec: str | None = None
    bucket_size_mb: float = 4.0
    selection: str = "auto"
    error_feedback: bool = True
    residual_dtype: str = "int8"
    warmup_steps: int = 0
    value_dtype: str | None = None
    residual_location: str = "host"
    keep_previous_residual: bool = True
    min_compress_numel: int | None = None
    host_memory_fraction: float = 0.5
    backend: str = "auto"
    staging_depth: int = 2
    pin_memory: bool = True
    host_pool_mb: float | None = None

    def __post_init__(self) -> None:
        if self.codec is not None:
            _check_choice("codec", self.codec, CODEC_NAMES)
        _check_positive_number("bucket_size_mb", self.bucket_size_mb)
        _check_choice("selection", self.selection, ("auto", *SELECTIONS))
        _check_bool("error_feedback", self.error_feedback)
        _check_choice("residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        _check_non_negative_int("warmup_steps", self.warmup_steps)
        if self.value_dtype is not None:
            _check_choice("value_dtype", self.value_dtype, VALUE_DTYPES)
        _check_choice("residual_location", self.residual_location, RESIDUAL_LOCATIONS)
        _check_bool("keep_previous_residual", self.keep_previous_residual)
        if self.min_compress_numel is not None:
            _check_positive_int("min_compress_numel", self.min_compress_numel)
        _check_positive_number("host_memory_fraction", self.host_memory_fraction)
        if self.host_memory_fraction > 1:
            raise ValueError(
                f"Invalid host_memory_fraction: {self.host_memory_fraction!r}; "
                "expected a share of available RAM in (0, 1]."
            )
        _check_choice("backend", self.backend, BACKENDS)
        _check_positive_int("staging_depth", self.staging_depth)
        _check_bool("pin_memory", self.pin_memory)
        if self.host_pool_mb is not None:
            _check_positive_number("host_pool_mb", self.host_pool_mb)

    @property
    def bucket_size_bytes(self) -> int:
        return max(1, int(self.bucket_size_mb * 2**20))

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        """Build a config from keyword options, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"Unknown engine option(s) {unknown}; accepted options are "
                f"{sorted(known)} (see gradient_cache.EngineConfig)."
            )
        return cls(**options)


def validate_compression_ratio(value: Any) -> float:
    """Return ``value`` as a float, or raise naming what is accepted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"compression_ratio must be a real number >= 1 (1 = lossless, r = at most 1/r of "
            f"lossless bytes), "
            f"got {type(value).__name__} {value!r}."
        )
    ratio = float(value)
    if not math.isfinite(ratio) or ratio < 1:
        raise ValueError(
            f"Invalid compression_ratio: {value!r}; expected a finite number >= 1 "
            "(1 = lossless offload, r = each gradient in at most 1/r of its lossless bytes)."
        )
    return ratio


def validate_exclude_layers(exclude_layers: Any) -> tuple[str, ...]:
    """Return ``exclude_layers`` (None or a list of name substrings) as a tuple, or raise."""
    if exclude_layers is None:
        return ()
    if isinstance(exclude_layers, str) or not isinstance(exclude_layers, (list, tuple)):
        raise TypeError(
            f"exclude_layers must be a list of name substrings, e.g. ['lm_head'], got "
            f"{exclude_layers!r}."
        )
    bad = [entry for entry in exclude_layers if not isinstance(entry, str) or not entry]
    if bad:
        raise TypeError(
            f"exclude_layers entries must be non-empty strings (parameter-name substrings), "
            f"got {bad!r}."
        )
    return tuple(exclude_layers)


def _check_positive_number(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"Invalid {name}: {value!r}; expected a finite number > 0.")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r}; expected an integer >= 1.")


def _check_non_negative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"Invalid {name}: {value!r}; expected an integer >= 0.")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r}; expected one of {list(choices)}.")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
