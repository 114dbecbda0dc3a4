"""``memory_budget`` on the emulated device: the budget reads the device's own allocator
(`AcceleratorMemory` through torch.accelerator: the reserved peak, the bytes outside the
allocator, the total), decides at the third step, and trains bit for bit as plain PyTorch.

The device is capped (`emulated_device(capacity_bytes=...)`) so that its total is the
cap and nothing lies outside its allocator; uncapped it reports the host's RAM (see the
last test)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import batches, loss_of, make_model
from test_parameters_offload import step

import gradient_cache
from gradient_cache.engine.budget import AcceleratorMemory, BudgetDecision, device_memory_of
from gradient_cache.testing import emulated_device

MIB = 2**20
CAP = 256 * MIB
OPTIONS = dict(compression_ratio=1, offload_optimizer_state=True, bucket_size_mb=0.004)
HALVES = (slice(0, 2), slice(2, 4))
CLIP = 0.05
STEPS = 4
DECIDING_STEP = 2  # from 0: the budget decides at the third step's restore


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model, optimizer, *, manager=None, before_step=None) -> None:
    """Two micro-batches and a clipped step, ``STEPS`` times; ``before_step(i)`` after the
    ``i``-th step's backward, before its step."""
    device = next(model.parameters()).device
    for index, (tokens, targets) in enumerate(batches(STEPS)):
        tokens, targets = tokens.to(device), targets.to(device)
        for half in HALVES:
            (loss_of(model, tokens[half], targets[half]) / 2).backward()
        if before_step is not None:
            before_step(index)
        if manager is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
        else:
            manager.step(optimizer, max_grad_norm=CLIP)
        optimizer.zero_grad()


def plain_run(device: torch.device) -> torch.nn.Module:
    model = make_model().to(device)
    train(model, sgd(model))
    return model


def assert_same_parameters(plain: torch.nn.Module, cached: torch.nn.Module) -> None:
    for (name, a), b in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name


def budgeted_run(device: torch.device, budget, *, cap_at_decision=None):
    """A budgeted run on the device capped at ``CAP``; ``cap_at_decision(peak)`` gives the
    cap to set just before the deciding step (``peak``: the allocator's reserved peak since
    the manager's creation, which the decision's last sample reads). Returns the model,
    the manager and that peak."""
    emulated_device(capacity_bytes=CAP)
    model = make_model().to(device)
    optimizer = sgd(model)
    manager = gradient_cache.create_gradient_cache(model, memory_budget=budget, **OPTIONS)
    seen = {}

    def before_step(index: int) -> None:
        if index == DECIDING_STEP:
            seen["peak"] = torch.accelerator.max_memory_reserved()
            if cap_at_decision is not None:
                emulated_device(capacity_bytes=cap_at_decision(seen["peak"]))
        assert (manager.optimizer_step.budget.decision is None) == (index <= DECIDING_STEP)

    train(model, optimizer, manager=manager, before_step=before_step)
    return model, manager, seen["peak"]


def kept(manager, kind: str) -> set[str]:
    return manager.optimizer_step.budget.decision.kept_names(kind)


