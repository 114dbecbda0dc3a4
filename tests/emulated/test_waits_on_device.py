"""Every wait of the accelerator backend, shown on the emulated device with real values.

On the emulated device a non_blocking copy between pinned host memory and the device (or
from device to device) lands only when something orders after it, so a read that misses
its wait sees the bytes that were there before, on every run. These trainings go through
each wait of `gradient_cache/engine/accelerator.py` that one process without FSDP2
reaches (and the paths of the weights and the optimizer state on the host that call
them) and must give plain PyTorch's bits on the same device. The team's wait-mutation
tool (`MUTATE_TEST=tests/emulated/test_waits_on_device.py`) deletes each wait in turn:
docs/ARCHITECTURE.md ("How ordering is tested without a GPU") lists which ones these
tests kill and why the others cannot be shown here.

The emulated device runs every kernel at once: only copies are queued. Where a wait
orders the backend after work on the compute stream (a gradient backward just wrote, a
weight the step just updated), the tests below end that work with a non_blocking copy,
the one write the device queues (on a GPU every kernel is queued so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from test_parameters_offload import STREAMED, adamw_two_groups, batches, gpt

import gradient_cache
from gradient_cache import TopK
from gradient_cache.codecs.lossless import Lossless
from gradient_cache.codecs.payloads import DensePayload
from gradient_cache.engine.accelerator import AcceleratorBackend

SMALL = 0.004  # MiB: about a bucket per weight matrix of the tiny GPT (17 a backward)

Data = list[tuple[torch.Tensor, torch.Tensor]]


def on(device: torch.device, data: Data) -> Data:
    return [(tokens.to(device), targets.to(device)) for tokens, targets in data]


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Data,
    *,
    manager: gradient_cache.GradientCacheHookManager | None = None,
    micro_batches: int = 1,
    clip: float | None = None,
    fused: bool = True,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """Plain PyTorch's loop (``manager`` None), the fused step's (``fused``), or
    apply_gradients() then the optimizer's; ``micro_batches`` backwards back to back per
    step, with no drain between them; ``after_step(i)`` right after step ``i``."""
    steps = 0
    for i, (tokens, targets) in enumerate(data):
        _, loss = model(tokens, targets)
        (loss / micro_batches).backward()
        if (i + 1) % micro_batches:
            continue
        if manager is not None and fused:
            manager.step(optimizer, max_grad_norm=clip)
        else:
            if manager is not None:
                manager.apply_gradients()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(steps)
        steps += 1


def assert_same(expected: Iterable[torch.Tensor], actual: Iterable[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        a, b = a.detach().cpu(), b.detach().cpu()
        assert torch.equal(a, b), f"tensor {i} differs by {(a - b).abs().max().item()}"


def cache(model: torch.nn.Module, **options) -> gradient_cache.GradientCacheHookManager:
    manager = gradient_cache.create_gradient_cache(model, **options)
    assert isinstance(manager.engine.backend, AcceleratorBackend)
    return manager


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of ``optimizer.state_dict()``'s tensors, in order (a host read of the state
    where it is on the host)."""
    state = optimizer.state_dict()["state"]
    return [state[i][key].clone() for i in sorted(state) for key in sorted(state[i])]


# --- gradients: encode, copy, drain, restore ---------------------------------------------


@pytest.mark.parametrize("staging_depth", [1, 2])
@pytest.mark.parametrize(
    ("fused", "clip"),
    [(False, None), (False, 0.5), (True, None), (True, 0.5)],
    ids=["apply", "apply-clip", "fused", "fused-clip"],
)
def test_many_small_buckets_train_as_plain_pytorch(
    device: torch.device, staging_depth: int, fused: bool, clip: float | None
) -> None:
    """17 buckets a backward, two micro-batches back to back: the retirement waits
    (depth 1 retires each bucket at the next launch), the encode after backward, the copy
    after the encode, the drain, and each restore (the fused step's a bucket ahead, and
    without a clip nothing but the compute stream's wait lands the restore's copies)."""
    data = on(device, batches(6))
    plain = gpt().to(device)
    train(plain, adamw_two_groups(plain), data, micro_batches=2, clip=clip)
    cached = gpt().to(device)
    optimizer = adamw_two_groups(cached)
    manager = cache(cached, compression_ratio=1, bucket_size_mb=SMALL, staging_depth=staging_depth)
    train(cached, optimizer, data, manager=manager, micro_batches=2, clip=clip, fused=fused)
    assert_same(plain.parameters(), cached.parameters())


