"""The codecs on their own: what top-k keeps, error feedback, non-finite values, accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from gradient_cache import GradientCompressor
from gradient_cache.codecs import DensePayload, SparsePayload, TopKEncoder, TopKSelector, keep_count
from gradient_cache.codecs.topk import THRESHOLD_TOLERANCE


def heavy_tailed(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) ** 4


def decode(payload, numel: int) -> torch.Tensor:
    return payload.decode_into(torch.zeros(numel))


def assert_is_top_magnitude(values: torch.Tensor, indices: torch.Tensor, x: torch.Tensor) -> None:
    """Kept entries carry their true values and no dropped entry is larger than a kept one."""
    assert torch.equal(values, x[indices.long()])
    dropped = torch.ones(x.numel(), dtype=torch.bool)
    dropped[indices.long()] = False
    assert x[dropped].abs().max() <= values.abs().min()


@pytest.mark.parametrize(
    "numel,ratio", [(1000, 10), (300_000, 100), (1 << 20, 100), (1 << 20, 1000)]
)
def test_exact_selection_keeps_exactly_the_largest(numel: int, ratio: int) -> None:
    x = heavy_tailed(numel)
    payload = TopKEncoder(ratio=ratio, selection="exact").encode(x)[0]
    assert isinstance(payload, SparsePayload)
    assert payload.values.numel() == math.ceil(numel / ratio)
    assert_is_top_magnitude(payload.values, payload.indices, x)


@pytest.mark.parametrize(
    "numel,ratio", [(300_000, 10), (1 << 20, 100), (1 << 22, 100), (1 << 20, 1000)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_threshold_selection_keeps_the_largest_within_tolerance(numel, ratio, seed) -> None:
    x = heavy_tailed(numel, seed)
    payload = TopKEncoder(ratio=ratio, selection="threshold", seed=seed).encode(x)[0]
    k = keep_count(numel, ratio)
    kept = payload.values.numel()
    assert (1 - THRESHOLD_TOLERANCE) * k <= kept <= (1 + THRESHOLD_TOLERANCE) * k
    assert_is_top_magnitude(payload.values, payload.indices, x)


def test_threshold_selection_corrects_a_bad_sample() -> None:
    """Many equal magnitudes make the sampled threshold keep far too many: it trims to k."""
    x = torch.ones(1 << 20)
    x[:5000] = torch.arange(5000, dtype=torch.float32) + 2
    payload = TopKEncoder(ratio=100, selection="threshold").encode(x)[0]
    assert payload.values.numel() == keep_count(x.numel(), 100)
    assert_is_top_magnitude(payload.values, payload.indices, x)


@pytest.mark.parametrize("selection", ["exact", "threshold"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_entry_is_always_delivered_and_resets_the_residual(selection, bad) -> None:
    x = heavy_tailed(1 << 20)
    x[12345] = bad
    residual = torch.full((x.numel(),), 0.5)
    payload, new_residual = TopKEncoder(ratio=100, selection=selection).encode(x, residual)
    assert isinstance(payload, SparsePayload)
    restored = payload.decode_into(torch.zeros_like(x))
    torch.testing.assert_close(restored[12345], x[12345], equal_nan=True, rtol=0, atol=0)
    assert torch.count_nonzero(new_residual) == 0
    assert torch.equal(residual, torch.full((x.numel(),), 0.5))  # the old one is only read


def test_non_finite_residual_entries_never_survive() -> None:
    """An overflow resets the residual even where the gradient itself was finite."""
    encoder = TopKEncoder(ratio=100, selection="exact")
    residual = torch.zeros(1 << 16)
    _, residual = encoder.encode(heavy_tailed(1 << 16), residual)
    assert torch.count_nonzero(residual) > 0
    overflow = heavy_tailed(1 << 16)
    overflow[7] = float("inf")
    _, residual = encoder.encode(overflow, residual)
    assert torch.count_nonzero(residual) == 0
    _, residual = encoder.encode(heavy_tailed(1 << 16), residual)
    assert torch.isfinite(residual).all() and torch.count_nonzero(residual) > 0


def test_all_nan_gradient_is_delivered_as_nan() -> None:
    x = torch.full((1 << 18,), float("nan"))
    payload = TopKEncoder(ratio=100, selection="threshold").encode(x)[0]
    assert payload.values.numel() > 0 and payload.values.isnan().all()
    assert payload.indices.unique().numel() == payload.indices.numel()


@pytest.mark.parametrize("selection", ["exact", "threshold"])
def test_error_feedback_conserves_every_gradient(selection: str) -> None:
    """Delivered sum plus the final residual equals the gradient sum, step after step."""
    encoder = TopKEncoder(ratio=50, selection=selection)
    numel = 1 << 18
    residual = torch.zeros(numel)
    delivered = torch.zeros(numel, dtype=torch.float64)
    seen = torch.zeros(numel, dtype=torch.float64)
    for step in range(5):
        grad = heavy_tailed(numel, seed=step)
        seen += grad.double()
        payload, residual = encoder.encode(grad, residual)
        delivered += decode(payload, numel).double()
    torch.testing.assert_close(delivered + residual.double(), seen, rtol=0, atol=1e-5)
    assert torch.count_nonzero(residual) > 0  # something was really held back


def test_error_feedback_keeps_bf16_rounding_in_the_residual() -> None:
    encoder = TopKEncoder(ratio=10, selection="exact")
    grad = heavy_tailed(100_000).to(torch.bfloat16)
    residual = torch.full((grad.numel(),), 1e-3)
    expected = grad.float() + residual
    payload, residual = encoder.encode(grad, residual)
    assert payload.values.dtype == torch.bfloat16
    delivered = payload.decode_into(torch.zeros(grad.numel()))
    torch.testing.assert_close(delivered + residual, expected, rtol=0, atol=1e-7)


def test_indices_are_int32_payload_bytes_are_counted() -> None:
    payload = TopKEncoder(ratio=100, selection="exact").encode(heavy_tailed(100_000))[0]
    assert payload.indices.dtype == torch.int32
    assert payload.nbytes == 1000 * (4 + 4)


def test_add_to_adds_a_cached_payload_to_the_next_gradient() -> None:
    """Gradient accumulation: dense in place (plain PyTorch's bits), sparse out of place."""
    numel = 10_000
    a, b = heavy_tailed(numel, 0), heavy_tailed(numel, 1)
    sparse = TopKEncoder(ratio=10, selection="exact").encode(a)[0]
    summed = sparse.add_to(b.clone())
    torch.testing.assert_close(summed, b + decode(sparse, numel), rtol=0, atol=0)
    target = b.clone()
    assert DensePayload(a).add_to(target) is target
    assert torch.equal(target, a + b)  # plain PyTorch accumulates old + new


def test_gradient_compressor_round_trip() -> None:
    grad = heavy_tailed(40_000).reshape(200, 200)
    compressor = GradientCompressor(sparsity=0.99)
    values, indices = compressor.compress(grad)
    assert values.numel() == 400 and indices.dtype == torch.int64
    restored = compressor.decompress(values, indices, grad.shape)
    assert restored.shape == grad.shape
    assert torch.count_nonzero(restored) == 400
    assert_is_top_magnitude(values, indices, grad.reshape(-1))
    lossless = GradientCompressor(sparsity=0.0)
    assert torch.equal(lossless.decompress(*lossless.compress(grad), grad.shape), grad)


@pytest.mark.parametrize("sparsity", [1.0, -0.1, 1.5, float("nan")])
def test_gradient_compressor_rejects_bad_sparsity(sparsity: float) -> None:
    with pytest.raises(ValueError, match="sparsity"):
        GradientCompressor(sparsity=sparsity)
    with pytest.raises(TypeError, match="sparsity"):
        GradientCompressor(sparsity="0.9")


def test_selector_reuses_its_scratch_buffers() -> None:
    selector = TopKSelector(method="threshold")
    selector.select(heavy_tailed(1 << 20), 1 << 13)
    first = {key: buf.data_ptr() for key, buf in selector._abs_buffers.items()}
    selector.select(heavy_tailed(1 << 19), 1 << 12)
    assert first == {key: buf.data_ptr() for key, buf in selector._abs_buffers.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_overwrites_whatever_the_buffer_held(dtype: torch.dtype) -> None:
    x = heavy_tailed(1 << 16).to(dtype)
    sparse = TopKEncoder(ratio=100, selection="exact").encode(x)[0]
    for payload in (sparse, DensePayload(x)):
        garbage = torch.full((x.numel(),), 7.0, dtype=dtype)
        expected = payload.add_to(torch.zeros(x.numel(), dtype=dtype))
        assert torch.equal(payload.decode_into(garbage), expected)
    assert torch.count_nonzero(expected) == x.numel()  # the dense payload is all of x
