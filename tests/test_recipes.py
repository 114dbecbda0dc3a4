"""The compression recipes' contracts: stored residuals, warm-up, loss scaling, skipped steps."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_parameters, batches, loss_of, make_model, train

import gradient_cache
from gradient_cache.codecs import ResidualCodec, TopKEncoder, int8_kernels
from gradient_cache.codecs.int8_kernels import INT8_BLOCK


def heavy_tailed(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) ** 4


def rounding_bound(dtype: str, x: torch.Tensor) -> torch.Tensor:
    """Per entry, the largest error the stored form may add (strictly less than this)."""
    if dtype == "bfloat16":
        # One unit in the last place of bf16 at |x| (8 significant bits).
        exponent = torch.frexp(x.abs().clamp_min(1e-30))[1]
        return torch.ldexp(torch.ones_like(x), exponent - 8)
    padded = torch.nn.functional.pad(x, (0, -x.numel() % INT8_BLOCK)).view(-1, INT8_BLOCK)
    scale = padded.abs().amax(dim=1, keepdim=True) / 127
    return scale.expand_as(padded).reshape(-1)[: x.numel()]


@pytest.mark.parametrize("chunk", [int8_kernels.CODEC_CHUNK, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_stored_residual_is_within_its_bound_and_unbiased(
    dtype: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stochastic rounding: every entry within one step, and right on average, also when
    the codec works through the tensor in chunks (the last one partial)."""
    monkeypatch.setattr(int8_kernels, "CODEC_CHUNK", chunk)
    codec = ResidualCodec(dtype, seed=3)
    x = heavy_tailed(1000)  # not a whole number of int8 blocks: the padding is exercised
    bound = rounding_bound(dtype, x)
    trials = 400
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(trials):
        decoded = codec.decode(codec.encode(x.clone()), x.numel())
        assert ((decoded - x).abs() < bound).all()
        total += decoded.double()
    # Each trial's error has a standard deviation of at most bound/2, so the mean of 400
    # lies within bound/8 (5 standard deviations) of x; round-to-nearest would not: its
    # error is the same every trial, up to bound/2.
    bias = (total / trials - x.double()).abs()
    assert (bias < bound.double() / 8).all(), f"largest bias {(bias / bound).max():.3f} bounds"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_stored_residual_sizes_and_zeros(dtype: str) -> None:
    codec = ResidualCodec(dtype)
    stored = codec.zeros(1000, torch.device("cpu"))
    assert stored.numel() * stored.element_size() == codec.stored_bytes(1000)
    assert codec.stored_bytes(1000) == {"float32": 4000, "bfloat16": 2000, "int8": 1024 + 64}[dtype]
    assert torch.count_nonzero(codec.decode(stored, 1000)) == 0
    x = heavy_tailed(1000)
    if dtype == "float32":
        assert torch.equal(codec.decode(codec.encode(x.clone()), 1000), x)


def test_residual_codec_draws_from_its_own_generator() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = ResidualCodec("int8", seed=5).encode(heavy_tailed(4096))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(ResidualCodec("int8", seed=5).encode(heavy_tailed(4096)), first)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_error_feedback_conserves_each_step_up_to_the_stored_rounding(dtype: str) -> None:
    """Delivered + new residual == gradient + old residual, up to one rounding of the store."""
    encoder = TopKEncoder(ratio=100, selection="exact", residual_dtype=dtype)
    codec = encoder.residual_codec
    numel = 1 << 16
    residual = codec.zeros(numel, torch.device("cpu"))
    for step in range(4):
        grad = heavy_tailed(numel, seed=step)
        expected = grad + codec.decode(residual, numel)
        old = residual.clone()
        payload, new = encoder.encode(grad, residual)
        assert torch.equal(residual, old)  # read, never written: a failed step keeps it
        residual = new
        held = codec.decode(residual, numel)
        delivered = payload.decode_into(torch.zeros(numel))
        error = (delivered + held - expected).abs()
        if dtype == "float32":
            assert error.max() == 0
        else:
            # Kept entries leave zero behind, which every format stores exactly.
            unsent = expected.clone()
            unsent[payload.indices.long()] = 0
            assert (error <= rounding_bound(dtype, unsent)).all()
        assert torch.count_nonzero(held) > numel // 2  # most of the mass was held back


def test_residual_is_kept_unscaled_under_a_loss_scale() -> None:
    """Scaled gradients (a power of two, as GradScaler's) give the same residual and the
    payload times the scale: the scale can change between steps without re-weighting."""
    encoder = TopKEncoder(ratio=100, selection="exact")
    numel = 1 << 14
    plain_residual = scaled_residual = torch.zeros(numel)
    for step, scale in enumerate([1024.0, 2048.0, 512.0]):
        grad = heavy_tailed(numel, seed=step)
        plain_payload, plain_residual = encoder.encode(grad, plain_residual)
        scaled_payload, scaled_residual = encoder.encode(
            grad * scale, scaled_residual, loss_scale=torch.tensor(scale)
        )
        assert torch.equal(scaled_residual, plain_residual)
        assert torch.equal(scaled_payload.indices, plain_payload.indices)
        assert torch.equal(scaled_payload.values, plain_payload.values * scale)