ACCUMULATED = {
    "lossless": dict(compression_ratio=1),
    "ef-host": dict(
        compression_ratio=20,
        codec=TopK(residual_location="host", selection="exact"),
        min_compress_numel=1,
    ),
    "ef-host-fp32": dict(
        compression_ratio=20,
        codec=TopK(residual_location="host", residual_dtype="float32", selection="exact"),
        min_compress_numel=1,
    ),
}


@pytest.mark.parametrize("options", ACCUMULATED.values(), ids=ACCUMULATED.keys())
def test_accumulation_without_a_drain_reads_each_slot_after_its_copy(
    device: torch.device, options: dict
) -> None:
    """Three micro-batches a step, with more buckets allowed in flight than a backward
    launches, so no retirement waits: the second micro-batch's encode reads the first's
    payload (and host residual) from slots the host never waited for. The reference is
    the CPU backend's run (lossless: plain PyTorch's bits too)."""
    options = dict(options, bucket_size_mb=SMALL, staging_depth=64)
    data = batches(6)
    reference = gpt()
    reference_manager = gradient_cache.create_gradient_cache(reference, **options, backend="cpu")
    train(reference, adamw_two_groups(reference), data, manager=reference_manager, micro_batches=3)
    cached = gpt().to(device)
    manager = cache(cached, **options)
    train(cached, adamw_two_groups(cached), on(device, data), manager=manager, micro_batches=3)
    assert_same(reference.parameters(), cached.parameters())
    # A host read of the cache's state (its residuals) right after a step.
    saved, expected = manager.state_dict(), reference_manager.state_dict()
    names = sorted(expected["residuals"])
    assert sorted(saved["residuals"]) == names
    assert_same([expected["residuals"][n] for n in names], [saved["residuals"][n] for n in names])


# --- the optimizer state and the weights on the host -------------------------------------


