"""Restored gradients keep their parameter's layout on the emulated device: a
channels_last convolution's weight gets a channels_last gradient, as plain PyTorch gives
it, so fused AdamW (which walks gradient and weight in memory order) steps as plain does,
bit for bit (tests/test_layout.py has the CPU's and the stand-in streams' runs)."""

from __future__ import annotations

import pytest
import torch
from helpers import after_each_update
from test_layout import conv_model, data

import gradient_cache
from gradient_cache.engine.accelerator import AcceleratorBackend
from gradient_cache.engine.layout import contiguous_strides


def channels_last_weights(model: torch.nn.Module) -> list[str]:
    """The weights whose strides are channels_last's, not contiguous ones (the 1x1
    kernel's too, whose two size-1 dimensions make it contiguous as well)."""
    return [
        name
        for name, p in model.named_parameters()
        if p.dim() == 4
        and p.is_contiguous(memory_format=torch.channels_last)
        and p.stride() != contiguous_strides(p.shape)
    ]


def train(model, kind: str, *, manager=None, path: str = "apply") -> list[list[tuple]]:
    """AdamW (``kind``: "fused" or "foreach") over test_layout's images; returns, for
    every update the optimizer made (each bucket's, in a fused step), the strides of the
    gradients it read next to their weights'."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})
    seen = []

    def strides(opt) -> None:
        seen.append(
            [
                (p.grad.stride(), p.stride())
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
        )

    after_each_update(optimizer, strides)
    for images in data():
        model(images.to(device)).square().mean().backward()
        if manager is None:
            optimizer.step()
        elif path == "fused":
            manager.step(optimizer)
        else:
            manager.compress_and_free_gradients()
            manager.apply_gradients()
            optimizer.step()
        optimizer.zero_grad()
    return seen


@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize("path", ["apply", "fused"], ids=["apply", "fused step"])
def test_channels_last_trains_bit_for_bit_as_plain(
    device: torch.device, kind: str, path: str
) -> None:
    plain = conv_model().to(device)
    cached = conv_model().to(device)
    assert len(channels_last_weights(cached)) == 2  # both convolutions' weights
    manager = gradient_cache.create_gradient_cache(
        cached, compression_ratio=1, bucket_size_mb=0.001
    )
    assert isinstance(manager.engine.backend, AcceleratorBackend)
    plain_seen = train(plain, kind)
    cached_seen = train(cached, kind, manager=manager, path=path)
    manager.remove_hooks()
    for updates in (plain_seen, cached_seen):
        assert updates and all(g == w for update in updates for g, w in update)
    if path == "apply":  # the fused step hands the optimizer one bucket at a time
        assert cached_seen == plain_seen
    else:
        assert len(cached_seen) > len(plain_seen)  # several buckets a step
    for (name, p), q in zip(plain.named_parameters(), cached.parameters(), strict=True):
        same = torch.equal(p.cpu(), q.cpu())
        assert same, f"{name} differs by {(p.cpu() - q.cpu()).abs().max().item()}"


@pytest.mark.parametrize(
    "options",
    [dict(compression_ratio=1), dict(codec="int8", min_compress_numel=1)],
    ids=["lossless", "int8"],
)
def test_restored_gradients_have_the_parameters_strides(device: torch.device, options) -> None:
    """apply_gradients() gives each gradient its weight's strides, as plain backward does:
    equal to plain's (lossless), within the codec's error (int8)."""
    plain = conv_model().to(device)
    cached = conv_model().to(device)
    manager = gradient_cache.create_gradient_cache(cached, **options)
    image = data()[0].to(device)
    for model in (plain, cached):
        model(image).square().mean().backward()
    manager.compress_and_free_gradients()
    assert all(p.grad is None for p in cached.parameters())
    manager.apply_gradients()
    manager.remove_hooks()
    for (name, p), q in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert q.grad is not None and q.grad.device == device, name
        assert q.grad.stride() == p.grad.stride() == q.stride(), name
        if options.get("compression_ratio") == 1:
            assert torch.equal(q.grad.cpu(), p.grad.cpu()), name
        else:
            scale = float(p.grad.abs().max())
            torch.testing.assert_close(q.grad.cpu(), p.grad.cpu(), rtol=0, atol=scale / 100)
