"""Training with the cache against plain PyTorch: same seed, same data, stated tolerances."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from helpers import (
    FailsOnce,
    MadeGradients,
    assert_same_parameters,
    batches,
    loss_of,
    make_model,
    train,
    train_through_a_failed_step,
)

import gradient_cache
from gradient_cache.engine import step as step_module
from gradient_cache.engine.step_state import StepStateError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Lossless offload hands the optimizer the very same numbers, so weights match bit for bit.
LOSSLESS = dict(compression_ratio=1)
SMALL_BUCKETS = dict(bucket_size_mb=0.004)  # ~4 KiB: several buckets per backward


def test_quick_start_verbatim() -> None:
    """The README's loop, as users type it, trains like plain PyTorch at ratio 1."""
    model = make_model()
    reference = copy.deepcopy(model)
    dataloader = [tokens for tokens, _ in batches(5)]

    hook_manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    optimizer = torch.optim.Adam(model.parameters())
    for batch in dataloader:
        loss = model(batch).mean()
        loss.backward()
        hook_manager.compress_and_free_gradients()
        hook_manager.apply_gradients()
        optimizer.step()
        optimizer.zero_grad()

    reference_optimizer = torch.optim.Adam(reference.parameters())
    for batch in dataloader:
        reference(batch).mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert_same_parameters(model, reference)


@pytest.mark.parametrize("fused_step", [False, True])
def test_lossless_matches_plain_over_many_steps(fused_step: bool) -> None:
    plain, cached = make_model(), make_model()
    data = batches(20)
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **SMALL_BUCKETS)
    plain_losses = train(plain, data)
    cached_losses = train(cached, data, manager=manager, fused_step=fused_step)
    assert cached_losses == plain_losses
    assert_same_parameters(plain, cached)


def test_gradients_leave_the_parameters_during_backward() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, **LOSSLESS, **SMALL_BUCKETS)
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    manager.compress_and_free_gradients()
    assert all(p.grad is None for p in model.parameters())
    manager.apply_gradients()
    assert all(p.grad is not None for p in model.parameters())


# 64 MiB: no bucket fills, so later micro-batches add into gradients waiting in the open one.
@pytest.mark.parametrize("bucket_size_mb", [0.004, 64])
@pytest.mark.parametrize("compress_each_micro_batch", [True, False])
def test_gradient_accumulation_sums_exactly_when_lossless(
    compress_each_micro_batch: bool, bucket_size_mb: float
) -> None:
    plain, cached = make_model(), make_model()
    data = batches(6)
    manager = gradient_cache.create_gradient_cache(
        cached, **LOSSLESS, bucket_size_mb=bucket_size_mb
    )
    train(plain, data, micro_batches=4)
    train(
        cached,
        data,
        manager=manager,
        micro_batches=4,
        compress_each_micro_batch=compress_each_micro_batch,
    )
    assert_same_parameters(plain, cached)


def test_excluded_layers_keep_their_gradients_on_the_parameters() -> None:
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, compression_ratio=100, exclude_layers=["norm", "mlp.2"], min_compress_numel=1
    )
    tokens, targets = batches(1)[0]
    loss_of(plain, tokens, targets).backward()
    loss_of(cached, tokens, targets).backward()
    manager.compress_and_free_gradients()
    excluded = {"norm.weight", "norm.bias", "mlp.2.weight", "mlp.2.bias"}
    for (name, p_plain), (_, p_cached) in zip(
        plain.named_parameters(), cached.named_parameters(), strict=True
    ):
        if name in excluded:
            assert torch.equal(p_cached.grad, p_plain.grad), name
        else:
            assert p_cached.grad is None, name
    manager.apply_gradients()
    for (name, p_plain), (_, p_cached) in zip(
        plain.named_parameters(), cached.named_parameters(), strict=True
    ):
        if name in excluded:
            assert torch.equal(p_cached.grad, p_plain.grad), name
    assert manager.get_compression_summary()["num_excluded_parameters"] == 4


