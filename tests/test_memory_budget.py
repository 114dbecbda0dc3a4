"""``memory_budget``: the first step measured with everything offloaded (a stand-in for the
CUDA allocator's statistics), then kept on the device what fits, bit for bit with plain."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import (
    FailsOnce,
    assert_same_parameters,
    batches,
    loss_of,
    make_model,
    save_and_load,
)

import gradient_cache
from gradient_cache.demo.accounting import device_memory_meter
from gradient_cache.engine.budget import (
    AcceleratorMemory,
    MemoryBudget,
    MemoryBudgetError,
    device_memory_of,
)

MIB = 2**20
OPTIONS = dict(bucket_size_mb=0.004, offload_optimizer_state=True)


@dataclass
class FakeMemory:
    """The device's statistics as a test sets them: the allocator's reserved peak, the
    bytes outside the allocator, the total and a per-process fraction."""

    peak: int
    total: int = 80 * 2**30
    outside: int = 0
    fraction: float = 1.0
    resets: int = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_bytes(self) -> int:
        return self.peak

    def outside_bytes(self) -> int:
        return self.outside

    def total_bytes(self) -> int:
        return self.total

    def process_fraction(self) -> float:
        return self.fraction


def gradient_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in make_model().parameters())


def train(model, optimizer, manager=None, steps: int = 4) -> None:
    """Two micro-batches, a clipped step, each step."""
    for tokens, targets in batches(steps):
        for half in (slice(0, 2), slice(2, 4)):
            (loss_of(model, tokens[half], targets[half]) / 2).backward()
        if manager is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
        else:
            manager.step(optimizer, max_grad_norm=0.05)


def budgeted_run(room: int, *, ratio: float = 1, steps: int = 4):
    """A run whose budget leaves ``room`` bytes above a measured 100 MiB first step."""
    memory = FakeMemory(peak=100 * MIB)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=ratio,
        memory_budget=f"{100 * MIB + room}B",
        device_memory=memory,
        **OPTIONS,
    )
    train(model, optimizer, manager, steps)
    return model, manager, memory


def test_room_to_spare_keeps_everything_on_the_device() -> None:
    """After the first step nothing crosses the link: no gradient cached, no state moved."""
    plain = make_model()
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))
    model, manager, memory = budgeted_run(room=10 * gradient_bytes())
    assert_same_parameters(plain, model)
    summary = manager.summary()
    assert summary.optimizer_state_moved_mb == 0.0
    assert memory.resets == 1
    loss_of(model, *batches(1)[0]).backward()
    manager.compress_and_free_gradients()
    assert not manager.engine.store  # every gradient stayed on the device
    assert all(p.grad is not None for p in model.parameters())
    assert "kept on the device" in summary.memory_budget
    assert "0.0 MiB cross the link a step" in summary.memory_budget


def kept(manager, kind: str) -> int:
    decision = manager.optimizer_step.budget.decision
    return len(decision.kept_names(kind))


def test_tighter_takes_compressed_gradients_off_first_then_the_state() -> None:
    """int8 gradients free 2 device bytes per link byte, the state (SGD's momentum) 0.5:
    a budget with room for the state only keeps the state; less room keeps less state (and
    what small gradient still fits)."""
    parameters = len(list(make_model().parameters()))
    state = gradient_bytes()  # the momentum buffers: the parameters' bytes
    _, manager, _ = budgeted_run(room=state, ratio=4)
    assert kept(manager, "optimizer state") == parameters
    assert kept(manager, "gradient") == 0
    _, manager, _ = budgeted_run(room=state // 2, ratio=4)
    assert 0 < kept(manager, "optimizer state") < parameters
    assert manager.optimizer_step.budget.decision.kept_bytes <= state // 2
    _, manager, _ = budgeted_run(room=0, ratio=4)
    assert kept(manager, "optimizer state") == kept(manager, "gradient") == 0
    assert manager.summary().optimizer_state_moved_mb > 0


def test_a_decision_midway_trains_bit_for_bit_as_plain() -> None:
    """Part of the state and of the (lossless) gradients kept on the device from step 2."""
    plain = make_model()
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), steps=5)
    model, manager, _ = budgeted_run(room=gradient_bytes() * 3 // 2, steps=5)
    assert kept(manager, "optimizer state") and kept(manager, "gradient")
    assert manager.optimizer_step.budget.decision.offloaded  # and some left the device
    assert_same_parameters(plain, model)


def test_a_budget_the_offloaded_step_already_passes_raises_with_the_numbers() -> None:
    """And names the fix where an optimizer brought its state on the device to the cache
    (a probe: a resumed optimizer's state measured in the first steps, blamed on the
    budget)."""
    with pytest.raises(
        MemoryBudgetError, match=r"is 99\.0 MiB, and the first steps peaked at 100\.0"
    ) as raised:
        budgeted_run(room=-MIB)
    assert "call hook_manager.offload_state_of(optimizer) right after creating it" in str(
        raised.value
    )


def test_on_a_cpu_there_is_nothing_to_budget() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, memory_budget="80%", **OPTIONS)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), manager, steps=2)
    summary = manager.summary()
    assert "a cpu device keeps no memory statistics" in summary.memory_budget
    assert summary.optimizer_state_moved_mb > 0  # everything still offloaded


@pytest.mark.parametrize(
    "text,expected",
    [
        ("80%", (0.8, None)),
        (0.5, (0.5, None)),
        ("20GiB", (None, 20 * 2**30)),
        ("512 MiB", (None, 512 * MIB)),
        ("16GB", (None, 16 * 10**9)),
        (1, (1.0, None)),
    ],
)
def test_budgets_parse(text, expected) -> None:
    budget = MemoryBudget.parse(text)
    assert (budget.fraction, budget.nbytes) == expected


@pytest.mark.parametrize("value", ["120%", "0%", -0.5, 0, 1.5, "abc", "20 parsecs", "-3GiB"])
def test_nonsense_budgets_are_refused_naming_the_option(value) -> None:
    with pytest.raises(ValueError, match="Invalid memory_budget"):
        gradient_cache.EngineConfig(memory_budget=value)
    with pytest.raises(TypeError, match="memory_budget must be a string or a number"):
        gradient_cache.EngineConfig(memory_budget=True)


@pytest.mark.parametrize("text,fix", [("80", "'80%' or '80GiB'"), ("1.5", "'1.5%' or '1.5GiB'")])
def test_a_number_without_a_unit_is_a_share_in_a_string_too(text: str, fix: str) -> None:
    """Not bytes: "80" is refused as 80 is, naming the spellings that mean something."""
    with pytest.raises(ValueError, match=f"Invalid memory_budget: '{text}'.*{fix}"):
        MemoryBudget.parse(text)
    with pytest.raises(ValueError, match=f"Invalid memory_budget: {text}.*{fix}"):
        MemoryBudget.parse(float(text))
    assert MemoryBudget.parse("0.8").fraction == MemoryBudget.parse(0.8).fraction == 0.8


@pytest.mark.parametrize("peak", [float("nan"), -MIB], ids=["nan", "negative"])
def test_a_reader_giving_a_nonsense_peak_is_named(peak: float) -> None:
    """A NaN peak would offload everything and a negative one keep more than fits, silently."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = gradient_cache.create_gradient_cache(
        model, memory_budget="1GiB", device_memory=FakeMemory(peak=peak), **OPTIONS
    )
    with pytest.raises(RuntimeError, match=r"reader FakeMemory\.peak_bytes\(\) returned"):
        train(model, optimizer, manager, steps=2)


