"""``memory_budget`` with the weights on the host (``offload_parameters``): after the
measured steps the budget keeps whole units of weights (blocks, the rest) on the device for
good, bit for bit with plain PyTorch, and the weights' bytes over the link fall by theirs.
The device's statistics are a stand-in (`FakeMemory`: a CPU has none)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_parameters
from test_memory_budget import FakeMemory
from test_parameters_offload import STREAMED, adamw_two_groups, batches, gpt, train

import gradient_cache
from gradient_cache.engine.budget import REST

MIB = 2**20
PEAK = 100 * MIB  # the stand-in's measured peak, everything offloaded
STEPS = 4
MICRO_BATCHES = 2
CLIP = 0.5


def unit_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Each unit's bytes, by the names the budget gives them."""
    rest = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if not name.startswith("blocks.")
    )
    blocks = {
        f"blocks.{i}": sum(p.numel() * p.element_size() for p in block.parameters())
        for i, block in enumerate(model.blocks)
    }
    return {REST: rest, **blocks}


def run(room: int | None):
    """A budgeted run (``room`` bytes above the measured peak; None: no budget), the model,
    the manager and the weights' bytes over the link in the last step."""
    model = gpt()
    optimizer = adamw_two_groups(model)
    options = {} if room is None else {"memory_budget": f"{PEAK + room}B"}
    manager = gradient_cache.create_gradient_cache(
        model, device_memory=FakeMemory(peak=PEAK), **STREAMED, **options
    )
    data = batches(STEPS * MICRO_BATCHES)
    train(model, optimizer, data, manager=manager, micro_batches=MICRO_BATCHES, clip=CLIP)
    return model, manager, manager.summary().parameters_moved_mb * MIB


def plain_model() -> torch.nn.Module:
    model = gpt()
    data = batches(STEPS * MICRO_BATCHES)
    train(model, adamw_two_groups(model), data, micro_batches=MICRO_BATCHES, clip=CLIP)
    return model


def test_a_budget_keeps_the_units_that_fit_bit_for_bit() -> None:
    """Room for two and a half blocks: every block but the last comes first (four copies
    a step each, against three for the rest and the last block, which stay from forward
    through backward), in order, then the rest, which fits the half; those stay
    on the device as plain parameters, the others stream. The weights equal plain
    PyTorch's, and the bytes over the link fall by the kept units' copies."""
    sizes = unit_bytes(gpt())
    room = 2 * sizes["blocks.0"] + sizes["blocks.0"] // 2
    assert sizes[REST] < sizes["blocks.0"] // 2
    model, manager, moved = run(room)
    _, _, moved_all = run(None)
    assert_same_parameters(plain_model(), model)
    decision = manager.optimizer_step.budget.decision
    assert decision.kept_names("weights") == {"blocks.0", "blocks.1", REST}
    assert "kept on the device 3 of 5 units of weights" in manager.summary().memory_budget
    for name, param in model.named_parameters():
        kept = name.startswith(("blocks.0.", "blocks.1.")) or not name.startswith("blocks.")
        assert manager.engine.weights.holds(param.data) is not kept, name
    # Forward's and backward's copies each micro-batch (the rest: one), the step's two.
    blocks = (2 * MICRO_BATCHES + 2) * (sizes["blocks.0"] + sizes["blocks.1"])
    assert moved_all - moved == blocks + (MICRO_BATCHES + 2) * sizes[REST]


def test_the_units_that_stream_twice_a_pass_come_first() -> None:
    """Room for three blocks but not the rest beside them: the rest, first in the model
    and smaller, is passed over for the three blocks that forward and backward each bring
    (the rest comes once a micro-batch), and the last block, which backward keeps from its
    forward, is not kept."""
    sizes = unit_bytes(gpt())
    _, manager, _ = run(3 * sizes["blocks.0"] + sizes[REST] // 2)
    kept = manager.optimizer_step.budget.decision.kept_names("weights")
    assert kept == {"blocks.0", "blocks.1", "blocks.2"}


def test_room_for_every_unit_moves_no_weight_and_closes_as_plain() -> None:
    model, manager, moved = run(10 * sum(unit_bytes(gpt()).values()))
    assert moved == 0
    assert manager.engine.weights.params() == []
    assert_same_parameters(plain_model(), model)
    manager.remove_hooks()
    assert_same_parameters(plain_model(), model)


def test_no_room_keeps_every_unit_streaming() -> None:
    model, manager, moved = run(0)
    _, _, moved_all = run(None)
    assert moved == moved_all
    assert manager.optimizer_step.budget.decision.kept_names("weights") == set()
    assert_same_parameters(plain_model(), model)


def test_a_kept_block_saves_and_loads_as_a_plain_parameter() -> None:
    """After the decision a kept block's state_dict is its device tensors, and a load
    writes them (no master behind them any more)."""
    sizes = unit_bytes(gpt())
    model, manager, _ = run(sizes["blocks.0"] + 1)
    block = model.blocks[0]
    state = {k: v.clone() for k, v in block.state_dict().items()}
    for value in state.values():
        value.add_(1.0)
    block.load_state_dict(state)
    for name, value in block.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert not any(manager.engine.weights.holds(v) for v in block.state_dict().values())


def test_with_compute_dtype_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="memory_budget='80%' cannot be combined with"):
        gradient_cache.EngineConfig(
            offload_parameters=True,
            offload_optimizer_state=True,
            compute_dtype=torch.bfloat16,
            memory_budget="80%",
        )