def test_unused_and_frozen_parameters_stay_as_plain_pytorch_leaves_them() -> None:
    plain, cached = make_model(with_unused=True), make_model(with_unused=True)
    for model in (plain, cached):
        model.mlp[0].bias.requires_grad_(False)
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **SMALL_BUCKETS)
    data = batches(3)
    train(plain, data)
    train(cached, data, manager=manager)
    assert_same_parameters(plain, cached)
    tokens, targets = data[0]
    loss_of(cached, tokens, targets).backward()
    manager.apply_gradients()
    assert cached.unused.weight.grad is None
    assert cached.mlp[0].bias.grad is None
    assert "unused.weight" not in manager.get_compression_summary()["layers"]


def test_tied_weight_is_offloaded_once_with_both_contributions() -> None:
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    tokens, targets = batches(1)[0]
    loss_of(plain, tokens, targets).backward()
    loss_of(cached, tokens, targets).backward()
    manager.apply_gradients()
    assert torch.equal(cached.embed.weight.grad, plain.embed.weight.grad)
    assert list(manager.get_compression_summary()["layers"]).count("embed.weight") == 1


def test_bf16_parameters_round_trip_exactly_when_lossless() -> None:
    plain, cached = make_model().to(torch.bfloat16), make_model().to(torch.bfloat16)
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **SMALL_BUCKETS)
    data = batches(5)
    train(plain, data)
    train(cached, data, manager=manager)
    assert_same_parameters(plain, cached)
    assert all(p.dtype == torch.bfloat16 for p in cached.parameters())


def test_bf16_gradients_compress_and_restore_in_bf16() -> None:
    model = make_model().to(torch.bfloat16)
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=10, codec="topk", min_compress_numel=1
    )
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).float().backward()
    manager.apply_gradients()
    for p in model.parameters():
        assert p.grad.dtype == torch.bfloat16
        assert 0 < (p.grad != 0).sum() <= -(-p.numel() // 10) * 1.1 + 1


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    ],
    ids=["sgd", "adam", "adamw"],
)
@pytest.mark.parametrize("ratio", [1, 20])
def test_fused_step_equals_apply_then_step(make_optimizer, ratio: int) -> None:
    """Bucket-by-bucket stepping changes nothing for per-parameter optimizers."""
    applied, fused = make_model(), make_model()
    options = dict(compression_ratio=ratio, min_compress_numel=1, **SMALL_BUCKETS)
    data = batches(8)
    train(
        applied,
        data,
        manager=gradient_cache.create_gradient_cache(applied, **options),
        make_optimizer=make_optimizer,
    )
    train(
        fused,
        data,
        manager=gradient_cache.create_gradient_cache(fused, **options),
        make_optimizer=make_optimizer,
        fused_step=True,
    )
    assert_same_parameters(applied, fused)


def test_fused_step_steps_excluded_layers_exactly_once() -> None:
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, **LOSSLESS, exclude_layers=["norm"], **SMALL_BUCKETS
    )
    data = batches(5)
    train(plain, data)
    train(cached, data, manager=manager, fused_step=True)
    assert_same_parameters(plain, cached)


