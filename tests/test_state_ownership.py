"""Whose the optimizer state on the host is (``offload_optimizer_state=True``): each
optimizer's own, even over a shared parameter; sent to the host when a step or a resumed
run begins; handed back to the optimizer, on its device, when the cache closes."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from helpers import after_each_update, stepping_and_off_the_host
from torch import nn

import gradient_cache
from gradient_cache.engine.optimizer_state import HostOptimizerState

OPTIONS = dict(compression_ratio=1, offload_optimizer_state=True, bucket_size_mb=0.0005)


class TwoHeads(nn.Module):
    """A trunk shared by two heads (multi-task training)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.trunk(inputs))
        return self.head_a(hidden), self.head_b(hidden)


def optimizers(model: TwoHeads) -> tuple[torch.optim.AdamW, torch.optim.AdamW]:
    """One AdamW per head, each over the trunk and its head."""
    trunk = list(model.trunk.parameters())
    return (
        torch.optim.AdamW([*trunk, *model.head_a.parameters()], lr=1e-2),
        torch.optim.AdamW([*trunk, *model.head_b.parameters()], lr=1e-2),
    )


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator))
        for _ in range(steps)
    ]


def head_losses(model: TwoHeads, inputs: torch.Tensor, targets: torch.Tensor) -> list:
    return [nn.functional.mse_loss(out, targets) for out in model(inputs)]


def same_weights(left: nn.Module, right: nn.Module) -> bool:
    pairs = zip(left.parameters(), right.parameters(), strict=True)
    return all(torch.equal(a, b) for a, b in pairs)


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]


def test_two_optimizers_over_a_shared_trunk_keep_their_own_state() -> None:
    """A backward per head, each head's optimizer stepped after its own: both step the
    trunk, each with its own moments, as plain PyTorch; bit for bit. (Host copies keyed by
    parameter alone gave both optimizers one exp_avg, and the trunk drifted from plain's.)"""
    plain, cached = TwoHeads(), TwoHeads()
    plain_opts, cached_opts = optimizers(plain), optimizers(cached)
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    for inputs, targets in data(4):
        for head, (plain_opt, cached_opt) in enumerate(zip(plain_opts, cached_opts, strict=True)):
            head_losses(plain, inputs, targets)[head].backward()
            plain_opt.step()
            plain_opt.zero_grad()
            head_losses(cached, inputs, targets)[head].backward()
            manager.step(cached_opt)
            cached_opt.zero_grad()
    opt_a, opt_b = cached_opts
    weight = cached.trunk.weight
    assert opt_a.state[weight]["exp_avg"] is not opt_b.state[weight]["exp_avg"]
    assert same_weights(plain, cached)
    for plain_opt, cached_opt in zip(plain_opts, cached_opts, strict=True):
        for p, q in zip(plain.parameters(), cached.parameters(), strict=True):
            for key, value in plain_opt.state.get(p, {}).items():
                assert torch.equal(value, cached_opt.state[q][key]), key
    # Every state tensor is its own optimizer's host copy; the accounting counts both.
    states = manager.engine.optimizer_state
    for optimizer in cached_opts:
        host = states.copies_of(optimizer)
        for param, state in optimizer.state.items():
            assert all(v is host[param][k] for k, v in state.items() if v.dim() > 0)
    trunk_bytes = 2 * 2 * weight.numel() * weight.element_size()  # 2 optimizers, 2 moments
    assert states.bytes_by_param()[weight] == trunk_bytes
    held = {id(t) for t in states.host_tensors()}
    assert {id(t) for o in cached_opts for t in state_tensors(o)} == held


def train_one_epoch(model: TwoHeads, optimizer: torch.optim.Optimizer, epoch: int) -> None:
    """Three steps of both heads' losses, one optimizer (a plain loop: with the decorator,
    optimizer.step() is the fused step)."""
    for inputs, targets in data(3 * (epoch + 1))[3 * epoch :]:
        sum(head_losses(model, inputs, targets)).backward()
        optimizer.step()
        optimizer.zero_grad()


def live_states() -> list[HostOptimizerState]:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is HostOptimizerState]


