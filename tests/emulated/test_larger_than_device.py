"""A model larger than the device, set up from the host (``device=``), on the emulated device
with a cap: plain PyTorch cannot place it, the cache trains it bit for bit with plain
PyTorch on the CPU, and the device never holds more than its cap."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import gradient_cache
from gradient_cache.demo.models import GPTConfig, TinyGPT
from gradient_cache.testing import emulated_device

CONFIG = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=24, n_heads=2)
OPTIONS = {
    "compression_ratio": 1,
    "offload_optimizer_state": True,
    "offload_parameters": True,
    "bucket_size_mb": 0.1,  # two buckets of weights, gradients and AdamW state at the step
}


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CONFIG, activation_checkpointing=True)


def batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        tuple(torch.randint(64, (2, 16), generator=generator).to(device) for _ in range(2))
        for _ in range(3)
    ]


def train(net: TinyGPT, data, manager=None) -> list[float]:
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for tokens, targets in data:
        _, loss = net(tokens, targets)
        loss.backward()
        losses.append(loss.item())
        if manager is None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
        else:
            manager.step(optimizer, max_grad_norm=1.0)
        optimizer.zero_grad()
    return losses


def weights_bytes(net: torch.nn.Module) -> int:
    return sum(p.nbytes for p in net.parameters())


def test_a_model_twice_the_cap_trains_from_the_host_bit_for_bit(device: torch.device) -> None:
    plain = model()
    cap = weights_bytes(plain) // 2  # its fp32 weights alone are twice the device
    assert len(plain.blocks) == 24
    expected = train(plain, batches(torch.device("cpu")))

    gc.collect()  # a manager an earlier test left in a cycle closes now, not under the cap
    emulated_device(capacity_bytes=cap)
    with pytest.raises(torch.OutOfMemoryError):
        model().to(device)  # plain PyTorch cannot even place it
    torch.accelerator.reset_peak_memory_stats()
    cached = model()  # on the host
    base = torch.accelerator.memory_allocated()
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS, device=device)
    assert all(p.device.type == "cpu" for p in cached.parameters())  # the masters, at rest
    assert torch.accelerator.memory_allocated() - base < cap // 8  # buffers: nothing brought
    losses = train(cached, batches(device), manager)
    assert losses == expected
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.accelerator.max_memory_allocated() <= cap  # the allocator enforces it too
    # A backward's gradients still cached at the close come back beside the weights, which
    # stay on the host (no room to bring them all back).
    tokens, targets = batches(torch.device("cpu"))[0]
    plain(tokens, targets)[1].backward()
    cached(tokens.to(device), targets.to(device))[1].backward()
    cached(tokens.to(device))  # a forward whose graph is dropped: its weights guarded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.remove_hooks()
    assert any("did not fit on the device" in str(w.message) for w in caught)
    assert all(p.device.type == "cpu" for p in cached.parameters())
    assert all(type(p) is torch.nn.Parameter for p in cached.parameters())  # no guard left
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        assert b.grad is not None and b.grad.device.type == "cpu" and torch.equal(a.grad, b.grad)


def test_the_default_buckets_train_a_model_twice_the_cap_bit_for_bit(device) -> None:
    """With the weights on the host the automatic bucket is a 32nd of the gradients: the
    step's two buckets of weights, gradients and AdamW state are a quarter of the fp32
    weights, so a model twice the device trains with no ``bucket_size_mb`` (with an eighth
    they were the whole weights: out of memory in backward)."""
    plain = model()
    cap = weights_bytes(plain) // 2
    expected = train(plain, batches(torch.device("cpu")))

    gc.collect()
    emulated_device(capacity_bytes=cap)
    torch.accelerator.reset_peak_memory_stats()
    cached = model()
    defaults = {name: value for name, value in OPTIONS.items() if name != "bucket_size_mb"}
    manager = gradient_cache.create_gradient_cache(cached, **defaults, device=device)
    assert train(cached, batches(device), manager) == expected
    assert manager.engine.assembler.capacity_bytes == weights_bytes(cached) // 32
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.accelerator.max_memory_allocated() <= cap
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*did not fit on the device")  # the weights stay
        manager.remove_hooks()


def test_a_model_already_on_the_device_is_set_up_as_before(device: torch.device) -> None:
    net = model().to(device)
    blocks = [weights_bytes(block) for block in net.blocks]
    unit = max(*blocks, weights_bytes(net) - sum(blocks))  # a block, or the rest
    torch.accelerator.reset_peak_memory_stats()
    base = torch.accelerator.memory_allocated()
    manager = gradient_cache.create_gradient_cache(net, **OPTIONS, device=device)
    assert all(p.device.type == "cpu" for p in net.parameters())
    # Beside the whole model, the set-up holds one unit's new device tensor at a time.
    assert torch.accelerator.max_memory_allocated() - base <= unit
    train(net, batches(device), manager)
    manager.remove_hooks()
    assert all(p.device == device for p in net.parameters())


class Scaled(torch.nn.Module):
    """Three blocks and a buffer the head reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (x * self.scale).square().mean()