def test_fused_step_frees_the_restored_gradients() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, **LOSSLESS, exclude_layers=["norm"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    manager.step(optimizer)
    for name, p in model.named_parameters():
        assert (p.grad is not None) == name.startswith("norm"), name


def test_the_encodes_compute_the_clip_norms_once_a_clipped_step_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a clipped fused step, the next backward's encodes compute each gradient's
    norm of its type, so the step computes none from the payloads; a step with another
    norm type (or none) reads the payloads once more, and the encodes follow it."""
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=4, **SMALL_BUCKETS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from_payloads = []
    norm = step_module.gradient_norm  # what reads a cached gradient's norm from its payload
    monkeypatch.setattr(
        step_module, "gradient_norm", lambda grad, p: from_payloads.append(grad) or norm(grad, p)
    )
    norm_types = [2.0, 2.0, 2.0, float("inf"), float("inf"), None, 2.0]
    read_payloads = []
    for norm_type, (tokens, targets) in zip(norm_types, batches(len(norm_types)), strict=True):
        loss_of(model, tokens, targets).backward()
        from_payloads.clear()
        clip = None if norm_type is None else 1e-3
        manager.step(optimizer, max_grad_norm=clip, norm_type=norm_type or 2.0)
        read_payloads.append(bool(from_payloads))
    assert read_payloads == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("ratio", [1, 20])
def test_fused_step_clipping_matches_clip_grad_norm(
    norm_type: float, ratio: int, device: str
) -> None:
    """The clip norm is plain PyTorch's, of the gradients backward made (before any
    compression), computed by the encodes from the step after the first clipped one; the
    first reads it from the host payloads (the compressed gradients' norm, as
    apply_gradients then clip_grad_norm_ give it). Many small buckets, so each is
    restored while the one before steps (on CUDA)."""
    reference, fused = make_model().to(device), make_model().to(device)
    made = MadeGradients(reference)
    options = dict(
        compression_ratio=ratio,
        min_compress_numel=1,
        exclude_layers=["norm"],
        **SMALL_BUCKETS,
    )
    ref_manager = gradient_cache.create_gradient_cache(reference, **options)
    fused_manager = gradient_cache.create_gradient_cache(fused, **options)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    fused_opt = torch.optim.SGD(fused.parameters(), lr=0.5)
    for step, (tokens, targets) in enumerate(batches(4)):
        tokens, targets = tokens.to(device), targets.to(device)
        loss_of(reference, tokens, targets).backward()
        ref_manager.apply_gradients()
        expected = made.clip_as_the_fused_step(reference, step, 0.05, norm_type)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(fused, tokens, targets).backward()
        total = fused_manager.step(fused_opt, max_grad_norm=0.05, norm_type=norm_type)
        fused_opt.zero_grad()
        assert total.device == expected.device
        # The very sums clip_grad_norm_ does, but for the first step on CUDA: host norms
        # against _foreach_norm's.
        tolerance = 1e-5 if step == 0 and device == "cuda" else 0
        torch.testing.assert_close(total, expected, rtol=tolerance, atol=0)
        assert expected > 0.05  # clipping really happened
    assert_same_parameters(reference, fused, atol=1e-6)


@pytest.mark.parametrize("error_feedback,most_of_the_loss_gone", [(True, True), (False, False)])
def test_compressed_training_still_learns(
    error_feedback: bool, most_of_the_loss_gone: bool
) -> None:
    """Least squares at ratio 100: loss falls, less than plain; error feedback helps here."""
    torch.manual_seed(0)
    weight = torch.randn(256, 64)
    inputs = torch.randn(512, 256)
    targets = inputs @ weight

    def fit(ratio: float | None) -> float:
        torch.manual_seed(1)
        model = torch.nn.Linear(256, 64)
        manager = (
            gradient_cache.create_gradient_cache(
                model, compression_ratio=ratio, codec="topk", error_feedback=error_feedback
            )
            if ratio
            else None
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(300):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            if manager:
                manager.apply_gradients()
            optimizer.step()
            optimizer.zero_grad()
        return torch.nn.functional.mse_loss(model(inputs), targets).item()

    torch.manual_seed(1)
    start = torch.nn.functional.mse_loss(torch.nn.Linear(256, 64)(inputs), targets).item()
    plain, compressed = fit(None), fit(100)
    assert plain < compressed < start
    assert (compressed < 0.5 * start) == most_of_the_loss_gone


@pytest.mark.parametrize("ratio", [1, 100])
def test_grad_scaler_skips_a_step_whose_gradients_overflowed(ratio: int) -> None:
    """An overflowing gradient survives compression, so GradScaler skips the step."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=ratio)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = [p.detach().clone() for p in model.parameters()]

    scaler.scale(model(torch.full((2, 256), 1e36)).sum()).backward()
    manager.apply_gradients()
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0**15

    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 256)).sum()).backward()
    manager.apply_gradients()
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(before[0], model[0].weight)  # a finite step goes through


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_failed_fused_step_retried_gives_the_plain_result(clip: float | None) -> None:
    """CPU backend: the second bucket's optimizer.step() raises once; the retry completes."""
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **SMALL_BUCKETS)
    train_through_a_failed_step(plain, cached, manager, nth=2, clip=clip)
    assert_same_parameters(plain, cached, atol=0 if clip is None else 1e-6)