def test_remove_hooks_hands_the_state_back_to_the_optimizer() -> None:
    """After remove_hooks the optimizer has none of the cache's load hooks and no state
    tensor is (or shares memory with) a host copy; it steps on without the cache as plain
    PyTorch, and the closed cache is collected while the optimizer lives."""
    plain, cached = TwoHeads(), TwoHeads()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    for inputs, targets in data(2):
        sum(head_losses(plain, inputs, targets)).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        sum(head_losses(cached, inputs, targets)).backward()
        manager.step(cached_opt)
        cached_opt.zero_grad()
    assert manager.engine is not None
    states = weakref.ref(manager.engine.optimizer_state)
    hosts = list(manager.engine.optimizer_state.host_tensors())
    assert len(hosts) == len(state_tensors(cached_opt)) > 0
    manager.remove_hooks()
    assert not cached_opt._optimizer_load_state_dict_pre_hooks
    assert not cached_opt._optimizer_load_state_dict_post_hooks
    host_memory = {h.untyped_storage().data_ptr() for h in hosts}
    for value in state_tensors(cached_opt):
        assert all(value is not h for h in hosts)
        assert value.untyped_storage().data_ptr() not in host_memory
    del manager, hosts
    gc.collect()
    assert states() is None  # the optimizer does not keep the closed cache alive
    train_one_epoch(plain, plain_opt, 2)
    train_one_epoch(cached, cached_opt, 2)
    assert same_weights(plain, cached)


def test_a_decorated_epoch_function_reusing_one_optimizer_trains_as_plain() -> None:
    """@optimize(offload_optimizer_state=True) on a per-epoch function, called three times
    with one AdamW made outside it: each call's cache takes the state to the host and hands
    it back on exit, so the run is plain's bit for bit and no closed cache stays alive."""
    plain, cached = TwoHeads(), TwoHeads()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    epoch_with_cache = gradient_cache.optimize(**OPTIONS)(train_one_epoch)
    before = len(live_states())
    for epoch in range(3):
        train_one_epoch(plain, plain_opt, epoch)
        epoch_with_cache(cached, cached_opt, epoch)
        assert len(live_states()) == before
        assert same_weights(plain, cached)
    for p, q in zip(plain.parameters(), cached.parameters(), strict=True):
        for key, value in plain_opt.state[p].items():
            assert torch.equal(value, cached_opt.state[q][key]), key


def cached_steps(model: TwoHeads, manager, optimizer, steps) -> None:
    for inputs, targets in steps:
        sum(head_losses(model, inputs, targets)).backward()
        manager.step(optimizer)
        optimizer.zero_grad()


def test_a_state_loaded_before_offload_state_of_goes_to_the_host_when_the_step_begins() -> None:
    """A loop that loads the optimizer's state without offload_state_of (the state then
    lands on the device, whole): the first fused step sends it all to the host before its
    first bucket steps, so each bucket steps with only its own state off the host; and
    the run goes on as the uninterrupted one, bit for bit."""
    steps = data(4)
    first = TwoHeads()
    first_opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(first, **OPTIONS)
    cached_steps(first, manager, first_opt, steps[:2])
    saved = copy.deepcopy({"model": first.state_dict(), "optimizer": first_opt.state_dict()})
    cached_steps(first, manager, first_opt, steps[2:])
    manager.remove_hooks()

    resumed = TwoHeads()
    resumed.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    optimizer.load_state_dict(saved["optimizer"])  # no cache yet: the state is not on the host
    cache = gradient_cache.create_gradient_cache(resumed, **OPTIONS)
    only_its_own = []

    def check(optimizer) -> None:
        stepping, off_host = stepping_and_off_the_host(cache, optimizer)
        only_its_own.append(off_host <= stepping)

    after_each_update(optimizer, check)
    cached_steps(resumed, cache, optimizer, steps[2:])
    assert len(only_its_own) >= 4 and all(only_its_own)  # two buckets a step
    assert same_weights(first, resumed)


def both_heads_then_both_steps(model, opt_a, opt_b, steps, step=None) -> None:
    """One backward of both heads' losses, then each optimizer's step, zero_grad last:
    plain PyTorch steps the trunk twice, with the same gradient."""
    for inputs, targets in steps:
        sum(head_losses(model, inputs, targets)).backward()
        for optimizer in (opt_a, opt_b):
            optimizer.step() if step is None else step(optimizer)
        opt_a.zero_grad()
        opt_b.zero_grad()


