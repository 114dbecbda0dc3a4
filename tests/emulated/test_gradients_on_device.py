"""The gradient cache on the emulated device: the accelerator backend's streams, events and
pinned pool run for real (non_blocking copies land only when ordered), and the results are
plain PyTorch's on the device bit for bit (lossless), or the CPU backend's (int8)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import (
    assert_a_closed_manager_lets_the_model_go_without_a_gc_pass,
    batches,
    loss_of,
    make_model,
)

import gradient_cache
from gradient_cache.codecs.payloads import QuantizedPayload
from gradient_cache.engine.accelerator import AcceleratorBackend
from gradient_cache.engine.backend import CpuBackend

HALVES = (slice(0, 2), slice(2, 4))  # two micro-batches a step (gradient accumulation)
CLIP = 0.05  # below every step's gradient norm: the clip acts at each step
STEPS = 3


def run(where, options: dict | None, *, path: str = "fused", clip: float | None = None):
    """AdamW over ``STEPS`` steps of two micro-batches on ``where``: plain PyTorch when
    ``options`` is None, else through a cache of ``options`` (``path`` "apply":
    compress_and_free_gradients() after each micro-batch, clip_grad_norm_ (answered from
    the cache), apply_gradients(), optimizer.step(); "fused": step(optimizer,
    max_grad_norm=clip)). Returns the model, the manager and each step's norm."""
    model = make_model().to(where)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = None if options is None else gradient_cache.create_gradient_cache(model, **options)
    norms = []
    for tokens, targets in batches(STEPS):
        tokens, targets = tokens.to(where), targets.to(where)
        for half in HALVES:
            (loss_of(model, tokens[half], targets[half]) / 2).backward()
            if manager is not None and path == "apply":
                manager.compress_and_free_gradients()
        if manager is not None and path == "fused":
            norm = manager.step(optimizer, max_grad_norm=clip)
        else:
            norm = None
            if clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if manager is not None:
                manager.apply_gradients()
            optimizer.step()
        if norm is not None:
            norms.append(norm.item())
        optimizer.zero_grad()
    return model, manager, norms


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu() for p in model.parameters()]


def assert_equal(left: torch.nn.Module, right: torch.nn.Module) -> None:
    for (name, a), b in zip(left.named_parameters(), weights(right), strict=True):
        same = torch.equal(a.detach().cpu(), b)
        assert same, f"{name} differs by {(a.detach().cpu() - b).abs().max().item()}"


@pytest.mark.parametrize(
    ("path", "clip"),
    [("apply", None), ("apply", CLIP), ("fused", CLIP)],
    ids=["compress-apply", "compress-clip-apply", "fused-step-clip"],
)
def test_lossless_offload_on_the_device_is_plain_pytorch_bit_for_bit(
    device: torch.device, path: str, clip: float | None
) -> None:
    plain, _, plain_norms = run(device, None, clip=clip)
    cached, manager, norms = run(device, dict(compression_ratio=1), path=path, clip=clip)
    assert isinstance(manager.engine.backend, AcceleratorBackend)
    assert manager.engine.backend.device == device
    assert all(p.device == device for p in cached.parameters())
    assert_equal(plain, cached)
    assert norms == plain_norms  # the clip's norms too, bit for bit
    if clip is not None:
        assert len(norms) == STEPS and min(norms) > clip  # the clip scaled every step


@pytest.mark.parametrize("path", ["apply", "fused"])
def test_the_default_int8_codec_on_the_device_gives_the_cpus_bits(
    device: torch.device, path: str
) -> None:
    """The default ratio (int8 codes, stochastic rounding from the engine's generators):
    the accelerator backend on the device and the CPU backend give the same weights."""
    on_device, device_manager, device_norms = run(device, {}, path=path, clip=CLIP)
    on_cpu, cpu_manager, cpu_norms = run("cpu", {}, path=path, clip=CLIP)
    assert isinstance(device_manager.engine.backend, AcceleratorBackend)
    assert isinstance(cpu_manager.engine.backend, CpuBackend)
    assert_equal(on_cpu, on_device)
    assert device_norms == cpu_norms
    # The codec acted: lossy, so not plain's weights.
    plain, _, _ = run(device, None, clip=CLIP)
    assert any(
        not torch.equal(a, b) for a, b in zip(weights(plain), weights(on_device), strict=True)
    )