def test_the_capped_device_is_read_through_its_allocator(device: torch.device) -> None:
    emulated_device(capacity_bytes=CAP)
    memory = device_memory_of(device)
    assert isinstance(memory, AcceleratorMemory)
    held = torch.empty(MIB // 4, device=device)  # 1 MiB
    assert memory.total_bytes() == CAP
    assert memory.outside_bytes() == 0  # all the device holds is the allocator's
    assert memory.process_fraction() == 1.0
    memory.reset_peak()
    assert memory.peak_bytes() == torch.accelerator.memory_allocated()
    del held


def test_room_to_spare_keeps_everything_on_the_device(device: torch.device) -> None:
    """``"100%"`` of a 256 MiB device: every gradient and all the state stay from the
    decision on; the decision measured the allocator's peak exactly; plain's bits."""
    plain = plain_run(device)
    model, manager, peak = budgeted_run(device, "100%")
    decision = manager.optimizer_step.budget.decision
    assert decision.measured_peak == peak
    assert decision.budget_bytes == CAP
    names = {name for name, _ in model.named_parameters()}
    assert kept(manager, "gradient") == kept(manager, "optimizer state") == names
    assert not decision.offloaded
    assert_same_parameters(plain, model)
    # A backward now leaves every gradient on the device: nothing cached.
    tokens, targets = (t.to(device) for t in batches(1)[0])
    loss_of(model, tokens, targets).backward()
    manager.compress_and_free_gradients()
    assert not manager.engine.store
    assert all(p.grad is not None and p.grad.device == device for p in model.parameters())


def test_a_tight_budget_offloads_some_gradients_bit_for_bit(device: torch.device) -> None:
    """Half of a device capped, at the decision, at twice (the measured peak plus one and
    a half times the gradients' bytes): the budget's room holds the state (SGD's momentum:
    the gradients' bytes, decided first) and about half the gradients; the rest stay
    offloaded. Plain's bits."""
    plain = plain_run(device)
    gradient_bytes = sum(p.nbytes for p in plain.parameters())
    room = gradient_bytes * 3 // 2
    model, manager, peak = budgeted_run(
        device, "50%", cap_at_decision=lambda peak: 2 * (peak + room)
    )
    decision = manager.optimizer_step.budget.decision
    assert decision.measured_peak == peak
    assert decision.budget_bytes == peak + room
    parameters = len(list(model.parameters()))
    assert len(kept(manager, "optimizer state")) == parameters
    assert 0 < len(kept(manager, "gradient")) < parameters
    assert {c.kind for c in decision.offloaded} == {"gradient"}
    assert decision.kept_bytes <= room
    assert_same_parameters(plain, model)
    # A backward now caches exactly the offloaded gradients.
    tokens, targets = (t.to(device) for t in batches(1)[0])
    loss_of(model, tokens, targets).backward()
    manager.compress_and_free_gradients()
    by_name = dict(model.named_parameters())
    cached = {name for name, p in by_name.items() if p in manager.engine.store}
    assert cached == {c.name for c in decision.offloaded}
    assert all((by_name[n].grad is None) == (n in cached) for n in by_name)


def test_uncapped_the_measured_peak_is_the_allocators(device: torch.device) -> None:
    """Uncapped, the device's total is the host's RAM and nothing in use lies outside its
    allocator (the host's other use of its RAM is not the device's): the budget measures
    the allocator's peak, not the host's (it read 1.6 GiB of host RAM for a 0.1 MiB
    peak when the uncapped device reported the host's free memory)."""
    emulated_device(capacity_bytes=None)
    model = make_model().to(device)
    manager = gradient_cache.create_gradient_cache(model, memory_budget="100%", **OPTIONS)
    seen = {}

    def before_step(index: int) -> None:
        if index == DECIDING_STEP:
            seen["peak"] = torch.accelerator.max_memory_reserved()

    train(model, sgd(model), manager=manager, before_step=before_step)
    measured = manager.optimizer_step.budget.decision.measured_peak
    assert measured == seen["peak"], (
        f"measured {measured / MIB:.1f} MiB, the allocator's peak {seen['peak'] / MIB:.3f} MiB"
    )


def test_with_the_weights_on_the_host_the_budget_keeps_blocks(device: torch.device) -> None:
    """A model set up from the host (``device=``) with its weights streamed: at the
    decision the device is capped at the measured peak plus room for two and a half
    blocks, and ``"100%"`` of it keeps the first two blocks and the rest (which fits the
    half) on the device for good: plain parameters there, the others at rest on the host;
    within the cap, plain's bits."""
    from test_budget_blocks import unit_bytes
    from test_parameters_offload import STREAMED, adamw_two_groups, gpt
    from test_parameters_offload import batches_on as on
    from test_weights_on_device import train as plain_training

    from gradient_cache.engine.budget import REST

    data = on(device, 4)
    plain = gpt().to(device)
    plain_training(plain, data, clip=CLIP)
    sizes = unit_bytes(plain)
    room = 2 * sizes["blocks.1"] + sizes["blocks.1"] // 2
    emulated_device(capacity_bytes=CAP)
    model = gpt()
    optimizer = adamw_two_groups(model)
    manager = gradient_cache.create_gradient_cache(
        model, device=device, memory_budget="100%", **STREAMED
    )
    for index, (tokens, targets) in enumerate(data):
        model(tokens, targets)[1].backward()
        if index == DECIDING_STEP:  # the cap: what the device held so far, and the room
            emulated_device(capacity_bytes=torch.accelerator.max_memory_reserved() + room)
        manager.step(optimizer, max_grad_norm=CLIP)
        optimizer.zero_grad()
    assert kept(manager, "weights") == {"blocks.0", "blocks.1", REST}
    for name, param in model.named_parameters():
        stays = name.startswith(("blocks.0.", "blocks.1.")) or not name.startswith("blocks.")
        assert param.device.type == (device.type if stays else "cpu"), name
    assert_same_parameters(plain, model)


def test_a_close_without_room_leaves_the_whole_model_on_the_host_for_a_new_cache(
    device: torch.device,
) -> None:
    """The budget kept some blocks on the device for good; at the close the streamed
    weights find no room there. The close warns that the weights stay on the host: it
    left the kept blocks on the device (the model split in two, so a forward and the new
    cache the warning advises both failed) and the others as views of the host slabs,
    which a new cache refuses. Now the whole model is on the host in memory of its own,
    a new cache set up from the host takes it, and training goes on as plain PyTorch's."""
    import warnings

    from test_budget_blocks import unit_bytes
    from test_parameters_offload import STREAMED, adamw_two_groups, gpt
    from test_parameters_offload import batches_on as on
    from test_weights_on_device import train as plain_training

    gc.collect()  # an earlier test's garbage freed inside the caps would widen them
    data = on(device, 5)
    plain = gpt().to(device)
    plain_training(plain, data, clip=CLIP)
    block = unit_bytes(plain)["blocks.1"]
    emulated_device(capacity_bytes=CAP)
    model = gpt()
    optimizer = adamw_two_groups(model)
    manager = gradient_cache.create_gradient_cache(
        model, device=device, memory_budget="100%", **STREAMED
    )
    for index, (tokens, targets) in enumerate(data[:4]):
        model(tokens, targets)[1].backward()
        if index == DECIDING_STEP:
            emulated_device(capacity_bytes=torch.accelerator.max_memory_reserved() + 2 * block)
        manager.step(optimizer, max_grad_norm=CLIP)
        optimizer.zero_grad()
    assert any(p.device == device for p in model.parameters())  # kept blocks
    emulated_device(capacity_bytes=torch.accelerator.memory_allocated() + block // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.remove_hooks()
    assert any("did not fit on the device" in str(w.message) for w in caught)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    emulated_device()
    manager = gradient_cache.create_gradient_cache(model, device=device, **STREAMED)
    model(*data[4])[1].backward()
    manager.step(optimizer, max_grad_norm=CLIP)
    assert_same_parameters(plain, model)


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.norm(self.lin(x)))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = torch.nn.Linear(16, 64), torch.nn.Linear(64, 8)
        self.blocks = torch.nn.ModuleList(Residual() for _ in range(8))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack_run(device, steps: int = 5, **options) -> tuple[torch.nn.Module, list[int]]:
    """AdamW steps of `Stack`, weights and state on the host, buckets smaller than a block;
    each step's allocated peak."""
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = None
    if device.type != "cpu":
        manager = gradient_cache.create_gradient_cache(
            model,
            compression_ratio=1,
            offload_optimizer_state=True,
            offload_parameters=True,
            device=device,
            bucket_size_mb=0.02,
            **options,
        )
    generator, peaks = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        torch.accelerator.reset_peak_memory_stats()
        x, y = torch.randn(4, 16, generator=generator), torch.randn(4, 8, generator=generator)
        ((model(x.to(device)) - y.to(device)) ** 2).mean().backward()
        manager.step(optimizer) if manager else optimizer.step()
        optimizer.zero_grad()
        peaks.append(torch.accelerator.max_memory_allocated())
    return model, peaks


def test_a_budget_with_a_blocks_room_above_the_steady_peak_keeps_it_within_the_cap(
    device,
) -> None:
    """The first step creates AdamW's state where it steps; later steps also bring the next
    bucket's state ahead and peak higher. A budget decided on the first step's peak kept
    blocks into that difference and ran out of memory at the next step; measured through the
    second, it keeps what the steady peak leaves room for, bit for bit with plain."""
    gc.collect()
    before = torch.accelerator.memory_allocated()  # what earlier tests left
    offloaded = stack_run(device)[1]
    gc.collect()  # that run's model and cache, whose rest is on the device
    assert torch.accelerator.memory_allocated() == before
    assert offloaded[0] < offloaded[1] == max(offloaded)  # the first step's is lower
    block = sum(p.numel() * 4 for p in Residual().parameters())
    emulated_device(capacity_bytes=max(offloaded) + block)  # peaks count what was there
    budgeted, peaks = stack_run(device, memory_budget="100%")
    assert max(peaks) <= max(offloaded) + block
    plain, _ = stack_run(torch.device("cpu"))
    assert_same_parameters(plain, budgeted)


@pytest.mark.parametrize("state_loaded", [True, False], ids=["state loaded", "new optimizer"])
def test_a_resumed_run_measures_two_steps_of_its_own_and_stays_within_the_budget(
    device: torch.device, state_loaded: bool
) -> None:
    """Resumed from a checkpoint taken after the decision (its step count loaded), the
    manager measures two steps of its own before deciding, as a fresh one does. It decided
    at its first restore, from a peak without an optimizer step (AdamW's state comes to
    the device a bucket at a time), kept more on the device and went over the budget (state
    loaded: 0.62 MiB for 0.54). With a new optimizer the first of those steps creates the state, a
    lower peak than the next: one step measured went over too (0.60 MiB). Now the
    allocator's peak stays within the budget, a loaded state's run measures the
    uninterrupted run's peak, and each run ends with plain PyTorch's bits."""
    import io

    gc.collect()  # an earlier test's garbage freed inside the measure would skew it
    emulated_device(capacity_bytes=CAP)
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 16, generator=generator), torch.randn(8, 8, generator=generator))
        for _ in range(8)
    ]
    data = [(x.to(device), y.to(device)) for x, y in data]
    cut = 4  # steps before the checkpoint: the uninterrupted run decided at the third

    def build(budget: str):
        model = Stack().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        manager = gradient_cache.create_gradient_cache(
            model, memory_budget=budget, **(OPTIONS | {"bucket_size_mb": 0.02})
        )
        return model, optimizer, manager

    def run(model, optimizer, manager, steps) -> None:
        for x, y in steps:
            for half in (slice(0, 4), slice(4, 8)):
                (((model(x[half]) - y[half]) ** 2).mean() / 2).backward()
            step(model, optimizer, manager, clip=CLIP)

    plain = Stack().to(device)
    run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), None, data)
    # The steady peak with everything offloaded; above it, room for a little.
    model, optimizer, manager = build("100%")
    run(model, optimizer, manager, data[: DECIDING_STEP + 1])
    steady = manager.optimizer_step.budget.decision.measured_peak
    manager.remove_hooks()
    del model, optimizer, manager
    gc.collect()
    budget = steady + sum(p.nbytes for p in plain.parameters()) // 4

    def the_rest(model, optimizer, manager) -> tuple[int, BudgetDecision]:
        """The last steps' allocator peak, and the decision."""
        torch.accelerator.reset_peak_memory_stats()
        run(model, optimizer, manager, data[cut:])
        return torch.accelerator.max_memory_reserved(), manager.optimizer_step.budget.decision

    model, optimizer, manager = build(f"{budget}B")
    run(model, optimizer, manager, data[:cut])
    buffer = io.BytesIO()
    torch.save((model.state_dict(), optimizer.state_dict(), manager.state_dict()), buffer)
    peak, uninterrupted = the_rest(model, optimizer, manager)
    assert_same_parameters(plain, model)
    assert uninterrupted.kept and uninterrupted.offloaded  # a budget that binds
    assert peak <= budget
    manager.remove_hooks()
    del model, optimizer, manager
    gc.collect()

    buffer.seek(0)
    model_state, optimizer_state, cache_state = torch.load(buffer, map_location="cpu")
    model, optimizer, manager = build(f"{budget}B")
    with torch.no_grad():  # a start of its own, which the checkpoint overwrites
        for param in model.parameters():
            param.normal_()
    manager.offload_state_of(optimizer)
    model.load_state_dict(model_state)
    if state_loaded:
        optimizer.load_state_dict(optimizer_state)
    manager.load_state_dict(cache_state)
    peak, resumed = the_rest(model, optimizer, manager)
    assert peak <= budget, f"{peak / MIB:.3f} MiB for {budget / MIB:.3f}"
    if state_loaded:  # the uninterrupted run's measure, and its bits
        assert resumed.measured_peak == uninterrupted.measured_peak
    else:  # plain's, resumed with a new optimizer too
        plain = Stack().to(device)
        plain.load_state_dict(model_state)
        run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), None, data[cut:])
    assert_same_parameters(plain, model)


def test_the_clips_norms_are_summed_grouped_by_the_gradients_device(device: torch.device) -> None:
    """``clip_grad_norm_(model.parameters())`` groups the gradients by their device and dtype;
    a weight at rest is a host parameter whose gradient (and its norm) is on the device.
    Grouped by the parameters, a budget's resident weights (the rest, the first blocks)
    went before the blocks at rest, an order plain never sums in (the budget test's sums
    happened to agree, and a mutant survived)."""
    from gradient_cache.engine.norms import clip_grad_norm_order

    at_rest, resident, also_at_rest = (
        torch.nn.Parameter(torch.zeros(2, device=on)) for on in ("cpu", device, "cpu")
    )
    params = [at_rest, resident, also_at_rest]
    norms = {param: torch.tensor(float(i), device=device) for i, param in enumerate(params)}
    order = {param: i for i, param in enumerate(params)}
    assert [param for param, _ in clip_grad_norm_order(norms, order)] == params
