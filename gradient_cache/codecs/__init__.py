"""Gradient codecs: each encodes a flat gradient into a payload and says its bytes.

`base.Codec` is the interface the engine uses; `payloads` the payload kinds and their
behaviour; `lossless`, `values` (int8), `lowbit` (1-4 bit block codes) and `topk` the
codecs; `int8`, `block_kernels`, `bitpack`, `rotation`, `dither` and `residual` the kernels
and residual storage they share. `options` holds what users write to tune a codec
(`TopK`, `Ladder`); `registry` is the one list of codec names (`CODECS`) and the engine's
choice among them (`Codecs`).
"""

from .base import Codec
from .block import BlockQuantized
from .int8 import Int8Quantizer, Int8Values
from .lossless import Lossless
from .options import Ladder, TopK
from .payloads import (
    BlockCodesPayload,
    DensePayload,
    Payload,
    QuantizedPayload,
    SparsePayload,
    payload_from_state,
)
from .registry import (
    BLOCK_CODECS,
    BLOCK_MIN_NUMEL,
    CODEC_NAMES,
    CODECS,
    DEFAULT_MIN_NUMEL,
    LADDER,
    Codecs,
    codec_name,
    codec_options,
    make_codec,
)
from .residual import RESIDUAL_DTYPES, ResidualCodec
from .topk import SELECTIONS, TopKCodec, TopKEncoder, TopKSelector, index_dtype, keep_count

__all__ = [
    "BLOCK_CODECS",
    "BLOCK_MIN_NUMEL",
    "CODECS",
    "CODEC_NAMES",
    "DEFAULT_MIN_NUMEL",
    "LADDER",
    "RESIDUAL_DTYPES",
    "SELECTIONS",
    "BlockCodesPayload",
    "BlockQuantized",
    "Codec",
    "Codecs",
    "DensePayload",
    "Int8Quantizer",
    "Int8Values",
    "Ladder",
    "Lossless",
    "Payload",
    "QuantizedPayload",
    "ResidualCodec",
    "SparsePayload",
    "TopK",
    "TopKCodec",
    "TopKEncoder",
    "TopKSelector",
    "codec_name",
    "codec_options",
    "index_dtype",
    "keep_count",
    "make_codec",
    "payload_from_state",
]
