"""Codec options: what a user writes in ``EngineConfig(codec=...)`` to tune a codec.

Each is a small frozen, keyword-only, validated object, documented where it is written (as
PyTorch's PowerSGD state documents its knobs): `TopK` for ``codec="topk"``, `Ladder` for
``codec=None``. The registry (`registry.CODECS`) says which name takes which options; the
working codecs (`topk.TopKCodec`, ...) are built from them by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .residual import RESIDUAL_DTYPES
from .topk import SELECTIONS

RESIDUAL_LOCATIONS = ("host", "device")
VALUE_DTYPES = ("int8",)
SELECTION_CHOICES = ("auto", *SELECTIONS)


@dataclass(frozen=True, kw_only=True)
class TopK:
    """``codec=TopK(...)``: keep the ``ceil(numel / compression_ratio)`` largest-magnitude
    entries of each gradient and their indices, and (by default) feed what was dropped
    back into the next step. ``codec="topk"`` is ``TopK()``.

    Top-k and Adam do not mix well (perf/RESULTS.md, "Codec frontier"): at the same
    budget the low-bit codecs (``codec=None`` picks them) train closer to plain PyTorch.
    Its knobs, what each costs, and why the defaults:

    Attributes:
        error_feedback: add what compression dropped back into the next gradient (the
            residual), so that dropped mass is delayed, not lost. Default True, chosen by
            the "Compression recipes" table of perf/RESULTS.md. Its cost: the residual's
            host memory and PCIe traffic (``residual_dtype``) and, while a tensor is
            encoded, a dense fp32 copy of it (gradient plus residual) on the device.
        residual_dtype: how the residual is stored between steps: ``"int8"`` (default;
            1.0625 bytes an entry: an int8 code per entry and an fp32 scale per block of
            64), ``"bfloat16"`` (2 bytes) or ``"float32"`` (4 bytes an entry: as much host
            memory as lossless offload, and on CUDA twice its PCIe traffic). bf16 and int8
            round stochastically, so the stored residual is unbiased
            (codecs.residual.ResidualCodec); perf/RESULTS.md compares them.
        residual_location: where the residual lives on the CUDA backend: ``"host"``
            (default; a pinned slot per compressed tensor, no device memory kept, but it
            crosses PCIe densely twice a step: in for the encode, out after it) or
            ``"device"`` (no round trip; every compressed gradient's residual stays on the
            device in its stored form, ``residual_dtype``, which undoes much of the
            saving). On the CPU backend the device is the host: both choices keep the
            residual in host RAM.
        keep_previous_residual: with error feedback, keep the last completed step's
            residual until the pending step is restored, so that ``discard_gradients()``
            undoes the pending step's residual update and leaves no trace. Default True.
            Its cost is a second residual's host memory (on CUDA, a second pinned slot per
            residual: with int8 residuals about a quarter of lossless offload's host
            bytes), not PCIe traffic. False saves that memory; a discarded step's
            held-back part (about 99% of its gradient at ratio 100) then stays in the
            residual and reaches later steps.
        selection: how the entries are chosen. ``"auto"`` (default) is ``"threshold"`` on
            the CPU and ``"exact"`` on CUDA, where ``torch.topk`` needs no host
            synchronisation and the threshold's count does (so CUDA refuses
            ``"threshold"``: nothing in a backward hook may wait on the host).
            ``"threshold"`` estimates the magnitude threshold from a random sample, keeps
            every entry at or above it and trims or widens the pick until the count is
            within ``±10%`` of the wanted count; what it keeps is always the
            largest-magnitude entries. ``"exact"`` keeps exactly ``ceil(numel / ratio)``
            entries with ``torch.topk``: exact, and much slower on a CPU (perf/RESULTS.md).
        value_dtype: how kept values are stored: None (default) as the gradient's dtype,
            or ``"int8"``: an int8 code per value and an fp32 scale per block of 64 values,
            rounded stochastically (unbiased; off by less than the block's largest
            magnitude / 127), about a quarter of fp32's value bytes (the indices stay).
            perf/RESULTS.md has what it costs in validation loss.

    Tensors below ``EngineConfig.min_compress_numel`` (default 16384 for top-k), and complex
    ones, travel whole and keep no residual.
    """

    name: ClassVar[str] = "topk"

    error_feedback: bool = True
    residual_dtype: str = "int8"
    residual_location: str = "host"
    keep_previous_residual: bool = True
    selection: str = "auto"
    value_dtype: str | None = None

    def __post_init__(self) -> None:
        check_bool("error_feedback", self.error_feedback)
        check_choice("residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        check_choice("residual_location", self.residual_location, RESIDUAL_LOCATIONS)
        check_bool("keep_previous_residual", self.keep_previous_residual)
        check_choice("selection", self.selection, SELECTION_CHOICES)
        if self.value_dtype is not None:
            check_choice("value_dtype", self.value_dtype, VALUE_DTYPES)


@dataclass(frozen=True, kw_only=True)
class Ladder:
    """``codec=Ladder(...)``: what ``codec=None`` (the default) does, with its one knob.

    At ``compression_ratio=r > 1`` each tensor takes the best-training codec of the ladder
    (`registry.LADDER`) whose payload fits ``1 / r`` of its lossless bytes, or, where none
    does, the most compact one; at r = 1 every gradient travels whole. The ladder's codecs
    keep no residual (its top-k keeps values in the gradient's dtype: a residual would
    break the byte budget).

    Attributes:
        selection: how the ladder's top-k (its last rung: tensors no block codec fits,
            at ratios above about 25 for fp32) chooses entries; as `TopK.selection`.
            Default ``"auto"``.
    """

    name: ClassVar[None] = None

    selection: str = "auto"

    def __post_init__(self) -> None:
        check_choice("selection", self.selection, SELECTION_CHOICES)


#: The options classes, by the codec name they configure (None: the ladder).
OPTIONS_CLASSES: tuple[type[TopK] | type[Ladder], ...] = (TopK, Ladder)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Invalid {name}: {value!r}; expected one of {list(choices)}.")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
