"""Encode and decode throughput of the codecs against torch.topk and a plain copy.

Each benchmark's extra_info holds the elements, ratio, kept count, bytes and GB/s; GB/s is
the dense fp32 bytes (read by encode, written by decode) over the median time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from gradient_cache.codecs import LADDER, SparsePayload, TopKEncoder, keep_count, make_codec
from perf.harness import GB, benchmarks_enabled, cpu_snapshot, others_share, record

FULL_SIZES = {"1M": 2**20, "16M": 16 * 2**20, "64M": 64 * 2**20}
SMOKE_SIZES = {"1M": 2**20}
RATIOS = (10, 100, 1000)
# Fewer rounds where one call takes seconds (torch.topk on 64M elements).
ROUNDS = {2**20: 15, 16 * 2**20: 5, 64 * 2**20: 3}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "numel" in metafunc.fixturenames:
        sizes = FULL_SIZES if benchmarks_enabled(metafunc.config) else SMOKE_SIZES
        metafunc.parametrize("numel", list(sizes.values()), ids=list(sizes), scope="module")


@pytest.fixture(scope="module")
def gradient(numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(0))


def run(benchmark, fn: Callable[[], object], *, numel: int) -> float | None:
    """Benchmark ``fn``; its median seconds, or None when benchmarks are disabled."""
    start = cpu_snapshot()
    benchmark.pedantic(fn, rounds=ROUNDS[numel], warmup_rounds=1)
    benchmark.extra_info["others_cpu"] = others_share(start, cpu_snapshot())
    return benchmark.stats.stats.median if benchmark.enabled else None


def report(benchmark, seconds: float | None, **row: object) -> None:
    gb_per_s = row["bytes"] / seconds / GB if seconds else None
    benchmark.extra_info.update(row, gb_per_s=gb_per_s)
    if seconds:
        others = benchmark.extra_info["others_cpu"]
        record("codec", **row, ms=seconds * 1e3, gb_per_s=gb_per_s, others_cpu=others)


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    indices = torch.topk(x.abs(), k, sorted=False).indices
    return x[indices], indices


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("method", ["threshold", "exact", "torch.topk"])
def test_encode(benchmark, gradient: torch.Tensor, numel: int, ratio: int, method: str) -> None:
    benchmark.group = f"encode {numel:,} fp32"
    k = keep_count(numel, ratio)
    if method == "torch.topk":
        encode: Callable[[], object] = functools.partial(topk_reference, gradient, k)
        kept = k
    else:
        encoder = TopKEncoder(ratio=ratio, selection=method)
        encode = functools.partial(encoder.encode, gradient)
        payload = encoder.encode(gradient)[0]
        assert isinstance(payload, SparsePayload)
        kept = payload.values.numel()
    seconds = run(benchmark, encode, numel=numel)
    report(
        benchmark,
        seconds,
        op="encode",
        method=method,
        numel=numel,
        ratio=ratio,
        k=k,
        kept=kept,
        bytes=gradient.nbytes,
    )


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("method", ["decode_into", "torch.topk"])
def test_decode(benchmark, gradient: torch.Tensor, numel: int, ratio: int, method: str) -> None:
    """Into a preallocated dense tensor (zeroed each time): restore minus the allocation."""
    benchmark.group = f"decode {numel:,} fp32"
    payload = TopKEncoder(ratio=ratio, selection="threshold").encode(gradient)[0]
    assert isinstance(payload, SparsePayload)
    out = torch.empty_like(gradient)
    indices = payload.indices.long()

    def decode() -> None:
        if method == "torch.topk":  # the reference's way back: scatter, int64 indices
            out.zero_().scatter_(0, indices, payload.values)
        else:
            payload.decode_into(out)

    seconds = run(benchmark, decode, numel=numel)
    expected = torch.zeros_like(gradient).scatter_(0, indices, payload.values)
    torch.testing.assert_close(out, expected)
    report(
        benchmark,
        seconds,
        op="decode",
        method=method,
        numel=numel,
        ratio=ratio,
        k=keep_count(numel, ratio),
        kept=payload.values.numel(),
        bytes=gradient.nbytes,
    )


def test_copy_bandwidth(benchmark, gradient: torch.Tensor, numel: int) -> None:
    """The ceiling: copying the gradient into a preallocated buffer."""
    benchmark.group = f"copy {numel:,} fp32"
    out = torch.empty_like(gradient)
    seconds = run(benchmark, lambda: out.copy_(gradient), numel=numel)
    report(
        benchmark,
        seconds,
        op="copy",
        method="copy",
        numel=numel,
        ratio=None,
        k=None,
        kept=None,
        bytes=gradient.nbytes,
    )


@pytest.mark.parametrize("name", [name for name in LADDER if name != "topk"])
def test_dense_codec_roundtrip(benchmark, gradient: torch.Tensor, numel: int, name: str) -> None:
    """Encode then decode into a preallocated tensor: what one cached step costs a dense
    codec (no residual, no selection). GB/s counts the fp32 gradient once."""
    benchmark.group = f"dense codec round trip {numel:,} fp32"
    codec = make_codec(name)
    out = torch.empty_like(gradient)

    def roundtrip() -> None:
        codec.encode(gradient, None, loss_scale=None)[0].decode_into(out)

    seconds = run(benchmark, roundtrip, numel=numel)
    codec.release_scratch()
    payload = codec.encode(gradient, None, loss_scale=None)[0]
    report(
        benchmark,
        seconds,
        op="roundtrip",
        method=name,
        numel=numel,
        ratio=round(gradient.nbytes / payload.nbytes, 2),
        k=None,
        kept=numel,
        bytes=gradient.nbytes,
    )
