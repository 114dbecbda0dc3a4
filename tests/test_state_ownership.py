"""Whose the optimizer state on the host is (``offload_optimizer_state=True``): each
optimizer's own, even over a shared parameter; sent to the host when a step or a resumed
run begins; handed back to the optimizer, on its device, when the cache closes."""

from __future__ import annotations

import torch
from torch import nn

import gradient_cache

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
