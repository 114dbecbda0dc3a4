"""Gradient codecs: each encodes a flat gradient into a payload and says its bytes.

`base.Codec` is the interface the engine uses; `payloads` the payload kinds and their
behaviour; `lossless`, `values` (int8) and `topk` the codecs; `int8` and `residual` the
quantization kernels and residual storage they share.
"""

from .base import Codec
from .lossless import Lossless
from .payloads import DensePayload, Payload, QuantizedPayload, SparsePayload, payload_from_state
from .residual import RESIDUAL_DTYPES, ResidualCodec
from .topk import SELECTIONS, TopK, TopKEncoder, TopKSelector, index_dtype, keep_count
from .values import Int8Quantizer, Int8Values

__all__ = [
    "RESIDUAL_DTYPES",
    "SELECTIONS",
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