@pytest.mark.parametrize("nth", [1, 2])
def test_before_a_failed_fused_steps_retry_a_backward_is_refused_and_a_discard_once_it_stepped(
    nth: int,
) -> None:
    """A new batch's forward with gradients would add to what the step has still to take:
    refused before anything reaches .grad. Skipping the step is refused once a bucket
    stepped (``nth`` 2: the rest would be dropped, that bucket's update kept; a probe found
    it silently accepted, 0.25 off plain); the retry then gives plain's result."""
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **SMALL_BUCKETS)

    def mistakes() -> None:
        tokens, targets = batches(1, seed=9)[0]
        with pytest.raises(StepStateError, match=r"forward with gradients while its step"):
            loss_of(cached, tokens, targets).backward()
        with torch.no_grad():
            loss_of(cached, tokens, targets)  # an evaluation is no backward
        if nth > 1:
            with pytest.raises(RuntimeError, match=r"step\(optimizer\) again to complete"):
                manager.discard_gradients()
            # A submodule called on its own skips the model's check; the capture refuses
            # it by the step's state (it had named another optimizer's left gradients).
            with pytest.raises(StepStateError, match="step is interrupted"):
                cached.mlp(torch.ones(2, 32)).sum().backward()
            cached.mlp.zero_grad()  # what the refused backward accumulated before its hook

    train_through_a_failed_step(plain, cached, manager, nth=nth, clip=None, after_failure=mistakes)
    assert_same_parameters(plain, cached)


def test_the_backward_of_a_forward_made_before_a_failed_step_is_refused_until_the_retry() -> None:
    """The forward's check cannot see it (it ran before the step raised at its first
    bucket, so no weight changed under the graph): the capture refuses it (the step's
    state), naming the retry and the discard, not another optimizer's left gradients."""
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, **LOSSLESS, **SMALL_BUCKETS)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    failure = FailsOnce(optimizer)
    (tokens, targets), (later, later_targets) = batches(2)
    loss_of(model, tokens, targets).backward()
    early = loss_of(model, later, later_targets)
    failure.arm(1)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer)
    with pytest.raises(StepStateError, match=r"step is interrupted: .*discard_gradients\(\)"):
        early.backward()
    manager.remove_hooks()


def test_a_clip_over_a_model_whose_submodule_alone_is_cached_sums_as_plain() -> None:
    """The cache over the MLP alone, the optimizer over the whole model: the norms are
    summed in the optimizer's order, which is model.parameters()'s here (in the cached
    submodule's, the rest after, 1 ulp off plain's from the second step: a probe)."""

    def run(cached: bool) -> tuple[torch.nn.Module, list[torch.Tensor]]:
        model = make_model()
        manager = gradient_cache.create_gradient_cache(model.mlp, **LOSSLESS) if cached else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        norms = []
        # Data on which the other order is 1 ulp off within a few steps (seed 1's is not).
        for tokens, targets in batches(12, seed=2):
            loss_of(model, tokens, targets).backward()
            if manager is None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
                optimizer.step()
            else:
                norms.append(manager.step(optimizer, max_grad_norm=0.05))
            optimizer.zero_grad()
        return model, norms

    (plain, plain_norms), (cached, cached_norms) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain_norms, cached_norms, strict=True))
    assert_same_parameters(plain, cached)


