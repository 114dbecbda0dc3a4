"""``offload_optimizer_state=True`` on the emulated device: between steps the optimizer's
state is in (pinned) host memory, the device holds none of it, and the fused step, which
brings each bucket's state to the device and sends it back, steps as plain PyTorch does on
the device, bit for bit."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import batches, loss_of, make_model

import gradient_cache
from gradient_cache.engine.accelerator import AcceleratorBackend
from gradient_cache.testing import emulated_device

# Small buckets: several buckets a step, so the state moves a bucket at a time.
OPTIONS = dict(compression_ratio=1, offload_optimizer_state=True, bucket_size_mb=0.004)
HALVES = (slice(0, 2), slice(2, 4))
CLIP = 0.05  # below every step's gradient norm: the clip acts at each step
STEPS = 4
OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def train(model, optimizer, data, *, manager=None, on_step=None) -> list[float]:
    """Two micro-batches a step, clipped: plain PyTorch (``manager`` None) or the fused
    step; ``on_step()`` after each. Returns each step's gradient norm."""
    device = next(model.parameters()).device
    norms = []
    for tokens, targets in data:
        tokens, targets = tokens.to(device), targets.to(device)
        for half in HALVES:
            (loss_of(model, tokens[half], targets[half]) / 2).backward()
        if manager is None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
        else:
            norm = manager.step(optimizer, max_grad_norm=CLIP)
        norms.append(norm.item())
        optimizer.zero_grad()
        if on_step is not None:
            on_step()
    return norms


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors with a dimension (the moments, the momentum buffers)."""
    return [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]


def assert_on_the_host(manager, optimizer) -> None:
    """Every state tensor with a dimension is the cache's pinned host copy."""
    host = manager.engine.optimizer_state.copies_of(optimizer)
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if value.dim() > 0:
                assert value.device.type == "cpu", key
                assert value is host[param][key], key
                assert value.is_pinned(), key


def assert_same_weights_and_state(plain, plain_opt, cached, cached_opt) -> None:
    for (name, p), q in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(p.cpu(), q.cpu()), name
        expected, got = plain_opt.state[p], cached_opt.state[q]
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key].cpu(), got[key].cpu()), (name, key)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_state_on_the_host_steps_as_plain_pytorch_on_the_device(
    device: torch.device, name: str
) -> None:
    """Four clipped steps of two micro-batches: weights, state and norms equal plain's on
    the device; after each step the state is on the host, and after the last the device
    holds less than plain's run by at least the state's bytes."""
    make = OPTIMIZERS[name]
    data = batches(STEPS)

    plain = make_model().to(device)
    plain_opt = make(list(plain.parameters()))
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    plain_norms = train(plain, plain_opt, data)
    torch.accelerator.synchronize()
    plain_growth = torch.accelerator.memory_allocated() - before
    state_bytes = sum(v.nbytes for v in state_tensors(plain_opt))
    assert state_bytes and all(v.device == device for v in state_tensors(plain_opt))
    assert plain_growth >= state_bytes  # the measure sees plain's state on the device

    cached = make_model().to(device)
    cached_opt = make(list(cached.parameters()))
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    assert isinstance(manager.engine.backend, AcceleratorBackend)
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    norms = train(
        cached,
        cached_opt,
        data,
        manager=manager,
        on_step=lambda: assert_on_the_host(manager, cached_opt),
    )
    torch.accelerator.synchronize()
    cached_growth = torch.accelerator.memory_allocated() - before

    assert len(cached_opt.state) == len(list(cached.parameters()))
    assert_same_weights_and_state(plain, plain_opt, cached, cached_opt)
    assert norms == plain_norms and min(norms) > CLIP
    assert plain_growth - cached_growth >= state_bytes


@pytest.mark.parametrize("attached", [True, False], ids=["offload_state_of", "first-step"])
def test_the_state_dict_round_trip_resumes_bit_for_bit(
    device: torch.device, attached: bool
) -> None:
    """The optimizer's state_dict saved after three steps (its tensors the host copies),
    loaded into a new optimizer over a new model and cache on the device (after
    ``offload_state_of``: straight into host copies; else moved there by the first step):
    two more steps end as plain PyTorch's uninterrupted five."""
    data = batches(5)
    plain = make_model().to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    train(plain, plain_opt, data)

    first = make_model().to(device)
    first_opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(first, **OPTIONS)
    train(first, first_opt, data[:3], manager=manager)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    manager.remove_hooks()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert all(
        v.device.type == "cpu"
        for state in saved["optimizer"]["state"].values()
        for v in state.values()
    )

    resumed = make_model(seed=7).to(device)
    resumed.load_state_dict(saved["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(resumed, **OPTIONS)
    if attached:
        manager.offload_state_of(resumed_opt)
    resumed_opt.load_state_dict(saved["optimizer"])
    if attached:
        assert_on_the_host(manager, resumed_opt)
    train(resumed, resumed_opt, data[3:], manager=manager)
    assert_on_the_host(manager, resumed_opt)
    assert_same_weights_and_state(plain, plain_opt, resumed, resumed_opt)


def test_a_device_full_as_a_buckets_state_arrives_is_retried_as_plain(device: torch.device) -> None:
    """A capturable AdamW keeps its ``step`` on the device, which the bring clones so that a
    retry finds the count as it was. With the device full just after a bucket's state copies
    started, that clone ran out of memory, left the bucket marked in transit, and every
    retry raised torch's "found at least two devices" (probe N). The clone now comes first;
    the retry, the device freed, steps as plain (no weight decay: plain itself cannot undo
    one an out-of-memory error interrupted), bit for bit, weights and state."""

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, capturable=True)

    data = batches(STEPS)
    plain = make_model().to(device)
    plain_opt = make(list(plain.parameters()))
    train(plain, plain_opt, data)

    cached = make_model().to(device)
    cached_opt = make(list(cached.parameters()))
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    train(cached, cached_opt, data[:1], manager=manager)  # the state exists from here
    tokens, targets = (t.to(device) for t in data[1])
    for half in HALVES:
        (loss_of(cached, tokens[half], targets[half]) / 2).backward()
    backend = manager.engine.optimizer_state.backend
    start = backend.start_to_device

    def fills_the_device(hosts: list[torch.Tensor]):
        transfer = start(hosts)
        backend.start_to_device = start  # the first bucket's only
        emulated_device(capacity_bytes=torch.accelerator.memory_allocated())
        return transfer

    backend.start_to_device = fills_the_device
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(cached_opt, max_grad_norm=CLIP)
    emulated_device()  # uncapped
    manager.step(cached_opt, max_grad_norm=CLIP)
    cached_opt.zero_grad()
    train(cached, cached_opt, data[2:], manager=manager)
    assert_same_weights_and_state(plain, plain_opt, cached, cached_opt)
