"""The decorator (`@gradient_cache.optimize`) on the emulated device: a loop of your own,
unchanged, trains bit for bit with plain PyTorch on the device, with the gradients, the
optimizer state and the weights on the host (the last set up from the host, ``device=``)."""

from __future__ import annotations

import pytest
import torch
from test_parameters_offload import adamw_two_groups, gpt
from test_parameters_offload import batches_on as on

import gradient_cache


def loop(model: torch.nn.Module, data) -> list[float]:
    """A plain loop: two micro-batches a step, clipping, AdamW with two groups."""
    optimizer = adamw_two_groups(model)
    losses = []
    for index, (tokens, targets) in enumerate(data):
        _, loss = model(tokens, targets)
        (loss / 2).backward()
        losses.append(loss.item())
        if index % 2:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return losses


@pytest.mark.parametrize(
    "options",
    [
        {"compression_ratio": 1},
        {"compression_ratio": 1, "offload_optimizer_state": True},
        {"compression_ratio": 1, "offload_optimizer_state": True, "offload_parameters": True},
    ],
    ids=["gradients", "state", "weights"],
)
def test_a_decorated_loop_trains_as_plain_on_the_device(device, options) -> None:
    data = on(device, 4)
    plain = gpt().to(device)
    expected = loop(plain, data)
    cached = gpt().to(device)
    decorated = gradient_cache.optimize(**options)(loop)
    assert decorated(cached, data) == expected
    for (name, a), b in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name
    assert decorated.last_summaries[0]["steps"] == 2


def test_a_decorated_loop_sets_a_model_up_from_the_host(device) -> None:
    data = on(device, 4)
    plain = gpt().to(device)
    expected = loop(plain, data)
    cached = gpt()  # on the host
    decorated = gradient_cache.optimize(
        compression_ratio=1, offload_optimizer_state=True, offload_parameters=True, device=device
    )(loop)
    assert decorated(cached, data) == expected
    for (name, a), b in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name
