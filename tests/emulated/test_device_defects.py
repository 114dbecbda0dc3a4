"""Paths a review found a GPU would break first, with the weights on the host: a gradient
assigned across devices, a failed step, a clip between two backwards. On the emulated
device a gradient on the device assigned to a parameter on the host raises, as on CUDA."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
from typing import ClassVar

import pytest
import torch
from helpers import FailsOnce, interrupt_at
from test_parameters_offload import STREAMED, adamw_two_groups, gpt
from test_parameters_offload import batches_on as on

import gradient_cache
from gradient_cache.engine.optimizer_state import StateJourney
from gradient_cache.engine.weights.masters import HostWeights, WeightAt
from gradient_cache.testing import emulated_device


def same(plain: torch.nn.Module, cached: torch.nn.Module) -> None:
    for (name, a), b in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name


def run_as_plain(run, device: torch.device) -> None:
    """``run(model)`` on plain PyTorch on ``device`` and ``run(model, manager)`` with the
    weights on the host set up from the CPU: the same parameters, bit for bit."""
    plain = gpt().to(device)
    run(plain)
    cached = gpt()
    run(cached, gradient_cache.create_gradient_cache(cached, **STREAMED, device=device))
    same(plain, cached)


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

    run_as_plain(run, device)


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


class Handed(torch.nn.Module):
    """A block whose backward does not all start at the tensor it returns: an auxiliary loss
    (an MoE router's, from an activation or from a weight) left on an attribute, a buffer's
    name, a dataclass or a deque; its output inside an object pytree cannot see into, or
    beside one holding the loss; an input updated in place; a list it was given, written."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.how = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), how
        if how == "buffer aux":
            self.register_buffer("aux", None, persistent=False)

    def forward(self, x, losses=None):
        x = x.value if isinstance(x, Wrapped) else x
        if self.how == "in place":
            return x.add_(self.fc2(torch.tanh(self.fc1(x * 1.0))))
        h = x + self.fc2(torch.tanh(self.fc1(x)))
        aux = 1e-2 * torch.softmax(self.fc1(x), -1).pow(2).mean()  # after the output: first
        if self.how in ("activation aux", "buffer aux"):
            self.aux = aux
        elif self.how == "weight aux":
            self.aux = 1e-3 * self.fc1.weight.pow(2).sum()
        elif self.how == "dataclass aux":
            self.stats = Stats(aux)
        elif self.how == "deque aux":
            self.stats = collections.deque([aux])
        elif self.how == "into a list it was given":
            losses.append(aux)
        elif not hasattr(self, "first"):  # left there, in no later graph
            self.first = h.sum()
        return {"wrapped": Wrapped(h), "beside an object": (h, Wrapped(aux))}.get(self.how, h)

    def loss_term(self):
        if self.how in ("dataclass aux", "deque aux"):
            return self.stats.loss if self.how == "dataclass aux" else self.stats[0]
        return getattr(self, "aux", None)


@dataclasses.dataclass
class Stats:
    loss: torch.Tensor


class Wrapped:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class HandingNet(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Handed(how) for _ in range(4))
        self.head = torch.nn.Linear(16, 1)
        self.how = how

    def forward(self, x):
        x, terms = x * 1.0, []  # not the data in place
        for block in self.blocks:
            x = block(x, losses=terms) if self.how == "into a list it was given" else block(x)
            if isinstance(x, tuple):
                x, beside = x
                terms.append(beside.value)
        x = x.value if isinstance(x, Wrapped) else x
        terms += [t for t in (b.loss_term() for b in self.blocks) if t is not None]
        return self.head(x).pow(2).mean() + sum(terms)


HOW = [
    "activation aux",
    "weight aux",
    "buffer aux",
    "dataclass aux",
    "deque aux",
    "wrapped",
    "beside an object",
    "in place",
    "into a list it was given",
]


@pytest.mark.parametrize("how", HOW)
def test_a_block_handing_on_its_graph_otherwise_than_by_its_outputs_trains_as_plain(
    device, how: str
) -> None:
    """Backward brings a block from hooks on the tensors it returns; a loss it left on an
    attribute ran its backward before them (on freed or still-arriving weights: NaN, or a
    device mismatch), and an output inside a plain object, an input updated in place and a
    list it was given, written, had no hook at all (a bare setStorage error)."""

    def run(model, data, step) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in data:
            model(x).backward()
            step(optimizer)
            optimizer.zero_grad()

    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=generator) for _ in range(3)]
    plain = HandingNet(how)
    run(plain, data, lambda optimizer: optimizer.step())
    cached = HandingNet(how)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    run(cached, [x.to(device) for x in data], manager.step)
    same(plain, cached)


