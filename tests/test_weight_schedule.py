"""The weights' schedule (`engine.weights.schedule`): the order forward runs the blocks in,
learned from the forwards, is what the one-process stream brings ahead, in forward and in
backward; a model that runs its blocks out of module order streams as one that runs them
in order, bit for bit with plain PyTorch."""

from __future__ import annotations

import torch
from helpers import assert_same_parameters
from test_parameters_offload import STREAMED, adamw_two_groups, step
from torch import nn

import gradient_cache
from gradient_cache.engine.weights.masters import WeightAt
from gradient_cache.engine.weights.schedule import Schedule

WIDTH, BLOCKS, STEPS = 16, 5, 3


class Stack(nn.Module):
    """An embedding, ``BLOCKS`` blocks run in ``order`` (module order by default) and a head."""

    def __init__(self, order: list[int] | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(32, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)
        )
        self.head = nn.Linear(WIDTH, 32)
        self.order = order or list(range(BLOCKS))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)
        for index in self.order:
            hidden = self.blocks[index](hidden)
        return self.head(hidden)


def stack(order: list[int] | None = None) -> Stack:
    torch.manual_seed(0)  # the same weights in every order: block i is block i
    return Stack(order)


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(32, (4, 8), generator=generator) for _ in range(STEPS)]


def train(model: Stack, manager=None) -> tuple[list[list[bool]], list[int]]:
    """``STEPS`` clipped AdamW steps; for each, whether each block's weights were on their
    way (or there) as its forward began (brought ahead), and the weights' device bytes as
    each block's forward ended."""
    optimizer = adamw_two_groups(model)
    ahead: list[list[bool]] = []
    held: list[int] = []
    handles = []
    if manager is not None:
        weights = manager.engine.weights

        def began(module: nn.Module, args: object) -> None:
            first = next(module.parameters())
            ahead[-1].append(weights.where(first) is not WeightAt.HOST)

        # Before the cache's own pre-hooks, which bring a block that is not on its way.
        handles = [block.register_forward_pre_hook(began, prepend=True) for block in model.blocks]
        handles += [
            block.register_forward_hook(lambda *_: held.append(weights.device_bytes()))
            for block in model.blocks
        ]
    for tokens in data():
        ahead.append([])
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        step(model, optimizer, manager, clip=0.5)
    for handle in handles:
        handle.remove()
    return ahead, held


def test_blocks_run_out_of_module_order_are_brought_ahead_as_they_run() -> None:
    """Blocks run in the order 3, 0, 4, 1, 2: the first step learns it (module order stands
    in: some blocks are not brought ahead), and from the second on every block is on its
    way as its forward begins, the device holds what it holds for the same blocks run in
    module order (the rest and two blocks: the last one run is kept for backward, no
    other), and the bytes moved a step are theirs. Bit for bit with plain PyTorch."""
    order = [3, 0, 4, 1, 2]
    plain = stack(order)
    train(plain)
    model = stack(order)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    ahead, held = train(model, manager)
    assert_same_parameters(plain, model)
    assert not all(ahead[0])  # module order stood in for the first forward
    assert all(all(step) for step in ahead[1:])
    moved = manager.summary().parameters_moved_mb
    in_order = stack()
    in_order_manager = gradient_cache.create_gradient_cache(in_order, **STREAMED)
    _, held_in_order = train(in_order, in_order_manager)
    assert moved == in_order_manager.summary().parameters_moved_mb
    assert max(held[BLOCKS:]) == max(held_in_order)


def test_the_schedule_learns_a_forward_that_runs_each_block_once() -> None:
    schedule = Schedule(4)
    assert (schedule.first(), schedule.last(), schedule.after(1), schedule.before(1)) == (
        0,
        3,
        2,
        0,
    )
    for index in (2, 0, 3):  # block 1 skipped by this forward
        schedule.ran(index)
    schedule.learn()
    assert (schedule.first(), schedule.last()) == (2, 3)
    assert (schedule.after(2), schedule.after(0), schedule.after(3)) == (0, 3, None)
    assert (schedule.before(3), schedule.before(2), schedule.after(1)) == (0, None, None)
    for index in (2, 0, 2):  # a block run twice teaches nothing
        schedule.ran(index)
    schedule.learn()
    assert schedule.after(2) == 0 and schedule.last() == 3