def test_max_grad_norm_inf_returns_plains_norm_and_clips_nothing() -> None:
    """As clip_grad_norm_(params, inf): the norm, and a factor of exactly 1 (it was refused
    as not "> 0")."""
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, cached)]
    for tokens, targets in batches(3):
        for model in (plain, cached):
            loss_of(model, tokens, targets).backward()
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), math.inf)
        optimizers[0].step()
        assert torch.equal(manager.step(optimizers[1], max_grad_norm=math.inf), expected)
        for optimizer in optimizers:
            optimizer.zero_grad()
    assert_same_parameters(plain, cached)


@pytest.mark.parametrize("close", ["remove_hooks", "a with-block left on the error"])
def test_a_close_after_a_clipped_step_failed_midway_puts_back_clipped_gradients(close) -> None:
    """The step raised at its second bucket, the first stepped with clipped gradients: the
    close puts the rest back clipped too, as plain's .grad after clip_grad_norm_ (they came
    back unclipped, 8.9x a probe's, and a loop finishing with optimizer.step() drifted);
    apply_gradients() there is refused, naming the retry."""
    plain, cached = make_model(), make_model()
    tokens, targets = batches(1)[0]
    loss_of(plain, tokens, targets).backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **SMALL_BUCKETS)
    optimizer = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    FailsOnce(optimizer).arm(2)
    loss_of(cached, tokens, targets).backward()
    closing = manager if close != "remove_hooks" else contextlib.nullcontext()
    with pytest.raises(torch.OutOfMemoryError), closing:
        manager.step(optimizer, max_grad_norm=0.05)
    if close == "remove_hooks":
        with pytest.raises(RuntimeError, match=r"Call step\(optimizer\) again"):
            manager.apply_gradients()
        manager.remove_hooks()
    back = [(a.grad, b.grad) for a, b in zip(plain.parameters(), cached.parameters(), strict=True)]
    assert any(grad is None for _, grad in back) and any(grad is not None for _, grad in back)
    assert all(torch.equal(a, b) for a, b in back if b is not None)


@pytest.mark.parametrize("offload", [{}, {"offload_optimizer_state": True}])
def test_a_clipped_step_with_no_gradient_returns_plains_zero_norm(offload) -> None:
    """A batch dropped by zero_grad() and the loop steps anyway: clip_grad_norm_ over no
    gradient is 0 and the step changes nothing (it raised from inside torch's foreach
    norm); gradient_norm() likewise."""
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **offload)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, cached)]
    tokens, targets = batches(1)[0]
    for model, optimizer in zip((plain, cached), optimizers, strict=True):
        loss_of(model, tokens, targets).backward()
        optimizer.zero_grad()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    optimizers[0].step()
    assert torch.equal(manager.gradient_norm(cached.parameters()), expected)
    assert torch.equal(manager.step(optimizers[1], max_grad_norm=1.0), expected)
    assert_same_parameters(plain, cached)
    manager.remove_hooks()


def test_fused_steps_of_two_optimizers_each_restore_only_their_own_parameters() -> None:
    """Buckets are restored in parts: step(opt1) leaves opt2's gradients cached."""
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **SMALL_BUCKETS)

    def two_optimizers(model):
        mlp = list(model.mlp.parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in mlp)]
        return torch.optim.Adam(mlp, lr=1e-2), torch.optim.SGD(rest, lr=0.1)

    plain_opts, cached_opts = two_optimizers(plain), two_optimizers(cached)
    for tokens, targets in batches(3):
        loss_of(plain, tokens, targets).backward()
        norms = [
            torch.nn.utils.clip_grad_norm_(o.param_groups[0]["params"], 0.05) for o in plain_opts
        ]
        for optimizer in plain_opts:
            optimizer.step()
            optimizer.zero_grad()
        loss_of(cached, tokens, targets).backward()
        first = manager.step(cached_opts[0], max_grad_norm=0.05)
        still_cached = set(manager.engine.store)
        assert still_cached == set(cached_opts[1].param_groups[0]["params"])
        second = manager.step(cached_opts[1], max_grad_norm=0.05)
        assert not manager.engine.store
        torch.testing.assert_close(torch.stack([first, second]), torch.stack(norms))
    assert_same_parameters(plain, cached, atol=1e-6)