def train_with_scaler(
    model: torch.nn.Module,
    *,
    growth_interval: int,
    pass_scaler: bool,
    poison_step: int | None = None,
    steps: int = 6,
) -> tuple[torch.amp.GradScaler, gradient_cache.GradientCacheHookManager, list[bool]]:
    """Ratio 100 with error feedback under a CPU GradScaler; returns which steps moved."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=100,
        codec="topk",
        error_feedback=True,
        min_compress_numel=1,
        grad_scaler=scaler if pass_scaler else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    moved = []
    for step, (tokens, targets) in enumerate(batches(steps)):
        handle = None
        if step == poison_step:
            handle = model.mlp[0].weight.register_hook(
                lambda g: g.index_fill(0, torch.tensor([3]), float("inf"))
            )
        scaler.scale(loss_of(model, tokens, targets)).backward()
        if handle is not None:
            handle.remove()
        before = model.mlp[0].weight.detach().clone()
        manager.apply_gradients()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        moved.append(not torch.equal(before, model.mlp[0].weight))
    return scaler, manager, moved


def test_a_changing_loss_scale_does_not_reweight_the_residual() -> None:
    """Growth every step (the scale doubles) trains exactly like a constant scale."""
    constant, growing, unaware = make_model(), make_model(), make_model()
    train_with_scaler(constant, growth_interval=1000, pass_scaler=True)
    scaler, _, _ = train_with_scaler(growing, growth_interval=1, pass_scaler=True)
    assert scaler.get_scale() == 2.0**16  # it really changed, six times
    assert_same_parameters(growing, constant)
    # Without the scaler, the residual mixes scales and the runs part.
    train_with_scaler(unaware, growth_interval=1, pass_scaler=False)
    assert not all(
        torch.equal(a, b) for a, b in zip(unaware.parameters(), constant.parameters(), strict=True)
    )


def test_a_skipped_overflow_step_reaches_the_scaler_and_leaves_finite_residuals() -> None:
    model = make_model()
    scaler, manager, moved = train_with_scaler(
        model, growth_interval=1000, pass_scaler=True, poison_step=2
    )
    # The inf was delivered: the scaler skipped step 2 (nothing moved) and backed off.
    assert moved == [True, True, False, True, True, True]
    assert scaler.get_scale() == 2.0**9
    residuals = manager.engine.backend.residuals.current()
    assert all(torch.isfinite(r).all() for r in residuals.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("fused_step", [False, True])
def test_warmup_steps_are_plain_then_compressed(fused_step: bool) -> None:
    """The first warmup_steps steps are exactly plain PyTorch; later ones are compressed."""
    warm, plain = make_model(), make_model()
    data = batches(5)
    manager = gradient_cache.create_gradient_cache(
        warm, compression_ratio=100, warmup_steps=3, min_compress_numel=1
    )  # the ladder (this test's error_feedback=True never acted: codec=None keeps no residual)
    kept = []
    optimizer = torch.optim.Adam(warm.parameters(), lr=1e-2)
    reference = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for step, (tokens, targets) in enumerate(data):
        loss_of(warm, tokens, targets).backward()
        loss_of(plain, tokens, targets).backward()
        if fused_step:
            manager.step(optimizer)
        else:
            manager.apply_gradients()
            optimizer.step()
        reference.step()
        optimizer.zero_grad()
        reference.zero_grad()
        kept.append(manager.get_compression_summary()["kept_fraction"])
        if step < 3:
            assert_same_parameters(warm, plain)
    assert kept[:3] == [1.0, 1.0, 1.0] and max(kept[3:]) < 0.02
    assert not all(
        torch.equal(a, b) for a, b in zip(warm.parameters(), plain.parameters(), strict=True)
    )


def test_int8_values_train_close_to_plain() -> None:
    """Every entry kept as int8: unbiased rounding, so a few steps stay near plain's weights."""
    model, plain, start = make_model(), make_model(), make_model()
    data = batches(5)
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, value_dtype="int8", min_compress_numel=1
    )
    train(model, data, manager=manager, make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    train(plain, data, make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    flat = [
        torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (model, plain, start)
    ]
    # Off plain's path by under 5% of how far plain moved.
    assert (flat[0] - flat[1]).norm() < 0.05 * (flat[1] - flat[2]).norm()
    moved_apart = [
        not torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True)
    ]
    assert any(moved_apart)
    assert manager.get_compression_summary()["kept_fraction"] == 1.0


def test_warmup_counts_optimizer_steps_not_micro_batches() -> None:
    model = make_model()
    reference = copy.deepcopy(model)
    data = batches(2)
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=100, warmup_steps=2, min_compress_numel=1
    )
    train(model, data, manager=manager, micro_batches=4)
    train(reference, data, micro_batches=4)
    assert_same_parameters(model, reference, atol=1e-6)
    assert manager.get_compression_summary()["kept_fraction"] == 1.0