def test_a_tensor_left_on_a_module_across_forwards_is_hooked_once(device) -> None:
    """A hook each forward on a tensor that stays on its module would grow without end."""
    model = HandingNet("kept")
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
    for _ in range(3):
        model(torch.ones(2, 16, device=device)).backward()
        manager.discard_gradients()
    assert len(model.blocks[0].first._backward_hooks) == 1


class Slow(torch.autograd.Function):
    """``x @ weight.T`` whose backward, on autograd's device thread, signals ``started``,
    sleeps, then records whether ``weight`` still had its memory."""

    started = threading.Event()
    had_memory: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.T

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        Slow.started.set()
        time.sleep(0.5)
        Slow.had_memory.append(weight.untyped_storage().nbytes() > 0)
        return grad @ weight, grad.T @ x


class AfterSlow(torch.autograd.Function):
    """Identity whose backward (on the host's thread) waits until `Slow`'s has begun."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Slow.started.wait(timeout=10)
        return grad


def test_the_next_forward_waits_for_a_failed_backwards_last_node_on_the_device(device) -> None:
    """A backward refused on the host's thread returns while autograd's device thread may
    still be inside a node reading a block's weights; the next forward ends that backward
    and frees them, so it waits for the node first (freed under it, it crashed)."""
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), *blocks)
    for block in blocks:
        block.forward = lambda x, block=block: Slow.apply(x, block.weight)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
    x = torch.ones(2, 4, device=device)
    penalty = AfterSlow.apply(blocks[0].weight.square().sum())  # a host term, refused
    with pytest.raises(RuntimeError, match="received a gradient computed on the cpu"):
        (model(x).sum() + penalty).backward()
    model(x)  # ends the failed backward
    assert Slow.had_memory == [True]
    manager.remove_hooks()


class Windowed(torch.nn.Module):
    """A block that returns fp32 under a bf16 compute dtype (its next input comes cast), or
    that appends to a cache object every block is passed and returns it with its output."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.how = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), how

    def forward(self, x, cache=None):
        key = self.fc1(x)
        h = x + self.fc2(torch.tanh(key))
        if cache is None:
            return h.float() if self.how == "fp32 between blocks" else h
        cache.keys.append(key)
        return h, cache


class KeyCache:
    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class WindowNet(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Windowed(how) for _ in range(8))
        self.head, self.how = torch.nn.Linear(16, 1), how

    def forward(self, x):
        cache = KeyCache() if self.how == "a cache passed on" else None
        for block in self.blocks:
            x = block(x) if cache is None else block(x, cache=cache)[0]
        return self.head(x.to(self.head.weight.dtype)).float().pow(2).mean()


def most_blocks_in_backward(device, how: str) -> int:
    """The most of `WindowNet`'s 8 blocks on the device at once in one backward."""
    model = WindowNet(how)
    manager = gradient_cache.create_gradient_cache(
        model, **STREAMED, device=device, compute_dtype=torch.bfloat16
    )
    weights, blocks = manager.engine.weights, [set(b.parameters()) for b in model.blocks]
    most, ensure = [0], weights.ensure

    def counting(params, *args, **kwargs):
        ensure(params, *args, **kwargs)
        present = set(weights.present())
        most[0] = max(most[0], sum(block <= present for block in blocks))

    loss = model(torch.randn(4, 16, device=device))
    weights.ensure = counting
    loss.backward()
    manager.discard_gradients()
    return most[0]


