"""torch.compile: a compiled model, and compiled autograd, with the cache at ratio 1.

A compiled model's backward is one graph that returns every parameter's gradient when it
ends; only then do the post-accumulate-grad hooks fire. The cache still takes each
gradient as soon as it is handed over, so what it saves after backward (between
micro-batches, at the fused step) is unchanged; what it saved during backward is gone.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from helpers import (
    CHECKPOINT_MICRO_BATCHES,
    CHECKPOINT_STEPS,
    assert_same_parameters,
    batches,
    make_model,
    run_checkpointed,
    save_and_load,
    train,
)

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


def test_a_compiled_model_with_the_state_on_the_host_gives_the_compiled_plain_result() -> None:
    """offload_optimizer_state under a compiled model (dynamo, eager backend): the state's
    journeys are outside the graph; bit for bit with plain."""
    torch._dynamo.reset()
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, offload_optimizer_state=True, **LOSSLESS)
    data = batches(3)
    compiled = functools.partial(torch.compile, backend="eager")
    plain_losses = train(compiled(plain), data, micro_batches=2)
    cached_losses = train(compiled(cached), data, manager=manager, micro_batches=2, fused_step=True)
    assert plain_losses == cached_losses
    assert_same_parameters(plain, cached)
    assert manager.summary().optimizer_state_host_mb > 0


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


# Error feedback: residuals and cached payloads are saved by name too.
RESUMABLE = dict(compression_ratio=100, codec="topk", min_compress_numel=1)


def _build(*, compiled: bool, **options):
    """The model, what the loop calls (compiled or not), the cache on that, the optimizer."""
    model = make_model()
    called = torch.compile(model, backend="eager") if compiled else model
    manager = gradient_cache.create_gradient_cache(called, **RESUMABLE, **options)
    return model, called, manager, torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.mark.parametrize(
    "saved_compiled", [True, False], ids=["compiled to plain", "plain to compiled"]
)
def test_a_checkpoint_resumes_with_or_without_compile(saved_compiled: bool) -> None:
    """A cache on torch.compile(model) names the parameters as the model does: its
    checkpoint, taken mid-accumulation, resumes on the plain model, and the reverse, bit
    for bit with a run never interrupted."""
    torch._dynamo.reset()
    end, cut = CHECKPOINT_STEPS * CHECKPOINT_MICRO_BATCHES, 5
    reference, _, reference_manager, reference_optimizer = _build(compiled=False)
    run_checkpointed(reference, reference_manager, reference_optimizer, range(end))

    model, called, manager, optimizer = _build(compiled=saved_compiled)
    run_checkpointed(called, manager, optimizer, range(cut))
    saved = save_and_load(model, manager, optimizer)
    plain_names = [name for name, _ in model.named_parameters()]
    assert saved["cache"]["parameters"] == plain_names
    assert sorted(saved["cache"]["residuals"]) == sorted(plain_names)
    assert saved["cache"]["buckets"]  # a micro-batch's gradients, cached by name
    manager.remove_hooks()
    model, called, manager, optimizer = _build(compiled=not saved_compiled)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    manager.load_state_dict(saved["cache"])
    run_checkpointed(called, manager, optimizer, range(cut, end))
    assert_same_parameters(reference, model)


def test_exclude_layers_match_a_compiled_model_s_own_names() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "matches no trainable parameter name"
        model, _, manager, _ = _build(compiled=True, exclude_layers=["norm."])
    kept = [name for name, _ in model.named_parameters() if not name.startswith("norm.")]
    assert manager.state_dict()["parameters"] == kept


def test_a_compiled_submodule_s_names_are_refused_on_load_naming_compile() -> None:
    """A submodule compiled on its own keeps its '_orig_mod' in the names: resuming
    without it is refused with advice that names torch.compile."""
    torch._dynamo.reset()
    model = make_model()
    model.mlp = torch.compile(model.mlp, backend="eager")
    manager = gradient_cache.create_gradient_cache(model, **RESUMABLE)
    run_checkpointed(model, manager, torch.optim.Adam(model.parameters()), range(1))
    state = manager.state_dict()
    manager.remove_hooks()
    plain = _build(compiled=False)[2]
    with pytest.raises(ValueError, match=r"'mlp\._orig_mod\.0\.bias'.*torch\.compile") as raised:
        plain.load_state_dict(state)
    # Only the same submodules compiled load it (a whole compiled model names them plainly).
    assert "to load this state, compile the same submodules as when it was saved" in str(
        raised.value
    )
