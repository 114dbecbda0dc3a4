"""Gradient readers in a training loop of one's own (no integration): ``clip_grad_norm_``,
``GradScaler.unscale_`` and ``clip_grad_value_`` between backward and the restore see the
cached gradients, as under the integrations (`gradient_cache.gradient_readers`), bit for
bit with the same loop without the cache."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import (
    assert_same_parameters,
    batches,
    detach_managers_other_tests_left,
    loss_of,
    make_model,
)
from torch import nn

import gradient_cache

LOSSLESS = dict(compression_ratio=1, bucket_size_mb=0.004)  # several buckets per backward
MICRO_BATCHES = 3


def backward_in_micro_batches(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, scale: object = None
) -> None:
    for part in range(MICRO_BATCHES):
        rows = slice(part * 4 // MICRO_BATCHES, (part + 1) * 4 // MICRO_BATCHES)
        loss = loss_of(model, tokens[rows], targets[rows]) / MICRO_BATCHES
        (loss if scale is None else scale(loss)).backward()


@pytest.mark.parametrize(
    ("finish", "options"),
    [("step", {}), ("apply_gradients", {}), ("step", {"offload_optimizer_state": True})],
    ids=["step", "apply_gradients", "step-state-on-host"],
)
def test_clip_grad_norm_in_a_loop_of_your_own_is_answered_from_the_cache(
    finish: str, options: dict
) -> None:
    """nanoGPT's clip line kept, the step replaced: the returned norm is plain's, the clip is
    applied as the gradients are restored (nothing restored by the clip), the weights are
    plain's, bit for bit."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    hook_manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **options)
    for tokens, targets in batches(4):
        backward_in_micro_batches(plain, tokens, targets)
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        plain_opt.step()
        plain_opt.zero_grad()

        backward_in_micro_batches(cached, tokens, targets)
        norm = torch.nn.utils.clip_grad_norm_(cached.parameters(), 0.05)
        assert torch.equal(norm, expected) and norm > 0.05  # every step clipped
        assert all(p.grad is None for p in cached.parameters())  # the clip restored nothing
        if finish == "step":
            hook_manager.step(cached_opt)
        else:
            hook_manager.apply_gradients()
            cached_opt.step()
        cached_opt.zero_grad()
    assert_same_parameters(plain, cached)
    hook_manager.remove_hooks()


def test_a_parameter_listed_twice_is_counted_and_clipped_twice_as_torch_does() -> None:
    """``list(a.parameters()) + list(b.parameters())`` over a tied weight lists it twice:
    torch's norm counts its gradient twice and clips it twice. Answered from the cache, it
    was counted once (norms 4.59 for plain's 4.62 in a probe); now torch's own function
    runs over the restored gradients."""

    def train(model: nn.Module, hook_manager: object = None) -> list[torch.Tensor]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        listed = [*model.parameters(), model.embed.weight]  # the tied weight, again
        norms = []
        for tokens, targets in batches(3):
            loss_of(model, tokens, targets).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(listed, 0.05))
            optimizer.step()
            optimizer.zero_grad()
        return norms

    plain, cached = make_model(), make_model()
    expected = train(plain)
    hook_manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    assert all(torch.equal(a, b) for a, b in zip(train(cached), expected, strict=True))
    assert_same_parameters(plain, cached)
    hook_manager.remove_hooks()
    # With the state on the host every gradient cannot come back: refused, naming the repeat.
    state_on_host = make_model()
    hook_manager = gradient_cache.create_gradient_cache(
        state_on_host, **LOSSLESS, offload_optimizer_state=True
    )
    with pytest.raises(RuntimeError, match="naming a parameter twice"):
        train(state_on_host)
    hook_manager.remove_hooks()


def nanogpt_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: object,
) -> torch.Tensor:
    """nanoGPT's train.py from its backward to its zero_grad, with its step given."""
    for tokens, targets in batches(4):
        backward_in_micro_batches(model, tokens, targets, scaler.scale)
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        step(optimizer)  # type: ignore[operator]
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return norm


def test_nanogpts_bf16_loop_with_its_step_replaced_equals_plain() -> None:
    """bf16: nanoGPT's GradScaler is disabled, so its unscale_ reads nothing and restores
    nothing; the clip is answered from the cache and applied by hook_manager.step."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    plain_scaler = torch.amp.GradScaler("cpu", enabled=False)
    cached_scaler = torch.amp.GradScaler("cpu", enabled=False)
    expected = nanogpt_step(plain, plain_opt, plain_scaler, plain_scaler.step)
    with gradient_cache.create_gradient_cache(cached, **LOSSLESS) as hook_manager:

        def step(optimizer: torch.optim.Optimizer) -> None:
            assert all(p.grad is None for p in cached.parameters())  # nothing restored yet
            hook_manager.step(optimizer)

        got = nanogpt_step(cached, cached_opt, cached_scaler, step)
        assert hook_manager.summary().steps == 4
    assert torch.equal(got, expected)
    assert_same_parameters(plain, cached)


def test_an_enabled_grad_scalers_unscale_restores_first_and_the_loop_equals_plain() -> None:
    """fp16: unscale_ reads every gradient, so the cached ones are restored first (the state
    is on the device); clip and scaler.step then run on them as without the cache."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    cached_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    expected = nanogpt_step(plain, plain_opt, plain_scaler, plain_scaler.step)
    with gradient_cache.create_gradient_cache(cached, **LOSSLESS):
        got = nanogpt_step(cached, cached_opt, cached_scaler, cached_scaler.step)
    assert torch.equal(got, expected)
    assert_same_parameters(plain, cached)
    assert cached_scaler.get_scale() == plain_scaler.get_scale()