@pytest.mark.parametrize("how", ["fp32 between blocks", "a cache passed on"])
def test_inputs_a_block_got_cast_or_shared_do_not_bring_blocks_back(device, how) -> None:
    """Taken for a block's outputs, a cast copy of its input (its gradient comes once the
    block's backward is done) and the earlier blocks' tensors in a cache object it returns
    brought blocks back after their backward, which stayed: all 8 at once."""
    assert most_blocks_in_backward(device, how) == most_blocks_in_backward(device, "plain")


def test_a_penalty_computed_before_the_forward_is_refused_by_name_and_training_goes_on(
    device,
) -> None:
    """A regularizer over model.parameters() computed before the model's forward uses the
    host masters through an accumulator no hook of the cache's is on: its host gradients
    reach the cache among the device's. Refused by name (it was a bare device-mismatch
    error from the cache's own bucket, or from the close), with no host tensor left in
    .grad: the next batches train as plain PyTorch that never saw the refused one."""
    data = on(device)

    def run(model, manager=None):
        optimizer = adamw_two_groups(model)
        for index, (tokens, targets) in enumerate(data):
            if manager is not None and index == 1:
                penalty = sum(p.square().sum() for p in model.parameters()).to(device)
                with pytest.raises(RuntimeError, match=r"received a gradient computed on the cpu"):
                    (model(tokens, targets)[1] + 1e-3 * penalty).backward()
                assert all(p.grad is None or p.grad.device == device for p in model.parameters())
                manager.discard_gradients()
            model(tokens, targets)[1].backward()
            step(optimizer, manager)
        if manager is not None:
            manager.remove_hooks()

    run_as_plain(run, device)


def test_a_block_weights_host_gradient_is_refused_before_autograd_accumulates_it(device) -> None:
    """A block weight's host term (a penalty computed before the forward) is refused by the
    weight's own tensor hook, before autograd's CPU thread accumulates it beside the device
    thread's part: a post-accumulate-grad hook of the user's never sees a host gradient."""
    model = gpt()
    weight = model.blocks[0].mlp.fc.weight
    seen = []
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.device.type))
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
    tokens, targets = on(device, 1)[0]
    penalty = weight.square().sum().to(device)
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.mlp\.fc\.weight' received a gradient"):
        (model(tokens, targets)[1] + 1e-3 * penalty).backward()
    assert "cpu" not in seen
    manager.discard_gradients()
    manager.remove_hooks()


