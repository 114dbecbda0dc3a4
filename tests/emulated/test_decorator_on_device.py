"""The decorator (`@gradient_cache.optimize`) on the emulated device: a loop of your own,
unchanged, trains bit for bit with plain PyTorch on the device, with the gradients, the
optimizer state and the weights on the host (the last set up from the host, ``device=``)."""

from __future__ import annotations

import pytest
import torch
from test_device_defects import inputs, linears
from test_parameters_offload import adamw_two_groups, gpt
from test_parameters_offload import batches_on as on

import gradient_cache
from gradient_cache.testing import emulated_device


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


@pytest.mark.parametrize("then", ["manager_of", "the next call", "the next call, one kept"])
def test_a_close_out_of_memory_at_the_return_leaves_a_cache_to_close_later(device, then) -> None:
    """The decorated function returns with a step pending (accumulation) and no room for
    its gradients: its close raises with them cached, and the cache was out of reach once
    the call was over (`manager_of` refused, the next call was refused as a second cache;
    a probe). Now `manager_of(model)` finds it between calls, and the next decorated call
    closes it first, also where the user holds it (dropped, its collection closed it as
    well, and a mutant deleting the call's close survived); either way the gradients reach
    .grad and train as plain's."""
    data = inputs(device, 3)
    plain = linears(device)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for backwards in ([data[0]], [data[1], data[2]]):  # the second step after two backwards
        for x in backwards:
            plain(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    cached = linears(device)
    optimizer = torch.optim.SGD(cached.parameters(), lr=0.1)

    @gradient_cache.optimize(compression_ratio=1, bucket_size_mb=0.25)
    def first() -> None:
        cached(data[0]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        cached(data[1]).square().mean().backward()  # stepped by the next call
        emulated_device(capacity_bytes=torch.accelerator.memory_allocated() + 200_000)

    @gradient_cache.optimize(compression_ratio=1)
    def second() -> None:
        cached(data[2]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(torch.OutOfMemoryError, match="manager_of"), pytest.warns(UserWarning):
        first()  # and its cache state does not pass on: a step was pending
    emulated_device()
    kept = gradient_cache.manager_of(cached)  # held: no collection closes it for the call
    if then == "manager_of":
        kept.remove_hooks()
        assert all(p.grad is not None for p in cached.parameters())
    if then == "the next call":
        del kept  # dropped: a collection would close it too
    second()
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(a, b)