def test_the_measurement_holds_the_first_optimizer_step_on_every_path() -> None:
    """apply_gradients() restores before the optimizer creates its state: the budget decides
    only at the third step's restore, once the state exists and a step past its creation
    ran."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    states_when_read = []

    class Watching(FakeMemory):
        def peak_bytes(self) -> int:
            states_when_read.append(len(optimizer.state))
            return self.peak

    manager = gradient_cache.create_gradient_cache(
        model, memory_budget="1TiB", device_memory=Watching(peak=MIB), bucket_size_mb=0.004
    )
    for tokens, targets in batches(3):
        loss_of(model, tokens, targets).backward()
        manager.apply_gradients()
        optimizer.step()
        optimizer.zero_grad()
    # Sampled at each restore and its end; the samples from the second step's restore on
    # hold the first optimizer step's state. None after the decision.
    n = len(list(model.parameters()))
    assert states_when_read == [0, 0, n, n, n]


def test_a_budget_covers_one_model_per_decorated_function() -> None:
    @gradient_cache.optimize(memory_budget="80%")
    def two_models() -> None:
        for model in (make_model(), make_model(seed=1)):
            loss_of(model, *batches(1)[0]).backward()

    with pytest.raises(ValueError, match="covers one model per decorated function"):
        two_models()


def budgeted(memory: FakeMemory, room: int, **options):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=1,
        memory_budget=f"{memory.peak + room}B",
        device_memory=memory,
        **(OPTIONS | options),
    )
    return model, optimizer, manager


def test_a_checkpoint_mid_accumulation_carries_the_gradients_the_budget_kept() -> None:
    """Saved between two micro-batches of the fourth step (the budget kept some gradients
    on the device since the third): the resumed run, in a fresh model, optimizer and
    manager, ends bit for bit as plain PyTorch's uninterrupted one."""
    steps = 5
    plain = make_model()
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), steps=steps)
    room = gradient_bytes() * 3 // 2
    model, optimizer, manager = budgeted(FakeMemory(peak=100 * MIB), room)
    data = batches(steps)
    train(model, optimizer, manager, steps=3)
    assert kept(manager, "gradient")  # decided at the third step: some gradients kept
    tokens, targets = data[3]
    (loss_of(model, tokens[:2], targets[:2]) / 2).backward()
    saved = save_and_load(model, manager, optimizer)
    manager.remove_hooks()

    model, optimizer, manager = budgeted(FakeMemory(peak=100 * MIB), room)
    model.load_state_dict(saved["model"])
    manager.offload_state_of(optimizer)
    optimizer.load_state_dict(saved["optimizer"])
    manager.load_state_dict(saved["cache"])
    (loss_of(model, tokens[2:], targets[2:]) / 2).backward()
    manager.step(optimizer, max_grad_norm=0.05)
    tokens, targets = data[4]
    for half in (slice(0, 2), slice(2, 4)):
        (loss_of(model, tokens[half], targets[half]) / 2).backward()
    manager.step(optimizer, max_grad_norm=0.05)
    assert_same_parameters(plain, model)
    assert saved["cache"]["kept_gradients"]  # they came through the checkpoint


