"""torch.compile: a compiled model, and compiled autograd, with the cache at ratio 1.

A compiled model's backward is one graph that returns every parameter's gradient when it
ends; only then do the post-accumulate-grad hooks fire. The cache still takes each
gradient as soon as it is handed over, so what it saves after backward (between
micro-batches, at the fused step) is unchanged; what it saved during backward is gone.
"""

from __future__ import annotations

import functools

import torch
from helpers import assert_same_parameters, batches, make_model, train

import gradient_cache

LOSSLESS = dict(compression_ratio=1, bucket_size_mb=0.004)  # several buckets per backward


def test_a_compiled_model_with_the_cache_gives_the_compiled_plain_result() -> None:
    """CPU inductor; gradient accumulation and the fused step included."""
    torch._dynamo.reset()
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    data = batches(3)
    plain_losses = train(torch.compile(plain), data, micro_batches=2)
    cached_losses = train(
        torch.compile(cached), data, manager=manager, micro_batches=2, fused_step=True
    )
    assert plain_losses == cached_losses
    assert_same_parameters(plain, cached)
    assert manager.get_compression_summary()["steps"] == 3


def test_compiled_autograd_with_the_cache_gives_the_plain_result() -> None:
    """Compiled autograd calls the cache's hooks from its graph, each step."""
    torch._dynamo.reset()
    compiler = functools.partial(torch.compile, backend="eager")
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    data = batches(3)
    with torch._dynamo.compiled_autograd._enable(compiler):
        plain_losses = train(plain, data)
    with torch._dynamo.compiled_autograd._enable(compiler):
        cached_losses = train(cached, data, manager=manager)
    assert plain_losses == cached_losses
    assert_same_parameters(plain, cached)
    assert manager.get_compression_summary()["steps"] == 3