def test_a_shared_gradient_another_optimizers_step_took_is_refused_with_the_fix() -> None:
    """After step(opt_a) took the trunk's cached gradient (freed, as zero_grad would),
    step(opt_b) cannot know whether plain PyTorch would step the trunk again (no zero_grad
    between) or not: it refuses, before changing anything, and names the fixes. So does
    the decorator's optimizer.step(). The fix exclude_layers=["trunk"] trains as plain,
    bit for bit, with the state of both optimizers on the host. (Before: opt_b stepped
    the heads only, and the trunk ended 0.04 from plain's in 4 steps.)"""
    cached = TwoHeads()
    opt_a, opt_b = optimizers(cached)
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    with pytest.raises(RuntimeError, match=r"trunk\.weight.*zero_grad.*exclude_layers"):
        both_heads_then_both_steps(cached, opt_a, opt_b, data(1), manager.step)
    manager.remove_hooks()
    decorated = gradient_cache.optimize(compression_ratio=1)(both_heads_then_both_steps)
    with pytest.raises(RuntimeError, match="exclude_layers"):
        model = TwoHeads()
        decorated(model, *optimizers(model), data(1))

    plain, cached = TwoHeads(), TwoHeads()
    plain_opts, cached_opts = optimizers(plain), optimizers(cached)
    manager = gradient_cache.create_gradient_cache(cached, exclude_layers=["trunk"], **OPTIONS)
    both_heads_then_both_steps(plain, *plain_opts, data(4))
    both_heads_then_both_steps(cached, *cached_opts, data(4), manager.step)
    assert same_weights(plain, cached)
    weight = cached.trunk.weight
    assert cached_opts[0].state[weight]["exp_avg"] is not cached_opts[1].state[weight]["exp_avg"]


def test_the_load_hooks_hold_the_cache_weakly() -> None:
    """An optimizer attached to a cache that is dropped unclosed does not keep it alive;
    its load_state_dict then works as plain PyTorch's (the hooks do nothing)."""
    model = TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    assert manager.engine is not None
    states = HostOptimizerState(manager.engine.backend, 0.5)
    states.attach(optimizer)
    alive = weakref.ref(states)
    del states
    gc.collect()
    assert alive() is None
    manager.remove_hooks()
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(saved)
    assert optimizer.state_dict()["param_groups"] == saved["param_groups"]


def test_a_state_the_device_has_no_room_for_at_close_stays_on_the_host(monkeypatch) -> None:
    """remove_hooks at the end of a run whose state fits only in host memory: bringing it
    to the device runs out of memory, and the state stays in host memory, with a warning,
    instead of failing the close; the optimizer's state_dict still reads it."""
    model = TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    for inputs, targets in data(1):
        sum(head_losses(model, inputs, targets)).backward()
        manager.step(optimizer)
    assert manager.engine is not None
    hosts = list(manager.engine.optimizer_state.host_tensors())

    def no_room(tensors):
        raise torch.OutOfMemoryError("injected: out of memory")

    monkeypatch.setattr(manager.engine.backend, "start_to_device", no_room)
    with pytest.warns(UserWarning, match="did not fit on the device"):
        manager.remove_hooks()
    assert all(any(v is h for h in hosts) for v in state_tensors(optimizer))
    assert not optimizer._optimizer_load_state_dict_pre_hooks
    assert len(optimizer.state_dict()["state"]) == len(list(model.parameters()))


class CountedResets:
    """A device's statistics (`budget.DeviceMemory`) that count the peak's resets."""

    def __init__(self) -> None:
        self.resets = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 2**40


def test_a_budget_measures_from_training_start_not_from_the_loaded_state() -> None:
    """The integrations' call when training starts (after a resume loaded the state onto
    the device and it went to the host) restarts an undecided budget's measurement, so
    the loaded state's stay on the device is not measured as a step's peak."""
    model = TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    memory = CountedResets()
    manager = gradient_cache.create_gradient_cache(
        model, memory_budget="50%", device_memory=memory, **OPTIONS
    )
    assert memory.resets == 1  # at creation
    manager.optimizer_step.offload_loaded_state([optimizer])
    assert memory.resets == 2