@pytest.mark.parametrize("bucket_size_mb", [8.0, 0.004], ids=["one bucket", "small buckets"])
def test_three_micro_batches_sum_in_plain_pytorchs_order(bucket_size_mb: float) -> None:
    """The first micro-batch cached, the next two waiting in the open bucket: the cached
    part must join the second before the third, ``(a + b) + c``, for plain's bits."""
    data = batches(3)
    plain, cached = make_model(), make_model()
    cached.load_state_dict(plain.state_dict())
    manager = gradient_cache.create_gradient_cache(
        cached, compression_ratio=1, bucket_size_mb=bucket_size_mb
    )
    for index, (tokens, targets) in enumerate(data):
        loss_of(plain, tokens, targets).backward()
        loss_of(cached, tokens, targets).backward()
        if index == 0:
            manager.compress_and_free_gradients()
    manager.apply_gradients()
    for (name, expected), param in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(expected.grad, param.grad), name


def _decay_groups(model: torch.nn.Module) -> list[dict]:
    """nanoGPT's optimizer groups: matrices decay, vectors do not (another order than the
    model's)."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_steps_norm_is_clip_grad_norm_over_the_models_parameters(
    dtype: torch.dtype,
) -> None:
    """The norm is summed in model.parameters()' order, each in its gradient's dtype, as
    clip_grad_norm_(model.parameters()) sums: the same bits, however the optimizer orders
    its groups."""
    plain, cached = make_model(width=64).to(dtype), make_model(width=64).to(dtype)
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS, **SMALL_BUCKETS)
    plain_opt = torch.optim.AdamW(_decay_groups(plain), lr=1e-2)
    cached_opt = torch.optim.AdamW(_decay_groups(cached), lr=1e-2)
    orders_differ = False
    for tokens, targets in batches(20):
        loss_of(plain, tokens, targets).backward()
        in_optimizers_order = torch.nn.utils.get_total_norm(
            [p.grad for group in plain_opt.param_groups for p in group["params"]]
        )
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        orders_differ |= not torch.equal(in_optimizers_order, expected)
        plain_opt.step()
        plain_opt.zero_grad()
        loss_of(cached, tokens, targets).backward()
        total = manager.step(cached_opt, max_grad_norm=0.05)
        cached_opt.zero_grad()
        assert total.dtype == expected.dtype and torch.equal(total, expected), (total, expected)
    assert_same_parameters(plain, cached)
    # fp32: the optimizer's order gives other bits in some step (bf16 rounds them away,
    # but a norm in fp32 is not clip_grad_norm_'s bf16 one).
    assert orders_differ or dtype == torch.bfloat16


def test_a_clip_given_as_torch_takes_it_clips_as_plain_pytorch() -> None:
    """``max_grad_norm`` as a one-element tensor and ``norm_type`` as ``"inf"``, as
    ``torch.nn.utils.clip_grad_norm_`` takes them (they were refused as not numbers)."""
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    for model in (plain, cached):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for tokens, targets in batches(2):
            loss_of(model, tokens, targets).backward()
            if model is plain:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), torch.tensor(0.5), "inf")
                optimizer.step()
            else:
                norm = manager.step(optimizer, max_grad_norm=torch.tensor(0.5), norm_type="inf")
            optimizer.zero_grad()
        assert norm is not None and norm > 0.5  # clipped
    assert_same_parameters(plain, cached)


class MixedDtypes(torch.nn.Module):
    """fp32 layers around a bf16 one: clip_grad_norm_ sums the norms grouped by dtype, in
    the order torch's grouping gives (the bf16 group first), not of first appearance."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(16, 64)
        self.middle = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
        self.last = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.first(x)).bfloat16()
        return self.last(torch.nn.functional.gelu(self.middle(hidden)).float())