@pytest.mark.parametrize("reader", ["clip_grad_value_", "unscale_"])
def test_with_the_state_on_the_host_every_gradient_readers_are_refused_with_the_fix(
    reader: str,
) -> None:
    """Restoring every gradient would bring the whole optimizer state to the device at the
    step: refused, naming hook_manager.step's options; nothing is lost, the step goes on."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradient_cache.create_gradient_cache(
        model, **LOSSLESS, offload_optimizer_state=True
    ) as hook_manager:
        scaler.scale(loss_of(model, *batches(1)[0])).backward()
        with pytest.raises(RuntimeError, match="needs every gradient on the device") as error:
            if reader == "clip_grad_value_":
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.001)
            else:
                scaler.unscale_(optimizer)
        assert "max_grad_norm=" in str(error.value) and "grad_scaler=" in str(error.value)
        assert all(p.grad is None for p in model.parameters())  # still cached
        hook_manager.step(optimizer)
        assert hook_manager.summary().steps == 1


def reader_functions() -> list[object]:
    utils = torch.nn.utils
    return [
        utils.clip_grad_norm_,
        utils.clip_grad.clip_grad_norm_,
        utils.clip_grad_value_,
        torch.amp.GradScaler.unscale_,
    ]


def test_the_readers_are_swapped_while_a_manager_is_attached_and_only_then() -> None:
    """One swap, in place while any manager is attached: the originals come back when the
    last one is detached, closed or collected, and the swap holds no manager alive."""
    detach_managers_other_tests_left()
    originals = reader_functions()
    first = gradient_cache.create_gradient_cache(make_model(), **LOSSLESS)
    swapped = reader_functions()
    assert all(a is not b for a, b in zip(swapped, originals, strict=True))
    second = gradient_cache.create_gradient_cache(make_model(), **LOSSLESS)
    assert reader_functions() == swapped  # one swap, not one per manager
    first.remove_hooks()
    assert reader_functions() == swapped  # the second is still attached
    second.remove_hooks()
    assert reader_functions() == originals  # closed managers, still referenced, keep nothing
    kept = make_model()
    hook_manager = gradient_cache.create_gradient_cache(kept, **LOSSLESS)
    loss_of(kept, *batches(1)[0]).backward()
    hook_manager.step(torch.optim.SGD(kept.parameters(), lr=0.1))
    del hook_manager  # dropped after a step: detached quietly
    gc.collect()
    assert reader_functions() == originals


def test_readers_over_another_models_parameters_leave_the_cache_alone() -> None:
    """The swap serves every caller while a manager is attached: a reader over a model the
    cache does not hold runs as torch's own and restores nothing (which, with the state on
    the host, would raise)."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    tokens, targets = batches(1)[0]
    with gradient_cache.create_gradient_cache(
        cached, **LOSSLESS, offload_optimizer_state=True
    ) as hook_manager:
        loss_of(cached, tokens, targets).backward()
        scaler.scale(loss_of(plain, tokens, targets)).backward()
        scaler.unscale_(plain_opt)
        expected = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
        assert torch.equal(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05), expected)
        torch.nn.utils.clip_grad_value_(plain.parameters(), 0.001)
        assert all(p.grad is None for p in cached.parameters())  # still cached
        scaler.step(plain_opt)
        hook_manager.step(cached_opt)


@pytest.mark.parametrize("codec", [{"codec": "int8"}, {"codec": "topk", "compression_ratio": 100}])
def test_a_batch_skipped_after_its_norm_was_read_leaves_no_trace(codec: dict) -> None:
    """clip_grad_norm_ answered from the cache sets the norm type the encodes compute from
    then on; the batch skipped with zero_grad() after it left that type set, so the next
    clipped step read the encodes' norms where the run that never saw the batch reads its
    payloads' (0.065 off with top-k in a probe). The discard puts the type back."""

    def run(skip: bool) -> nn.Module:
        model = make_model()
        manager = gradient_cache.create_gradient_cache(model, min_compress_numel=1, **codec)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for index, (tokens, targets) in enumerate(batches(3)):
            if skip and index == 0:
                loss_of(model, *batches(1, seed=7)[0]).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.zero_grad()
            loss_of(model, tokens, targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            manager.step(optimizer)
            optimizer.zero_grad()
        manager.remove_hooks()
        return model

    assert_same_parameters(run(skip=False), run(skip=True))


def test_sam_reading_its_gradients_after_apply_gradients_trains_as_plain() -> None:
    """SAM (sharpness-aware minimization) reads ``.grad`` after its first backward to move
    the weights up the gradient, then steps on the second backward's gradients there. With
    the cache ``.grad`` is None after backward (the cache holds it), so a loop skipping None
    gradients never moved the weights, silently (probe A: plain SGD's result, 0.064 off):
    docs/training-loop.md says to call ``apply_gradients()`` after each backward whose
    gradients the loop reads. Done so, SAM trains as plain, bit for bit."""
    data = batches(3)

    def sam(model: nn.Module, apply: object) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for tokens, targets in data:
            loss_of(model, tokens, targets).backward()
            apply()
            params = [p for p in model.parameters() if p.grad is not None]
            with torch.no_grad():
                norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
                moves = [0.05 * p.grad / (norm + 1e-12) for p in params]
                torch._foreach_add_(params, moves)
            optimizer.zero_grad()
            loss_of(model, tokens, targets).backward()
            apply()
            with torch.no_grad():
                torch._foreach_sub_(params, moves)
            optimizer.step()
            optimizer.zero_grad()

    plain = make_model()
    sam(plain, lambda: None)
    cached = make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    sam(cached, manager.apply_gradients)
    assert_same_parameters(plain, cached)