def test_a_model_set_up_from_the_host_has_its_buffers_on_the_device(device) -> None:
    plain, cached = Scaled(), Scaled()
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS, device=device)
    assert cached.scale.device == device and all(
        p.device.type == "cpu" for p in cached.parameters()
    )
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plain(x).backward()
    cached(x.to(device)).backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    manager.step(torch.optim.SGD(cached.parameters(), lr=0.1))
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(a, b)


def test_set_up_from_the_host_refuses_what_it_cannot_do(device: torch.device) -> None:
    with pytest.raises(ValueError, match="acts only with offload_parameters=True"):
        gradient_cache.create_gradient_cache(model(), compression_ratio=1, device=device)
    split = model()
    split.lm_head.to(device)
    split.tok_emb.to(device)  # tied: both on the device, the blocks on the host
    with pytest.raises(ValueError, match="whose parameters are on the host, and this one's"):
        gradient_cache.create_gradient_cache(split, **OPTIONS, device=device)


def test_the_gpu_checks_larger_than_device_part_refuses_plain_at_placement(device) -> None:
    """perf/larger_than_device.py (gpu_check.sh's part) on the emulated device, capped at
    half the fp32 weights: plain is refused at placement, the cache trains under the cap
    (the allocator's peak from its creation on) bit for bit with plain uncapped."""
    from perf import larger_than_device

    report = larger_than_device.main(["--device", "emu", "--size", "tiny", "--steps", "2"])
    assert report["runs_finished"] == ["plain", "plain_under_cap", "cache"]
    cap = report["cap_bytes"]
    assert report["cap_enforced"] is True and cap == report["weight_bytes"] // 2
    assert report["plain_under_cap"].startswith("placement: out of memory: Emulated device")
    assert report["plain_peak_bytes"] >= 4 * report["weight_bytes"]  # weights, grads, AdamW
    assert report["cache_error"] == "" and report["bit_for_bit"] is True
    assert 0 < report["cache_peak_bytes"] <= cap
    assert report["cache_reserved_peak_bytes"] <= cap  # no cache: reserved is allocated
    assert report["cache_alloc_retries"] == 0 and report["cache_ooms"] == 0
    assert report["cache_setup_bytes"] < cap // 8  # buffers only: no weights brought
    assert report["planned_window_bytes"] < cap


def test_the_close_warnings_name_the_users_line(device: torch.device) -> None:
    """The weights (and AdamW's state) that do not fit back on the device at the close are
    warned of at the user's line, whether it calls ``remove_hooks()`` or leaves a ``with``
    (a fixed stacklevel named the manager's ``__exit__`` there)."""
    gc.collect()
    emulated_device(capacity_bytes=weights_bytes(model()) // 2)
    cached = model()
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS, device=device)
    train(cached, batches(device), manager)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.remove_hooks()
    closing = [w for w in caught if "did not fit on the device" in str(w.message)]
    assert closing and all(w.filename == __file__ for w in closing), closing
    cached = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradient_cache.create_gradient_cache(cached, **OPTIONS, device=device) as manager:
            train(cached, batches(device), manager)
    closing = [w for w in caught if "did not fit on the device" in str(w.message)]
    assert closing and all(w.filename == __file__ for w in closing), closing
