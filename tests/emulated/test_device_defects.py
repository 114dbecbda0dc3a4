"""Paths a review found a GPU would break first, with the weights on the host: a gradient
assigned across devices, a failed step, a clip between two backwards. On the emulated
device a gradient on the device assigned to a parameter on the host raises, as on CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import FailsOnce
from test_parameters_offload import STREAMED, adamw_two_groups, gpt
from test_parameters_offload import batches_on as on

import gradient_cache


def same(plain: torch.nn.Module, cached: torch.nn.Module) -> None:
    for (name, a), b in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name


def test_a_step_that_fails_midway_and_is_retried_trains_as_plain(device) -> None:
    """The second bucket's update raises (out of memory, injected): its weights go home
    unchanged, no gradient is assigned across devices, and the retried step gives plain's
    bits."""
    data = on(device)

    def run(model, manager=None):
        optimizer = adamw_two_groups(model)
        fails = FailsOnce(optimizer)
        for index, (tokens, targets) in enumerate(data):
            model(tokens, targets)[1].backward()
            if manager is None:
                optimizer.step()
            else:
                if index == 1:
                    fails.arm(2)
                    with pytest.raises(torch.OutOfMemoryError):
                        manager.step(optimizer)
                manager.step(optimizer)
            optimizer.zero_grad()

    plain = gpt().to(device)
    run(plain)
    cached = gpt()
    run(cached, gradient_cache.create_gradient_cache(cached, **STREAMED, device=device))
    same(plain, cached)


def clip_between_backwards(model: torch.nn.Module, data) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for tokens, targets in data:
        model(tokens[:2], targets[:2])[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        model(tokens[2:], targets[2:])[1].backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_clip_between_backwards_trains_as_plain_with_the_weights_on_the_device(device) -> None:
    data = on(device)
    plain = gpt().to(device)
    clip_between_backwards(plain, data)
    cached = gpt().to(device)
    gradient_cache.optimize(compression_ratio=1, offload_optimizer_state=True)(
        clip_between_backwards
    )(cached, data)
    same(plain, cached)


def test_a_clip_between_backwards_with_the_weights_on_the_host_is_refused(device) -> None:
    """Its restore would assign device gradients to host parameters (a RuntimeError from
    autograd on a GPU, and here): refused, naming the fix."""
    cached = gpt().to(device)
    decorated = gradient_cache.optimize(
        compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
    )(clip_between_backwards)
    with pytest.raises(RuntimeError, match=r"max_grad_norm=\.\.\."):
        decorated(cached, on(device, 1))