def test_a_checkpoint_after_a_restore_carries_no_kept_gradient() -> None:
    """apply_gradients() then optimizer.step(), saved before zero_grad(): the kept
    gradients left in `.grad` are the user's, stepped, as the restored ones are."""
    memory = FakeMemory(peak=100 * MIB)
    model, optimizer, manager = budgeted(
        memory, 10 * gradient_bytes(), offload_optimizer_state=False
    )
    for tokens, targets in batches(4):
        loss_of(model, tokens, targets).backward()
        manager.step(optimizer) if manager.engine.steps < 3 else manager.apply_gradients()
    assert all(p.grad is not None for p in model.parameters())
    assert manager.state_dict()["kept_gradients"] == {}


def kept_everything(**options):
    """A budgeted SGD run past its decision (every gradient and state kept on the device),
    then one more backward of two micro-batches: the next step's gradients all in `.grad`."""
    memory = FakeMemory(peak=100 * MIB)
    model, optimizer, manager = budgeted(memory, 10 * gradient_bytes(), **options)
    train(model, optimizer, manager, steps=3)
    for tokens, targets in batches(4)[3:]:
        for half in (slice(0, 2), slice(2, 4)):
            (loss_of(model, tokens[half], targets[half]) / 2).backward()
    assert kept(manager, "gradient") == len(list(model.parameters()))
    return model, optimizer, manager


def test_a_clipped_step_scales_the_kept_gradients_in_place() -> None:
    """The kept gradients are clipped in place, as clip_grads_with_norm_ clips: the step
    holds one copy of them, where a copy clipped out of place held two (CPU accounting)."""
    model, optimizer, manager = kept_everything()
    meter = device_memory_meter(model, optimizer=optimizer, cache=manager)
    with meter:
        before = meter.reading()
        with meter.phase("step"):
            manager.step(optimizer, max_grad_norm=0.05)
    extra = meter.peaks["step"].peak.device_bytes - before.device_bytes
    assert extra < gradient_bytes() // 2  # a second copy would add gradient_bytes()


