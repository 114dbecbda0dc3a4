"""A manager no one keeps takes its hooks with it: ``create_gradient_cache(model)`` without
keeping the result must not leave hooks that swallow every gradient for a cache no one can
restore, nor hold the model against a new cache."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from helpers import assert_same_parameters, batches, loss_of, make_model
from torch import nn

import gradient_cache

LOSSLESS = dict(compression_ratio=1, bucket_size_mb=0.004)
DROPPED = "garbage-collected while attached"


def plain_steps(model: nn.Module, steps: int = 3) -> None:
    """A plain loop: backward, step, zero_grad; .grad must be set after each backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens, targets in batches(steps):
        loss_of(model, tokens, targets).backward()
        assert all(p.grad is not None for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()


def train_side_by_side(plain, cached, hook_manager, *, collect: bool = False) -> None:
    """Three AdamW steps each: plain's, and the cache's fused step, checking that backward
    left the cached model's gradients with the cache; ``collect``: a gc pass first."""
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    for tokens, targets in batches(3):
        if collect:
            gc.collect()
        loss_of(plain, tokens, targets).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        loss_of(cached, tokens, targets).backward()
        assert all(p.grad is None for p in cached.parameters())  # cached
        hook_manager.step(cached_opt)


def test_an_unkept_cache_warns_and_leaves_the_model_to_train_as_plain() -> None:
    plain, cached = make_model(), make_model()
    with pytest.warns(UserWarning, match=DROPPED) as caught:
        gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    assert caught[0].filename == __file__  # points at the line that dropped it
    plain_steps(plain)
    plain_steps(cached)
    assert_same_parameters(plain, cached)


def test_a_new_cache_after_an_unkept_one_takes_the_model() -> None:
    plain, cached = make_model(), make_model()
    with pytest.warns(UserWarning, match=DROPPED):
        gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    hook_manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    train_side_by_side(plain, cached, hook_manager)
    assert_same_parameters(plain, cached)
    hook_manager.remove_hooks()


def test_a_manager_dropped_while_it_holds_gradients_gives_them_back() -> None:
    """Dropped between backward and step (a function that returned it unkept, say): the
    cached gradients are back in .grad, so the optimizer's step is plain's."""
    plain, cached = make_model(), make_model()
    tokens, targets = batches(1)[0]
    hook_manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    loss_of(cached, tokens, targets).backward()
    with pytest.warns(UserWarning, match=DROPPED):
        del hook_manager
    loss_of(plain, tokens, targets).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), cached.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_a_manager_dropped_after_training_detaches_quietly_and_leaks_nothing() -> None:
    """The end of a training function: the manager did its steps and goes out of scope. Its
    hooks and its engine go with it, without a warning."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook_manager = gradient_cache.create_gradient_cache(model, **LOSSLESS)
    loss_of(model, *batches(1)[0]).backward()
    hook_manager.step(optimizer)
    manager, engine = weakref.ref(hook_manager), weakref.ref(hook_manager.engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del hook_manager
        gc.collect()
    assert manager() is None and engine() is None
    model.norm.weight = nn.Parameter(model.norm.weight.detach().clone())  # no watch left
    plain_steps(model, steps=1)  # no hook left on the model


def test_a_kept_manager_is_not_collected() -> None:
    """The finalizer holds nothing that keeps the manager alive, nor drops a kept one."""
    plain, cached = make_model(), make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hook_manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
        train_side_by_side(plain, cached, hook_manager, collect=True)
    assert_same_parameters(plain, cached)
    assert hook_manager.summary().steps == 3
    hook_manager.remove_hooks()


def test_a_model_collected_with_the_manager_it_held_needs_no_word() -> None:
    """The seed's LightningModule pattern (``self.hook_manager = create_gradient_cache(self)``):
    model and manager go together, at a garbage collection; nothing is left to warn about."""
    model = make_model()
    model.hook_manager = gradient_cache.create_gradient_cache(model, **LOSSLESS)
    model.itself = [model]  # a cycle, as a LightningModule and its trainer make
    engine = weakref.ref(model.hook_manager.engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del model
        gc.collect()
    assert engine() is None