def linears(device: torch.device) -> torch.nn.Sequential:
    """Eight 256-wide layers (2 MiB): a bucket of 0.25 MiB is a layer's gradients."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8))).to(device)


def inputs(device: torch.device, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 256, generator=generator).to(device) for _ in range(count)]


def test_a_close_out_of_memory_keeps_the_rest_cached_for_a_second_close(device) -> None:
    """A with-block left on the fused step's OutOfMemoryError closes the cache, whose
    restore of what was left ran out of memory too: those gradients were lost, neither
    stepped nor in .grad (a probe: 12 of 16). Now that close raises with them still
    cached; with memory freed, remove_hooks() puts them all in .grad, and a plain
    optimizer.step() ends the step as plain PyTorch's."""
    data = inputs(device, 2)
    plain = linears(device)
    # SGD allocates nothing in its step: the restores are what runs out of memory.
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x in data:
        plain(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    cached = linears(device)
    optimizer = torch.optim.SGD(cached.parameters(), lr=0.1)
    manager = gradient_cache.create_gradient_cache(cached, compression_ratio=1, bucket_size_mb=0.25)
    cached(data[0]).square().mean().backward()
    manager.step(optimizer)
    optimizer.zero_grad()
    cached(data[1]).square().mean().backward()
    # Less free than one bucket: the fused step's restore fails, then the close's.
    emulated_device(capacity_bytes=torch.accelerator.memory_allocated() + 200_000)
    with pytest.raises(torch.OutOfMemoryError) as raised, manager:
        manager.step(optimizer)
    assert "stay cached and the cache stays attached" in str(raised.value)
    emulated_device()
    manager.remove_hooks()
    optimizer.step()
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "window", ["copies-queued", "as-it-returns", "records-half-set", "records-half-set-in-a-step"]
)
def test_a_refill_interrupted_after_its_copies_queued_frees_its_blocks_after_them(
    device, window
) -> None:
    """An interrupt inside the weights' refill once its copies are queued (here the event
    that would mark them done is not made), as it returns, or once the bring recorded one
    weight of several as arriving (in a forward, and in the fused step, where each weight
    has a tensor of its own): the bring frees the blocks on the way out, and a pending copy
    would write into freed memory on a GPU (the emulated device raised that in place of the
    interrupt: probe N; after it returned, the blocks stayed sized with the copies pending,
    and the next forward failed resizing them). The frees wait for the copies now, the
    records say home; the interrupt reaches the caller and the call again trains as plain."""
    data = on(device)

    def interrupted(manager, call) -> None:
        backend, armed = manager.engine.weights.backend, contextlib.nullcontext()
        if window == "as-it-returns":
            interrupt_as_the_next_refill_returns(backend)
        elif window.startswith("records-half-set"):
            line = "weight.at, weight.arrival = WeightAt.ARRIVING, arrival"
            armed = interrupt_at(HostWeights.bring, line, nth=2)
        else:
            interrupt_the_next_refill_after_its_copies(backend)
        with armed, pytest.raises(KeyboardInterrupt):
            call()

    def run(model, manager=None):
        optimizer = adamw_two_groups(model)
        in_a_step = window.endswith("in-a-step")
        for index, (tokens, targets) in enumerate(data):
            interrupting = manager is not None and index == 1
            if interrupting and not in_a_step:
                interrupted(manager, functools.partial(model, tokens, targets))
            model(tokens, targets)[1].backward()
            if interrupting and in_a_step:
                interrupted(manager, lambda: manager.step(optimizer))
            step(optimizer, manager)

    run_as_plain(run, device)


@pytest.mark.parametrize("window", ["copies-queued", "records-in-transit"])
def test_a_state_refill_interrupted_after_its_copies_queued_is_retried_as_plain(
    device, window
) -> None:
    """The same interrupt in the fused step's bring of the optimizer state (the weights on
    the device), with its copies queued, or once it recorded the state in transit, before
    the arrival that would put it back was made (probe B: the retry stepped AdamW with its
    host tensors, a device mismatch). The device tensors are dropped after their copies and
    the records say home; the retried step trains as plain."""
    data = on(device)
    models = []
    for cached in (False, True):
        model = gpt().to(device)
        optimizer = adamw_two_groups(model)
        manager = None
        if cached:
            options = dict(compression_ratio=1, offload_optimizer_state=True)
            manager = gradient_cache.create_gradient_cache(model, **options)
        for index, (tokens, targets) in enumerate(data):
            model(tokens, targets)[1].backward()
            if manager is not None and index == 1:
                armed = contextlib.nullcontext()
                if window == "copies-queued":
                    interrupt_the_next_refill_after_its_copies(manager.engine.backend)
                else:
                    line = "return Arrival(list(params), fresh, keys, transfer, kept)"
                    armed = interrupt_at(StateJourney.bring, line)
                with armed, pytest.raises(KeyboardInterrupt):
                    manager.step(optimizer)
            step(optimizer, manager)
        models.append(model)
    same(*models)