@pytest.mark.parametrize("nth", [1, 2], ids=["first chunk", "second chunk"])
def test_a_failed_step_of_the_kept_gradients_retried_gives_plain_bits(nth: int) -> None:
    """The kept gradients step a bucket at a time; a step that raises in the ``nth`` of
    them is retried: none is clipped twice (they were clipped in place) nor stepped twice."""
    plain = make_model()
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), steps=4)
    model, optimizer, manager = kept_everything()
    failure = FailsOnce(optimizer)
    failure.arm(nth)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer, max_grad_norm=0.05)
    manager.step(optimizer, max_grad_norm=0.05)
    assert_same_parameters(plain, model)


class StateWatch(torch.optim.SGD):
    """SGD that notes, at each step, which parameters' momentum is on the device (not the
    cache's host copy) and which have a gradient."""

    def __init__(self, params, manager_of) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.manager_of = manager_of
        self.seen: list[tuple[set, set]] = []

    def step(self, closure=None):
        host = self.manager_of().engine.optimizer_state.copies_of(self)
        on_device = {
            p
            for p, state in self.state.items()
            if "momentum_buffer" in state
            and host.get(p, {}).get("momentum_buffer") is not state["momentum_buffer"]
        }
        self.seen.append((on_device, {p for p in self.state if p.grad is not None}))
        return super().step(closure)


def test_device_gradients_step_with_their_offloaded_state_a_bucket_at_a_time() -> None:
    """Gradients that stay on the device (excluded layers, kept by a budget) step a
    bucket's worth at a time, each with only its own state brought to the device."""
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, exclude_layers=["mlp", "norm"], **OPTIONS
    )
    optimizer = StateWatch(model.parameters(), lambda: manager)
    train(model, optimizer, manager, steps=1)
    optimizer.seen.clear()
    train(model, optimizer, manager, steps=1)  # the state exists: it is brought
    excluded = {p for n, p in model.named_parameters() if "mlp" in n or "norm" in n}
    for on_device, with_grad in optimizer.seen:
        assert on_device <= with_grad  # no state on the device but the step's own
    assert sum(bool(with_grad & excluded) for _, with_grad in optimizer.seen) > 1


def test_a_kept_gradient_counts_the_offloaded_state_its_step_brings() -> None:
    """A gradient kept on the device while its state is offloaded brings that state to
    the device at its step: the decision counts both."""
    from gradient_cache.engine.budget import Candidate, decide

    gradient = Candidate("w", "gradient", device_bytes=100, link_bytes=200)
    state = Candidate("w", "optimizer state", device_bytes=200, link_bytes=400)
    other = Candidate("v", "optimizer state", device_bytes=250, link_bytes=500)
    decision = decide([other, gradient, state], measured_peak=0, budget_bytes=350, budget="b")
    # v's state fits (250); w's state does not (200 > 100 left); w's gradient alone would
    # (100), but its step would bring w's state too (300).
    assert decision.kept == (other,)
    decision = decide([gradient, state], measured_peak=0, budget_bytes=300, budget="b")
    assert set(decision.kept) == {gradient, state}