@pytest.mark.parametrize("options", [dict(compression_ratio=1), {}], ids=["lossless", "int8"])
def test_after_backward_the_device_holds_no_cached_gradient(
    device: torch.device, options: dict
) -> None:
    """Plain PyTorch's backward leaves the gradients on the device; the cache's leaves
    none there (``p.grad`` None) and the device's allocated bytes lower by at least them."""
    tokens, targets = (t.to(device) for t in batches(1)[0])

    managers = []  # kept: a manager collected while attached puts the gradients back

    def backward_growth(manager_options: dict | None) -> tuple[torch.nn.Module, int]:
        model = make_model().to(device)
        if manager_options is not None:
            manager = gradient_cache.create_gradient_cache(model, **manager_options)
            managers.append(manager)
        torch.accelerator.synchronize()
        before = torch.accelerator.memory_allocated()
        loss = loss_of(model, tokens, targets)
        loss.backward()
        del loss  # and with it the graph: what is left is the gradients
        if manager_options is not None:
            manager.compress_and_free_gradients()
            assert len(manager.engine.store) == len(list(model.parameters()))
        torch.accelerator.synchronize()
        return model, torch.accelerator.memory_allocated() - before

    plain, plain_growth = backward_growth(None)
    cached, cached_growth = backward_growth(options)
    gradient_bytes = sum(p.numel() * p.element_size() for p in cached.parameters())
    assert all(p.grad is not None for p in plain.parameters())
    assert plain_growth >= gradient_bytes  # the measure sees plain's gradients
    assert all(p.grad is None for p in cached.parameters())
    assert plain_growth - cached_growth >= gradient_bytes


def test_the_int8_payloads_land_in_the_pinned_pool(device: torch.device) -> None:
    """The pool's slabs are page-locked (no fallback to pageable memory, which would make
    every copy block), and each cached gradient's payload lies in them: int8 codes on the
    host, pinned."""
    model = make_model().to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "could not pin host memory" would be a warning
        manager = gradient_cache.create_gradient_cache(model)
    backend = manager.engine.backend
    assert isinstance(backend, AcceleratorBackend)
    pool = backend.pool
    slabs = pool._slabs
    assert slabs and all(slab.is_pinned() for slab in slabs)
    slab_storages = {slab.untyped_storage().data_ptr() for slab in slabs}
    for slot in pool.slots.values():
        assert all(region.is_pinned() and pool.is_pinned(region) for region in slot.regions)

    tokens, targets = (t.to(device) for t in batches(1)[0])
    loss_of(model, tokens, targets).backward()
    manager.compress_and_free_gradients()
    quantized = 0
    for param in model.parameters():
        payload = manager.engine.store[param]
        for tensor in payload.tensors():
            assert tensor.device.type == "cpu" and tensor.is_pinned()
            assert tensor.untyped_storage().data_ptr() in slab_storages
        if isinstance(payload, QuantizedPayload):  # int8 codes and their scales, packed
            quantized += 1
            assert payload.nbytes < param.numel() * param.element_size() / 3
    assert quantized >= 3  # the embedding and the MLP's weights (the smallest go whole)


@pytest.mark.parametrize(
    "options",
    [
        dict(compression_ratio=1),
        dict(compression_ratio=100),
        dict(codec=gradient_cache.TopK(residual_location="device"), compression_ratio=100),
    ],
    ids=["lossless", "host residuals", "device residuals"],
)
def test_a_closed_manager_lets_the_model_go_without_a_gc_pass(device, options) -> None:
    """No reference cycle through the accelerator backend either."""
    assert_a_closed_manager_lets_the_model_go_without_a_gc_pass(
        lambda: run(device, options, path="apply")[:2]
    )