@pytest.mark.parametrize("clip", ["fused", "clip_grad_norm_"])
def test_a_clip_over_fp32_and_bf16_gradients_sums_as_plain_pytorch(clip) -> None:
    """Over 40 steps the norms and the weights equal plain clip_grad_norm_'s bit for bit
    (summed in first-appearance order, 6 of 40 norms were a bit off)."""
    plain, cached = MixedDtypes(), MixedDtypes()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, cached)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(40):
        x = torch.randn(32, 16, generator=generator)
        norms = []
        for model, optimizer in zip((plain, cached), optimizers, strict=True):
            model(x).pow(2).mean().backward()
            if model is cached and clip == "fused":
                norms.append(manager.step(optimizer, max_grad_norm=0.005))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.005))
                manager.step(optimizer) if model is cached else optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(*norms)
    assert_same_parameters(plain, cached)


class ComplexWeights(torch.nn.Module):
    """Complex weights between real layers: a complex gradient's norm is real, and its
    group (by the gradient's dtype) is its own in torch's sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(16, 16)
        self.mixers = torch.nn.ParameterList(
            torch.nn.Parameter(0.1 * torch.randn(16, 16, dtype=torch.cfloat)) for _ in range(3)
        )
        self.last = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        for mixer in self.mixers:
            mixed = hidden.to(torch.cfloat) @ mixer
            hidden = hidden + 0.5 * mixed.real + 0.1 * mixed.imag.abs()
        return self.last(hidden)


def test_a_clip_over_complex_and_real_gradients_is_plain_pytorchs() -> None:
    """Norms kept in a complex buffer were summed as complex numbers: norms 1 ulp off
    plain's after the first clipped step, the weights 1e-8 apart (a probe)."""
    plain, cached = ComplexWeights(), ComplexWeights()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, cached)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        x = 3 * torch.randn(8, 16, generator=generator)
        for model in (plain, cached):
            model(x).pow(2).mean().backward()
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
        optimizers[0].step()
        assert torch.equal(manager.step(optimizers[1], max_grad_norm=0.1), expected)
        for optimizer in optimizers:
            optimizer.zero_grad()
    assert_same_parameters(plain, cached)


@pytest.mark.parametrize(
    "options",
    [
        dict(codec="int8"),
        dict(codec="q4"),
        dict(codec="sign"),
        dict(codec="topk", compression_ratio=10, min_compress_numel=128),
        dict(compression_ratio=3),
        dict(compression_ratio=100),
    ],
    ids=["int8", "q4", "sign", "topk", "ladder-3", "ladder-100"],
)
def test_complex_gradients_travel_lossless_whatever_the_codec(options: dict) -> None:
    """The codecs code real entries: int8, q4 and sign dropped a complex gradient's imaginary
    part (its weights' imaginary parts never moved), top-k raised inside backward. Only the
    complex weights are cached here: they train as plain PyTorch's, bit for bit."""
    plain, cached = ComplexWeights(), ComplexWeights()
    manager = gradient_cache.create_gradient_cache(
        cached, exclude_layers=["first", "last"], **options
    )
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (plain, cached)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(8, 16, generator=generator)
        for model in (plain, cached):
            model(x).pow(2).mean().backward()
        optimizers[0].step()
        manager.step(optimizers[1])
        assert {layer.codec for layer in manager.summary().layers.values()} == {"lossless"}
        for optimizer in optimizers:
            optimizer.zero_grad()
    assert_same_parameters(plain, cached)
