"""Engine options: one validated dataclass, every option documented once."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..codecs import TopK
from ..codecs.options import Ladder, check_bool, check_choice
from ..codecs.registry import CodecChoice, check_codec, codec_name, codec_options
from .budget import MemoryBudget
from .units import MIB

# A third of lossless bytes: int8 meets it for fp32 gradients (within 1% of plain PyTorch,
# AdamW and SGD), q4 for bf16 (perf/RESULTS.md, "Codec frontier").
DEFAULT_COMPRESSION_RATIO = 3.0
BACKENDS = ("auto", "cpu", "cuda")
# bucket_size_mb=None with the state offloaded: 1/AUTO_BUCKETS of the cached gradients, so a
# small model steps in several buckets, not its whole state at once. Not without the state:
# small buckets launch encodes while backward's first activations live (a higher peak).
AUTO_BUCKETS = 8
# With the weights offloaded too: the step's two buckets bring their weights and AdamW's two
# moments beside their gradients (16 bytes a parameter), so an eighth would hold the whole
# fp32 weights at the step (2 x 1/8 x 16 = 4 bytes a parameter); a 32nd holds a quarter, and a
# model twice the device's size trains with the default.
AUTO_BUCKETS_WEIGHTS_ON_HOST = 32
AUTO_BUCKET_MIN_BYTES = 64 * 1024
AUTO_BUCKET_MAX_MB = 4.0
#: Once `EngineConfig` fields, now the top-k codec's: `from_options` still takes them.
TOPK_KEYWORDS = (
    "error_feedback",
    "residual_dtype",
    "residual_location",
    "keep_previous_residual",
    "selection",
    "value_dtype",
)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the offload engine groups, encodes and stores gradients.

    Every option acts whatever the codec; a codec's own knobs are on its options object
    (``codec=gradient_cache.TopK(error_feedback=False)``), documented there.

    Attributes:
        codec: Which codec encodes the gradients. None (default): at ``compression_ratio=r > 1``,
            per tensor the best-training codec of the ladder (``codecs.registry.LADDER``: int8,
            q4, q3, q2, sign, top-k) whose payload fits ``1 / r`` of its lossless bytes
            (``gradient_cache.Ladder`` sets how its top-k selects); at ratio 1, lossless. A name
            picks one whatever the ratio: ``"q4"``, ``"q3"``, ``"q2"``, ``"q1"`` (4, 3, 2 or 1-bit
            codes after a randomised 128-point Hadamard rotation, rounded stochastically, an fp32
            scale per 128 entries, no residual), ``"sign"`` (the rotated entries' signs times each
            block's mean magnitude), ``"int8"`` (int8 codes, an fp32 scale per 64), ``"topk"``
            (keeps ``numel / compression_ratio`` entries, with error feedback:
            ``gradient_cache.TopK()``, whose docstring is its tuning guide) or ``"lossless"``.
            Costs: perf/RESULTS.md.
        bucket_size_mb: Dense gradient MiB gathered before a bucket is encoded and sent off the
            device. Smaller buckets free memory sooner in backward (the device holds about two
            buckets plus the largest gradient) and at the fused step (a bucket or two of
            gradients, and of offloaded state), for more, smaller launches. None (default):
            4 MiB; with ``offload_optimizer_state=True``, an eighth of the cached gradients'
            bytes within 64 KiB and 4 MiB (`bucket_bytes`), and with ``offload_parameters=True``
            too a 32nd (the step's two buckets then hold a quarter of the fp32 weights).
        warmup_steps: Optimizer steps sent uncompressed at the start, as Deep Gradient
            Compression does, while gradients change fastest (perf/RESULTS.md, "Compression
            recipes"). Default 0: a good length depends on the run's, and meanwhile host memory
            and PCIe traffic are lossless offload's (on CUDA the pinned pool is rebuilt smaller
            at its end).
        min_compress_numel: Tensors with fewer elements travel uncompressed. None (default):
            16384 for top-k (below it keeping 1% saves little against the selection's fixed
            cost, and biases and norm weights are small and sensitive) and 128 (one block) for
            the other codecs.
        host_memory_fraction: Largest share of the host's available RAM (psutil, or the cgroup
            limit where lower) the host store may need, else the engine refuses to start.
            Default 0.5.
        backend: ``"auto"`` (default) picks by the parameters' device; ``"cpu"`` or ``"cuda"``
            insist on one.
        staging_depth: CUDA: how many buckets may be between encode and a completed copy to the
            host. 2 (default) double-buffers (bucket i+1 encodes while bucket i copies); more
            hides more latency for more device memory; 1 serialises encode and copy.
        pin_memory: CUDA: payloads in page-locked host memory, so copies do not block. Default
            True; falls back to pageable memory, with one warning, where pinning fails.
        host_pool_mb: CUDA: a cap on the pinned pool (one slot per parameter, sized for its
            largest payload and host residual, allocated before training); construction fails,
            naming the size needed, above it. None (default): only ``host_memory_fraction``.
        offload_optimizer_state: Keep the optimizer's per-parameter state tensors (Adam's
            moments, SGD's momentum) in host memory between steps, pinned on CUDA;
            ``hook_manager.step(optimizer)`` brings each bucket's state with its gradients,
            steps, and copies it back: the device holds the weights and about two buckets of
            gradients and state, and each step moves the state both ways (8 bytes per parameter
            each way for fp32 Adam). Needs the fused step (``apply_gradients()`` is refused).
            Default False.
        offload_parameters: Keep the weights in host memory too (fp32 masters, pinned on CUDA),
            on the device only while in use: a block at a time in forward and backward (the next
            arriving on a side stream), and in ``hook_manager.step(optimizer)`` a bucket at a
            time with its gradients and state, stepped there by the user's optimizer and copied
            back to the masters. Bit for bit with plain PyTorch. At rest, ``model.parameters()``
            and ``model.state_dict()`` are the host masters. Needs
            ``offload_optimizer_state=True`` and the fused step; not with ``exclude_layers``; a
            ``memory_budget`` keeps whole blocks on the device (not with ``compute_dtype``, nor
            under FSDP2). Each forward and backward moves the weights over (4 bytes per
            parameter; 2 with a bf16 ``compute_dtype``), the step the masters both ways. Default
            False.
        compute_dtype: With ``offload_parameters``: the dtype forward and backward compute in
            (``torch.bfloat16``): each weight comes as its fp32 master cast on the host (2 bytes a
            parameter over the link, 2 more on the host, cast again where the master changed);
            the model's and each block's floating inputs are cast to it; gradients are
            accumulated and stepped in fp32 (a lossless one with nothing to join crosses in bf16,
            widened at its restore) on the fp32 masters: FSDP2's
            ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)`` on one
            process, bit for bit. None (default): the weights' own dtype.
        parameter_blocks: With ``offload_parameters``: the dotted name of the module list whose
            children are the blocks (``"transformer.h"``); None (default): the ``nn.ModuleList``
            or ``nn.Sequential`` whose children hold the most parameter bytes. Parameters outside
            the blocks, or tied across them, stay on the device from forward to backward's end.
        device: With ``offload_parameters``: the device to train on, for a model on the host: the
            cache sets it up from there, the weights never whole on the device (the buffers go
            there; the batches are yours to put there). None (default): the parameters' device.
        memory_budget: a device-memory budget, a share (``"80%"`` or ``0.8``) or an amount
            (``"20GiB"``): the steps through the second after the warm-up offload everything and
            their device peak is measured (the allocator's reserved peak plus what lies outside
            it); then the cache keeps on the device the most that fits, what frees the fewest
            device bytes per link byte first (`gradient_cache.engine.budget`); with
            ``offload_parameters``, whole blocks of weights (and the rest), the gradients and
            state still offloaded. Nothing to budget without memory statistics (a CPU). Not with
            FSDP2. Default None: everything offloaded.
        checkpoint_frequency: how often, in steps, ``verbose=True`` logs the summary (default:
            every step). The seed's name: it set how often statistics were saved;
            ``summary()`` has them at every step.
    """

    codec: CodecChoice = None
    bucket_size_mb: float | None = None
    warmup_steps: int = 0
    min_compress_numel: int | None = None
    host_memory_fraction: float = 0.5
    backend: str = "auto"
    staging_depth: int = 2
    pin_memory: bool = True
    host_pool_mb: float | None = None
    offload_optimizer_state: bool = False
    offload_parameters: bool = False
    compute_dtype: torch.dtype | None = None
    parameter_blocks: str | None = None
    device: torch.device | str | None = None
    memory_budget: str | float | None = None
    checkpoint_frequency: int = 1

    def __new__(cls, **fields: Any) -> EngineConfig:
        # Before __init__'s bare "unexpected keyword": name the moved option's new place.
        name = next((name for name in TOPK_KEYWORDS if name in fields), None)
        if name is not None:
            raise TypeError(
                f"EngineConfig got {name}={fields[name]!r}: it is an option of the top-k "
                "codec now, not of EngineConfig. Pass "
                f"EngineConfig(codec=gradient_cache.TopK({name}={fields[name]!r})) (top-k keeps "
                "numel / compression_ratio entries), or the keyword to "
                "create_gradient_cache(...), which takes it where it acts."
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        check_codec(self.codec)
        if self.bucket_size_mb is not None:
            _check_positive_number("bucket_size_mb", self.bucket_size_mb)
        _check_int("warmup_steps", self.warmup_steps, 0)
        if self.min_compress_numel is not None:
            _check_int("min_compress_numel", self.min_compress_numel, 1)
        _check_positive_number("host_memory_fraction", self.host_memory_fraction)
        if self.host_memory_fraction > 1:
            raise ValueError(
                f"Invalid host_memory_fraction: {self.host_memory_fraction!r}; "
                "expected a share of available RAM in (0, 1]."
            )
        check_choice("backend", self.backend, BACKENDS)
        _check_int("staging_depth", self.staging_depth, 1)
        check_bool("pin_memory", self.pin_memory)
        check_bool("offload_optimizer_state", self.offload_optimizer_state)
        self._check_parameters_offload()
        if self.host_pool_mb is not None:
            _check_positive_number("host_pool_mb", self.host_pool_mb)
        if self.memory_budget is not None:
            MemoryBudget.parse(self.memory_budget)  # raises naming memory_budget
        _check_int("checkpoint_frequency", self.checkpoint_frequency, 1)

    def _check_parameters_offload(self) -> None:
        """``offload_parameters`` and the options that act only with it."""
        check_bool("offload_parameters", self.offload_parameters)
        if self.parameter_blocks is not None and not isinstance(self.parameter_blocks, str):
            raise TypeError(
                f"parameter_blocks must be a module's dotted name (a str such as "
                f"'transformer.h'), got {self.parameter_blocks!r}."
            )
        if self.compute_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r}: forward and backward compute in a "
                "half-precision copy of the fp32 weights; give torch.bfloat16 or torch.float16, "
                "or None for the weights' own dtype."
            )
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except (RuntimeError, TypeError) as error:
                raise ValueError(
                    f"device={self.device!r} is not a device ({error}); give one such as "
                    "'cuda', 'cuda:1' or torch.device('cuda')."
                ) from None
            object.__setattr__(self, "device", device)
        if not self.offload_parameters:
            if self.device is not None:
                raise ValueError(
                    f"device={self.device!r} sets a model up on the device from the host, its "
                    "weights staying there, and acts only with offload_parameters=True (and "
                    "offload_optimizer_state=True): add them, or move the model yourself "
                    "(model.to(device)) and drop device."
                )
            if self.compute_dtype is not None:
                raise ValueError(
                    f"compute_dtype={self.compute_dtype!r} is the dtype of the weights' copies "
                    "that stream to the device, and acts only with offload_parameters=True: "
                    "add it, or use torch.autocast for mixed precision without it."
                )
            if self.parameter_blocks is not None:
                raise ValueError(
                    f"parameter_blocks={self.parameter_blocks!r} names the blocks the weights "
                    "stream by, and acts only with offload_parameters=True: add it, or drop "
                    "parameter_blocks."
                )
            return
        if not self.offload_optimizer_state:
            raise ValueError(
                "offload_parameters=True needs offload_optimizer_state=True: a bucket's "
                "weights come to the device with its optimizer state and step there, in "
                "hook_manager.step(optimizer). Add offload_optimizer_state=True."
            )
        if self.memory_budget is not None and self.compute_dtype is not None:
            raise ValueError(
                f"memory_budget={self.memory_budget!r} cannot be combined with "
                f"offload_parameters=True and compute_dtype={self.compute_dtype}: a block the "
                "budget keeps on the device would compute in its parameters' own dtype. Drop "
                "memory_budget (every block streams) or compute_dtype."
            )

    # --- derived from the codec's options (read-only; not options of their own)

    @property
    def codec_name(self) -> str | None:
        """The codec's registry name (None: the ladder)."""
        return codec_name(self.codec)

    @property
    def topk(self) -> TopK | None:
        """The top-k codec's options where ``codec`` is top-k (``"topk"``: ``TopK()``)."""
        options = codec_options(self.codec)
        return options if isinstance(options, TopK) else None

    @property
    def residual_options(self) -> TopK:
        """Where and how error-feedback residuals are kept: the top-k codec's options, or
        ``TopK()``'s defaults where no codec keeps a residual."""
        return self.topk or TopK()

    @property
    def selection(self) -> str:
        """How top-k entries are chosen ("auto", "threshold" or "exact"): the explicit
        top-k's or the ladder's (its top-k rung) selection; "auto" for other codecs."""
        options = codec_options(self.codec)
        return options.selection if isinstance(options, (TopK, Ladder)) else "auto"

    @property
    def bucket_size_bytes(self) -> int:
        """The set bucket size in bytes; with ``bucket_size_mb=None``, 4 MiB, the most a bucket
        sized from the model holds."""
        return self.bucket_bytes(None)

    def bucket_bytes(self, gradient_bytes: int | None) -> int:
        """A bucket's capacity for cached gradients of ``gradient_bytes`` dense bytes:
        ``bucket_size_mb`` where set, else 4 MiB, or with the state offloaded an eighth of
        ``gradient_bytes`` (with the weights offloaded too, a 32nd) within 64 KiB and 4 MiB
        (None: 4 MiB)."""
        if self.bucket_size_mb is not None:
            return max(1, int(self.bucket_size_mb * MIB))
        largest = int(AUTO_BUCKET_MAX_MB * MIB)
        if gradient_bytes is None or not self.offload_optimizer_state:
            return largest
        buckets = AUTO_BUCKETS_WEIGHTS_ON_HOST if self.offload_parameters else AUTO_BUCKETS
        return min(largest, max(AUTO_BUCKET_MIN_BYTES, gradient_bytes // buckets))

    @classmethod
    def from_options(
        cls,
        options: dict[str, Any],
        *,
        compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
    ) -> EngineConfig:
        """Build a config from keyword options, naming any unknown one.

        The top-k codec's options (`TOPK_KEYWORDS`), once fields here, are still taken where they
        act: with ``codec="topk"`` they become its `TopK`; ``selection`` with ``codec=None`` at
        ``compression_ratio > 1`` the ladder's (`Ladder`); ``value_dtype="int8"`` with
        ``codec=None`` at ``compression_ratio=1`` is ``codec="int8"``. Anywhere else they would do
        nothing, and raise, naming the fix.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known - set(TOPK_KEYWORDS))
        if unknown:
            raise TypeError(
                f"Unknown engine option(s) {unknown}; accepted options are "
                f"{sorted(known)} (see gradient_cache.EngineConfig), and the codec's own "
                "options on its options object (gradient_cache.TopK)."
            )
        fields = {name: value for name, value in options.items() if name in known}
        keywords = {name: options[name] for name in TOPK_KEYWORDS if name in options}
        if keywords:
            ratio = validate_compression_ratio(compression_ratio)  # named before it is used
            fields["codec"] = _codec_of_keywords(fields.get("codec"), keywords, ratio)
        return cls(**fields)


def _codec_of_keywords(codec: Any, keywords: dict[str, Any], ratio: float) -> CodecChoice:
    """The codec that ``codec`` and the old top-k keywords mean together, or an error
    naming the keyword that would do nothing and the spelling that acts."""
    check_codec(codec)
    topk = TopK(**keywords)  # a bad value is named first, whatever the codec
    if codec == "topk":
        return topk
    if isinstance(codec, (TopK, Ladder)):
        name, value = next(iter(keywords.items()))
        raise TypeError(
            f"{name}={value!r} was passed beside codec={codec!r}: set it on the codec's "
            f"options object instead, codec={type(codec).__name__}(..., {name}={value!r})."
        )
    rest = dict(keywords)
    if codec is None and ratio == 1 and rest.get("value_dtype") == "int8":
        rest.pop("value_dtype")  # the original API's int8 option: every entry kept as an int8 code
        codec = "int8"
    if codec is None and ratio > 1 and "selection" in rest:
        codec = Ladder(selection=rest.pop("selection"))  # the ladder's top-k rung
    if not rest:
        return codec
    name, value = next(iter(rest.items()))
    if codec_name(codec) is None:
        where = f"codec=None at compression_ratio={ratio:g}"
        why = {
            "selection": "every gradient travels whole at ratio 1, nothing is selected",
            "value_dtype": "the codecs it chooses store their own values (int8 codes where they "
            "fit); value_dtype='int8' means codec='int8' at compression_ratio=1 only",
        }.get(name, "the codecs it chooses keep no residual")
    else:
        where, why = f"codec={codec_name(codec)!r}", "that codec is not top-k"
    alternative = (
        ", or codec='int8' for int8 codes on every tensor" if name == "value_dtype" else ""
    )
    raise ValueError(
        f"{name}={value!r} does nothing with {where}: {why}. It is an option of the top-k "
        f"codec: pass codec=gradient_cache.TopK({name}={value!r}) for top-k (which keeps "
        f"numel / compression_ratio entries){alternative}."
    )


def validate_compression_ratio(value: Any) -> float:
    """Return ``value`` as a float, or raise naming what is accepted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"compression_ratio must be a real number >= 1 (1 = lossless, r = at most 1/r of "
            f"lossless bytes), got {type(value).__name__} {value!r}."
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


def _check_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"Invalid {name}: {value!r}; expected an integer >= {least}.")