def test_a_forward_interrupted_as_a_units_memory_goes_is_retried_as_plain(device) -> None:
    """A signal as a block's buffer is given up at its forward's end, once its memory went
    (Python checks for signals as the call returns): the unit still said it had arrived,
    and the retried forward read a freed buffer ("the storage was freed (resize_) and not
    refilled": probe B). The arrival is forgotten first; the retry trains as plain."""
    data = on(device)

    def run(model, manager=None):
        optimizer = adamw_two_groups(model)
        for index, (tokens, targets) in enumerate(data):
            if manager is not None and index == 1:
                interrupt_as_the_next_free_returns(manager.engine.weights.backend)
                with pytest.raises(KeyboardInterrupt):
                    model(tokens, targets)
            model(tokens, targets)[1].backward()
            step(optimizer, manager)

    run_as_plain(run, device)


@pytest.mark.parametrize("home", [True, False], ids=["home-in-the-step", "arriving-in-a-forward"])
def test_an_interrupt_as_a_weight_moves_leaves_p_where_its_record_says(device, home) -> None:
    """A KeyboardInterrupt as a weight moves, once its record says where (home after its
    step, in the fused step's free; on the device, in a forward's ensure) but before ``P``
    reads there (a signal: no error comes there). Every later forward was refused ("The
    model's parameters changed", whose advice did not apply: probe N); now ``P`` reads
    where its record says, and the retried step (the forward again) trains as plain."""
    data = on(device)
    at = WeightAt.HOST if home else WeightAt.DEVICE

    def run(model, manager=None):
        optimizer = adamw_two_groups(model)
        for index, (tokens, targets) in enumerate(data):
            interrupting = manager is not None and index == 1
            if interrupting and not home:
                interrupt_the_next_show(manager.engine.weights.placement, at)
                with pytest.raises(KeyboardInterrupt):
                    model(tokens, targets)
            model(tokens, targets)[1].backward()
            if interrupting and home:
                interrupt_the_next_show(manager.engine.weights.placement, at)
                with pytest.raises(KeyboardInterrupt):
                    manager.step(optimizer)
            step(optimizer, manager)

    run_as_plain(run, device)


def interrupt_the_next_show(placement, at: WeightAt) -> None:
    """``placement``'s next showing of a weight whose record says ``at`` raises
    KeyboardInterrupt before it runs, once."""
    show = placement.show

    def interrupted(param, weight):
        if weight.at is not at:
            return show(param, weight)
        del placement.show  # once: the class's again
        raise KeyboardInterrupt

    placement.show = interrupted


def step(optimizer: torch.optim.Optimizer, manager=None) -> None:
    """Plain PyTorch's step (``manager`` None) or the cache's fused one, then zero_grad."""
    if manager is None:
        optimizer.step()
    else:
        manager.step(optimizer)
    optimizer.zero_grad()


def interrupt_as_the_next_free_returns(backend) -> None:
    """``backend``'s next ``resize_storage(tensor, 0)`` frees the memory, and a
    KeyboardInterrupt reaches its caller as it returns, once."""
    resize = backend.resize_storage

    def interrupted(tensor, nbytes):
        resize(tensor, nbytes)
        if nbytes == 0:
            del backend.resize_storage  # once: the class's again
            raise KeyboardInterrupt

    backend.resize_storage = interrupted


def interrupt_as_the_next_refill_returns(backend) -> None:
    """``backend``'s next ``start_refill`` queues its copies and returns, and a
    KeyboardInterrupt reaches its caller as it returns, once."""
    start_refill = backend.start_refill

    def interrupted(*args, **kwargs):
        backend.start_refill = start_refill  # once
        start_refill(*args, **kwargs)
        raise KeyboardInterrupt

    backend.start_refill = interrupted


def interrupt_the_next_refill_after_its_copies(backend) -> None:
    """``backend``'s next ``start_refill`` raises KeyboardInterrupt once its copies are
    queued, where it makes their event."""
    start_refill, new_event = backend.start_refill, backend.streams.new_event

    def fails(*args, **kwargs):
        raise KeyboardInterrupt

    def interrupted(*args, **kwargs):
        backend.start_refill = start_refill  # once
        backend.streams.new_event = fails
        try:
            return start_refill(*args, **kwargs)
        finally:
            backend.streams.new_event = new_event

    backend.start_refill = interrupted