def decided(memory: FakeMemory, budget: str, *, steps: int = 3, **options):
    """A budgeted run of ``steps`` steps; its manager's budget watch."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = gradient_cache.create_gradient_cache(
        model, memory_budget=budget, device_memory=memory, **(OPTIONS | options)
    )
    train(model, optimizer, manager, steps)
    return manager.optimizer_step.budget


def test_the_measure_counts_the_allocators_reserve_and_what_lies_outside_it() -> None:
    """The reserved peak (cache and fragmentation) plus the bytes outside the allocator
    (CUDA context, NCCL): a budget between the reserved peak and their sum is passed."""
    watch = decided(FakeMemory(peak=100 * MIB, outside=20 * MIB), "1TiB")
    assert watch.decision.measured_peak == 120 * MIB
    with pytest.raises(MemoryBudgetError, match=r"peaked at 120\.0 MiB"):
        decided(FakeMemory(peak=100 * MIB, outside=20 * MIB), "110MiB")


def test_a_per_process_fraction_lowers_the_budget() -> None:
    """set_per_process_memory_fraction(0.5): "80%" is 80% of half the device, and an
    amount is cut to that half."""
    total = 1000 * MIB
    watch = decided(FakeMemory(peak=100 * MIB, total=total, fraction=0.5), "80%")
    assert watch.decision.budget_bytes == int(total * 0.5 * 0.8)
    watch = decided(FakeMemory(peak=100 * MIB, total=total, fraction=0.5), "900MiB")
    assert watch.decision.budget_bytes == total // 2


def test_an_outside_reset_between_samples_does_not_lower_the_measure() -> None:
    """The first step peaks at 100 MiB; then a logger resets the peak statistics, and the
    second step peaks at 10 MiB: the decision, at the third, counts 100."""
    memory = FakeMemory(peak=100 * MIB)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = gradient_cache.create_gradient_cache(
        model, memory_budget="1TiB", device_memory=memory, **OPTIONS
    )
    train(model, optimizer, manager, steps=1)
    memory.peak = 10 * MIB  # torch.cuda.reset_peak_memory_stats() from outside
    train(model, optimizer, manager, steps=2)
    assert manager.optimizer_step.budget.decision.measured_peak == 100 * MIB


@pytest.mark.parametrize(("device", "fraction"), [("cuda", 0.5), ("privateuseone", 1.0)])
def test_the_accelerator_reader_takes_the_reserve_the_outside_bytes_and_the_cap(
    monkeypatch, device: str, fraction: float
) -> None:
    """`AcceleratorMemory` reads the allocator's reserved peak, the device's used bytes
    beyond what the allocator reserved, its total (stand-ins for torch.accelerator), and
    the per-process fraction where the device's module keeps one (torch.cuda's; none for
    a PrivateUse1 device without a module)."""
    monkeypatch.setattr(torch.accelerator, "max_memory_reserved", lambda device: 300)
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda device: 250)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device: (600, 1000))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5)
    memory = AcceleratorMemory(torch.device(device, 0))
    assert memory.peak_bytes() == 300
    assert memory.outside_bytes() == 1000 - 600 - 250  # the context, NCCL, others
    assert memory.total_bytes() == 1000
    assert memory.process_fraction() == fraction


def test_only_an_accelerator_that_answers_memory_queries_is_budgeted(monkeypatch) -> None:
    """A CPU keeps no statistics; an accelerator whose allocator answers no
    `torch.accelerator` memory query (a Python-registered PrivateUse1 backend's, or any
    under torch 2.6, which has no such query) neither."""
    assert device_memory_of(torch.device("cpu")) is None
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *_: torch.device("xpu"))
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device: (600, 1000))
    assert isinstance(device_memory_of(torch.device("xpu", 0)), AcceleratorMemory)

    def no_device_allocator(device: object) -> tuple[int, int]:
        raise RuntimeError("Allocator for xpu is not a DeviceAllocator.")

    monkeypatch.setattr(torch.accelerator, "get_memory_info", no_device_allocator)
    assert device_memory_of(torch.device("xpu", 0)) is None
    monkeypatch.delattr(torch.accelerator, "get_memory_info")  # torch 2.6 has none
    assert device_memory_of(torch.device("xpu", 0)) is None


def test_the_decision_waits_for_the_second_step_after_the_warm_up() -> None:
    """warmup_steps=2 (lossless steps): the steps measured run through the fourth, the
    second with the steady codecs; the decision comes at the fifth's restore."""
    memory = FakeMemory(peak=MIB)
    assert decided(memory, "1TiB", steps=4, warmup_steps=2).decision is None
    assert decided(memory, "1TiB", steps=5, warmup_steps=2).decision is not None


def test_apply_gradients_after_a_failed_step_that_clipped_kept_gradients_refuses() -> None:
    """The failed step clipped the kept gradients in place and stepped some: restoring the
    rest whole for optimizer.step() would clip or step those twice. The error names the fix."""
    _, optimizer, manager = kept_everything(offload_optimizer_state=False)
    failure = FailsOnce(optimizer)
    failure.arm(2)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer, max_grad_norm=0.05)
    with pytest.raises(RuntimeError, match=r"Call step\(optimizer\) again"):
        manager.apply_gradients()