@pytest.mark.parametrize("staging_depth", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
def test_the_optimizer_state_on_the_host_trains_as_plain_pytorch(
    device: torch.device, staging_depth: int, clip: float | None
) -> None:
    """Each bucket's state brought to the device before its step, copied back after it,
    its device copy let go after that; ``optimizer.state_dict()`` right after each step
    reads the host copies."""
    data = on(device, batches(6))
    plain = gpt().to(device)
    plain_optimizer = adamw_two_groups(plain)
    states: list[list[torch.Tensor]] = []
    train(
        plain,
        plain_optimizer,
        data,
        micro_batches=2,
        clip=clip,
        after_step=lambda _: states.append(optimizer_state(plain_optimizer)),
    )
    cached = gpt().to(device)
    optimizer = adamw_two_groups(cached)
    manager = cache(
        cached,
        compression_ratio=1,
        offload_optimizer_state=True,
        bucket_size_mb=SMALL,
        staging_depth=staging_depth,
    )
    train(
        cached,
        optimizer,
        data,
        manager=manager,
        micro_batches=2,
        clip=clip,
        after_step=lambda i: assert_same(states[i], optimizer_state(optimizer)),
    )
    assert_same(plain.parameters(), cached.parameters())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "recomputed"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
def test_the_weights_on_the_host_train_as_plain_pytorch(
    device: torch.device, checkpointing: bool, clip: float | None
) -> None:
    """Each block's weights refilled before its forward and its backward (or its
    recomputation), given up after; each bucket's weights brought to the step and copied
    back; ``model.state_dict()``, ``optimizer.state_dict()`` and the cache's state read on
    the host right after each step."""
    data = on(device, batches(4))
    plain = gpt(checkpointing=checkpointing).to(device)
    plain_optimizer = adamw_two_groups(plain)
    seen: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    train(
        plain,
        plain_optimizer,
        data,
        micro_batches=2,
        clip=clip,
        after_step=lambda _: seen.append(
            ([t.clone() for t in plain.state_dict().values()], optimizer_state(plain_optimizer))
        ),
    )
    cached = gpt(checkpointing=checkpointing).to(device)
    optimizer = adamw_two_groups(cached)
    manager = cache(cached, **STREAMED, bucket_size_mb=SMALL)

    def read_on_the_host(i: int) -> None:
        weights, state = seen[i]
        assert_same(weights, cached.state_dict().values())
        assert_same(state, optimizer_state(optimizer))
        assert manager.state_dict()["buckets"] == []

    train(
        cached,
        optimizer,
        data,
        manager=manager,
        micro_batches=2,
        clip=clip,
        after_step=read_on_the_host,
    )
    assert all(p.device.type == "cpu" for p in cached.parameters())  # the masters at rest
    assert_same(plain.parameters(), cached.parameters())


# --- work the emulated device queues: where a wait orders after the compute stream ------


class QueuedGradient(torch.autograd.Function):
    """The identity, whose backward's last write of the gradient is a non_blocking copy:
    backward's last kernel, still queued on the compute stream when the hook runs."""

    @staticmethod
    def forward(ctx: object, weight: torch.Tensor) -> torch.Tensor:
        return weight.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(grad).copy_(grad, non_blocking=True)


class QueuedLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(
            x, QueuedGradient.apply(self.weight), QueuedGradient.apply(self.bias)
        )


def queued_mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [QueuedLinear(32, 64), torch.nn.Tanh(), QueuedLinear(64, 64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, QueuedLinear(64, 8)).to(device)


@pytest.mark.parametrize("staging_depth", [1, 2])
def test_the_encode_reads_a_gradient_after_the_kernel_that_wrote_it(
    device: torch.device, staging_depth: int
) -> None:
    """Each gradient's last write is still queued on the compute stream when its hook
    launches the bucket: the encode (here the fused step's clip norm it computes) must
    come after it."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator))]
    data = on(device, data * 4)

    def run(manager_options: dict | None) -> torch.nn.Module:
        model = queued_mlp(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        manager = None if manager_options is None else cache(model, **manager_options)
        for i, (x, y) in enumerate(data):
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            if i % 2 == 0:
                continue
            if manager is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                optimizer.step()
            else:
                manager.step(optimizer, max_grad_norm=0.1)
            optimizer.zero_grad()
        return model

    plain = run(None)
    options = dict(compression_ratio=1, bucket_size_mb=SMALL, staging_depth=staging_depth)
    assert_same(plain.parameters(), run(options).parameters())


def test_the_copy_reads_a_payload_after_the_encode_that_wrote_it(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A codec whose encode ends with a non_blocking copy into its payload (its last
    kernel, queued on the encode stream): the copy to the host must come after it."""

    def encode(self, flat, residual, *, loss_scale):
        return DensePayload(torch.empty_like(flat).copy_(flat, non_blocking=True)), None

    monkeypatch.setattr(Lossless, "encode", encode)
    data = on(device, batches(4))
    plain = gpt().to(device)
    train(plain, adamw_two_groups(plain), data, micro_batches=2)
    cached = gpt().to(device)
    manager = cache(cached, compression_ratio=1, bucket_size_mb=SMALL, staging_depth=2)
    train(cached, adamw_two_groups(cached), data, manager=manager, micro_batches=2, fused=False)
    assert_same(plain.parameters(), cached.parameters())


class QueuedSGD(torch.optim.Optimizer):
    """SGD with momentum whose last writes of each weight and momentum buffer are
    non_blocking copies: the step's last kernels, queued on the compute stream."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.05, "momentum": 0.9})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                momentum = buffer * group["momentum"] + p.grad
                p.copy_(p - group["lr"] * momentum, non_blocking=True)
                buffer.copy_(momentum, non_blocking=True)


@pytest.mark.parametrize("weights", [False, True], ids=["state", "state-and-weights"])
def test_the_copy_back_reads_what_the_step_wrote(device: torch.device, weights: bool) -> None:
    """The step's last writes of the weights and the momentum are still queued on the
    compute stream when their copies back to the host start."""
    options = STREAMED if weights else dict(compression_ratio=1, offload_optimizer_state=True)
    data = on(device, batches(6))
    plain = gpt().to(device)
    train(plain, QueuedSGD(plain.parameters()), data, micro_batches=2)
    cached = gpt().to(device)
    optimizer = QueuedSGD(cached.parameters())
    manager = cache(cached, **options, bucket_size_mb=SMALL)
    train(cached, optimizer, data, manager=manager, micro_batches=2)
    assert_same(plain.parameters(), cached.parameters())


def test_the_state_brought_home_reads_a_host_copy_after_a_write_queued_before(
    device: torch.device,
) -> None:
    """A write into a host copy of the state queued on the compute stream (a copy from
    the device) after a step, then the cache detached: the write must land after the
    step's copies back into that host copy, and bringing the state home to the device
    must read the host copy after the write."""
    data = on(device, batches(6))

    def run(offload: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = gpt().to(device)
        optimizer = adamw_two_groups(model)
        manager = None
        if offload:
            manager = cache(
                model, compression_ratio=1, offload_optimizer_state=True, bucket_size_mb=SMALL
            )
        train(model, optimizer, data[:4], manager=manager)
        with torch.no_grad():
            for state in optimizer.state.values():
                moment = state["exp_avg"]
                moment.copy_(torch.full(moment.shape, 1e-3, device=device), non_blocking=True)
        if manager is not None:
            manager.remove_hooks()
        train(model, optimizer, data[4:])
        return model, optimizer

    plain, plain_optimizer = run(offload=False)
    cached, optimizer = run(offload=True)
    assert_same(plain.parameters(), cached.parameters())
    assert_same(optimizer_state(plain_optimizer), optimizer_state(optimizer))
