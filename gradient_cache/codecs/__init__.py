"""Gradient codecs: each encodes a flat gradient into a payload and says its bytes.

`base.Codec` is the interface the engine uses; `payloads` the payload kinds and their
behaviour; `lossless`, `values` (int8), `lowbit` (1-4 bit block codes) and `topk` the
codecs; `int8`, `blockquant`, `bitpack`, `rotation`, `dither` and `residual` the kernels
and residual storage they share.
"""

from .base import Codec
from .lossless import Lossless
from .lowbit import BLOCK_CODECS, BlockQuantized
from .payloads import (
    BlockCodesPayload,
    DensePayload,
    Payload,
    QuantizedPayload,
    SparsePayload,
    payload_from_state,
)
from .residual import RESIDUAL_DTYPES, ResidualCodec
from .topk import SELECTIONS, TopK, TopKEncoder, TopKSelector, index_dtype, keep_count
from .values import Int8Quantizer, Int8Values

# Names `EngineConfig(codec=...)` accepts.
CODEC_NAMES = ("lossless", "int8", *BLOCK_CODECS, "topk")

__all__ = [
    "BLOCK_CODECS",
    "CODEC_NAMES",
    "RESIDUAL_DTYPES",
    "SELECTIONS",
    "BlockCodesPayload",
    "BlockQuantized",
    "Codec",
    "DensePayload",
    "Int8Quantizer",
    "Int8Values",
    "Lossless",
    "Payload",
    "QuantizedPayload",
    "ResidualCodec",
    "SparsePayload",
    "TopK",
    "TopKEncoder",
    "TopKSelector",
    "index_dtype",
    "keep_count",
    "payload_from_state",
]
