"""Restored gradients have their parameter's layout, as plain PyTorch gives them.

A channels_last convolution weight's gradient has channels_last strides in plain PyTorch;
fused AdamW walks gradient and weight in memory order, so a gradient restored contiguous
trains differently (0.058 apart after 3 steps before the fix).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import finish_step
from test_stream_order import fake_accelerator  # noqa: F401
from torch import nn

import gradient_cache
from gradient_cache.engine.layout import contiguous_strides, gradient_strides

STEPS = 3
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def conv_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 1),  # a 1x1 kernel: channels_last strides with two size-1 dimensions
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 4),
    )
    return model.to(memory_format=torch.channels_last)


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(2, 3, 6, 6, generator=generator) for _ in range(STEPS)]
    return [image.to(memory_format=torch.channels_last) for image in images]


def optimizer_for(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})


def train(model: nn.Module, kind: str, *, manager=None, fused_step: bool = False) -> list:
    """Train (on the model's device); return each step's gradient strides as the
    optimizer saw them."""
    device = next(model.parameters()).device
    optimizer = optimizer_for(model, kind)
    seen = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            [
                tuple(p.grad.stride())
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
        )
    )
    for images in data():
        model(images.to(device)).square().mean().backward()
        finish_step(manager, optimizer, fused_step=fused_step)
    return seen


@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize("fused_step", [False, True], ids=["apply", "fused step"])
@pytest.mark.parametrize(
    "backend", ["cpu", "stand-in cuda", pytest.param("cuda", marks=needs_cuda)]
)
def test_channels_last_trains_bit_for_bit_as_plain(
    kind: str, fused_step: bool, backend: str, request: pytest.FixtureRequest
) -> None:
    """On CUDA, fused AdamW needs the gradient's strides to match the weight's, and
    foreach takes its slow path otherwise."""
    plain = conv_model().to("cuda" if backend == "cuda" else "cpu")
    cached = copy.deepcopy(plain)
    stand_in = backend == "stand-in cuda"
    factory = request.getfixturevalue("fake_accelerator").factory if stand_in else None
    options = {} if factory is None else {"backend_factory": factory}
    manager = gradient_cache.create_gradient_cache(
        cached, compression_ratio=1, bucket_size_mb=0.001, **options
    )
    plain_strides = train(plain, kind)
    cached_strides = train(cached, kind, manager=manager, fused_step=fused_step)
    manager.remove_hooks()
    if not fused_step:  # the fused step hands the optimizer one bucket at a time
        assert cached_strides == plain_strides
    for (name, p), q in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_compressed_gradient_is_restored_in_its_parameters_layout() -> None:
    """Lossy codecs too: the restore allocates the parameter's strides and decodes in memory
    order, so the restored gradient is plain's up to the codec's own error."""
    model = conv_model()
    reference = copy.deepcopy(model)
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, codec="int8", min_compress_numel=1
    )
    for m in (model, reference):
        m(data()[0]).square().mean().backward()
    manager.apply_gradients()
    manager.remove_hooks()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.stride() == q.grad.stride(), name
        scale = q.grad.abs().max()
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=float(scale) / 100)


def test_gradient_strides_follow_autograds_layout_contract() -> None:
    weight = torch.empty(8, 3, 3, 3).to(memory_format=torch.channels_last)
    assert gradient_strides(weight) == weight.stride()
    transposed = torch.empty(5, 7).t()
    assert gradient_strides(transposed) == transposed.stride()
    expanded = torch.empty(5, 1).expand(5, 7)  # overlapping: the gradient is contiguous
    assert gradient_strides(expanded) == contiguous_strides((5, 7)) == (7, 1)
    gappy = torch.empty(5, 8)[:, ::2]  # not dense: contiguous
    assert gradient_strides(gappy) == (4, 1)
    for tensor in (weight, transposed, expanded, gappy):  # what autograd itself gives
        leaf = tensor.detach().requires_grad_()
        (leaf * torch.randn(leaf.shape)).sum().backward()
        assert leaf.grad.stride() == gradient_strides(tensor)


def _topk_cache(model: nn.Module):
    return gradient_cache.create_gradient_cache(
        model, compression_ratio=4, codec=gradient_cache.TopK(), min_compress_numel=1
    )


def _backward_twice(model: nn.Module, manager) -> dict:
    """A step with error feedback, then a second backward left cached: a state whose
    residuals and payloads are in the parameters' memory order."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first, second = data()[:2]
    model(first).square().mean().backward()
    manager.step(optimizer)
    model(second).square().mean().backward()
    return manager.state_dict()


def test_a_checkpoint_resumes_in_the_layout_it_was_saved_in_and_refuses_another() -> None:
    model = conv_model()
    contiguous = copy.deepcopy(model).to(memory_format=torch.contiguous_format)
    manager = _topk_cache(model)
    state = _backward_twice(model, manager)
    manager.apply_gradients()  # the uninterrupted run's gradients
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    manager.remove_hooks()
    assert state["layouts"]["0.weight"] == list(model[0].weight.stride())

    resumed = copy.deepcopy(model)
    for p in resumed.parameters():
        p.grad = None
    again = _topk_cache(resumed)
    again.load_state_dict(state)
    again.apply_gradients()
    for name, p in resumed.named_parameters():
        assert torch.equal(p.grad, expected[name]), name
        assert p.grad.stride() == expected[name].stride(), name
    again.remove_hooks()

    other = _topk_cache(contiguous)
    with pytest.raises(ValueError, match=r"state\['layouts'\]\['0.weight'\].*memory_format"):
        other.load_state_dict(state)
    other.load_state_dict(
        {**state, "layouts": {}, "residuals": {}, "pending_residuals": {}, "buckets": []}
    )
