"""The emulated device (`gradient_cache.testing.emulated_device`): an accelerator that lives
in host RAM, with its own device type, memory cap, streams, events, pinned memory, copies
that land only when waited for, and autocast, so device code paths run in CI on the CPU.
Its clear errors, which need a process without it, are tests/test_emulated_device_errors.py.
"""

from __future__ import annotations

import copy
import io
import os
import threading

import pytest
import torch
from torch import nn

from gradient_cache.testing import emulated_device
from gradient_cache.testing.emulated import pending_copies

MIB = 1 << 20
OLD = torch.zeros(4)
NEW = torch.arange(4.0)
LOWER = {
    "matmul": lambda a, b: a @ b,
    "bmm": lambda a, b: torch.bmm(a[None], b[None]),
    "baddbmm": lambda a, b: torch.baddbmm(a[None], a[None], b[None]),
    "addmm": lambda a, b: torch.addmm(a, a, b),
    "conv2d": lambda a, b: torch.conv2d(a[None, None], b[None, None]),
}
FP32 = {
    "softmax": lambda a: torch.softmax(a, -1),
    "log_softmax": lambda a: torch.log_softmax(a, -1),
    "layer_norm": lambda a: nn.functional.layer_norm(a, (4,)),
    "cross_entropy": lambda a: nn.functional.cross_entropy(
        a, torch.tensor([0, 1, 2, 3], device=a.device)
    ),
    "mse_loss": lambda a: nn.functional.mse_loss(a, a.detach() + 1),
    "sum": lambda a: a.sum(),
}


def test_memory_is_counted_capped_and_reported(device: torch.device) -> None:
    emulated_device(capacity_bytes=4 * MIB)
    start = torch.accelerator.memory_allocated()
    torch.accelerator.reset_peak_memory_stats()
    a = torch.empty(MIB // 4, device=device)  # 1 MiB
    assert torch.accelerator.memory_allocated() == start + MIB
    b = torch.empty(MIB // 4, device=device)
    del b
    assert torch.accelerator.memory_allocated() == start + MIB
    assert torch.accelerator.max_memory_allocated() == start + 2 * MIB
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == start + MIB
    assert stats["allocated_bytes.all.peak"] == start + 2 * MIB
    assert stats["num_alloc_retries"] == 0
    assert torch.accelerator.get_memory_info() == (4 * MIB - start - MIB, 4 * MIB)
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == start + MIB

    with pytest.raises(torch.OutOfMemoryError) as caught:
        torch.empty(MIB, device=device)  # 4 MiB on top of the 1 MiB held
    message = str(caught.value)
    assert f"allocate {4 * MIB} bytes" in message
    assert f"{start + MIB} bytes allocated" in message
    assert f"capacity of {4 * MIB} bytes" in message
    del a


def test_an_uncapped_device_reports_the_hosts_ram(device: torch.device) -> None:
    emulated_device(capacity_bytes=None)
    free, total = torch.accelerator.get_memory_info()
    assert total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert free == total - torch.accelerator.memory_allocated()  # nothing outside it
    torch.empty(64 * MIB, device=device)  # no cap: allocates


def test_the_capacity_is_checked(device: torch.device) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="capacity_bytes"):
            emulated_device(capacity_bytes=bad)  # type: ignore[arg-type]


def test_ops_mixing_the_device_and_the_cpu_raise_as_on_cuda(device: torch.device) -> None:
    x = torch.ones(3, 3, device=device)
    for op in (lambda: x + torch.ones(3, 3), lambda: torch.mm(x, torch.ones(3, 3))):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            op()
    # As on CUDA: 0-dim CPU tensors are scalars, and CPU tensors may index.
    assert torch.equal((x * torch.tensor(2.0)).cpu(), torch.full((3, 3), 2.0))
    assert x[torch.tensor([0, 2])].device == device


def test_a_gradient_from_another_device_is_refused(device: torch.device) -> None:
    w = torch.ones(3, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="device"):
        w.grad = torch.zeros(3)


def test_data_moves_across_devices_and_the_accumulator_resets_as_on_cuda(
    device: torch.device,
) -> None:
    """`p.data = cpu_tensor` works (stock 2.13 refuses it for PrivateUse1), and a leaf whose
    data left and came back between two uses in one graph is accumulated twice, by two
    accumulators, as on CUDA."""
    w = torch.ones(3, device=device, requires_grad=True)
    calls: list[int] = []

    def hook(p: torch.Tensor) -> None:
        calls.append(threading.get_ident())

    w.register_post_accumulate_grad_hook(hook)
    first = (w * 2).sum()
    w.data = w.data.cpu()
    assert w.device.type == "cpu"
    w.data = w.data.to(device)
    second = (w * 3).sum()
    (first + second).backward()
    assert len(calls) == 2
    assert w.grad is not None and torch.equal(w.grad.cpu(), torch.full((3,), 5.0))


def test_backward_runs_on_the_devices_own_autograd_thread(device: torch.device) -> None:
    w = torch.ones(3, device=device, requires_grad=True)
    threads: list[int] = []
    w.register_post_accumulate_grad_hook(lambda p: threads.append(threading.get_ident()))
    (w * 2).sum().backward()
    assert threads and threads[0] != threading.get_ident()


def test_a_storage_freed_and_refilled_is_seen_by_its_views(device: torch.device) -> None:
    """FSDP2's free and refill: resize_(0), resize_(n), a copy in."""
    t = torch.arange(6.0, device=device)
    view = t.view(2, 3)
    start = torch.accelerator.memory_allocated()
    t.untyped_storage().resize_(0)
    assert t.untyped_storage().nbytes() == 0
    assert torch.accelerator.memory_allocated() == start - 24
    with pytest.raises(RuntimeError, match="freed"):
        view + 1  # a read of freed memory raises (a GPU would read garbage or fault)
    t.untyped_storage().resize_(24)
    t.copy_(torch.arange(6.0) + 10)
    assert torch.equal(view.cpu(), (torch.arange(6.0) + 10).view(2, 3))


def test_streams_and_events(device: torch.device) -> None:
    assert torch.accelerator.current_accelerator() == torch.device("emu")
    assert torch.accelerator.device_count() == 1
    default = torch.accelerator.current_stream()
    assert default.stream_id == 0
    a, b = torch.Stream(device="emu"), torch.Stream(device="emu")
    assert len({default.stream_id, a.stream_id, b.stream_id}) == 3
    with a:
        assert torch.accelerator.current_stream() == a
    assert torch.accelerator.current_stream() == default
    torch.accelerator.set_stream(b)
    assert torch.accelerator.current_stream() == b
    torch.accelerator.set_stream(default)
    event = torch.Event(device="emu")
    event.record(a)
    assert event.query()
    event.synchronize()
    a.wait_event(event)
    b.wait_stream(a)
    assert a.query()
    a.synchronize()
    torch.accelerator.synchronize()


def test_current_streams_are_per_thread(device: torch.device) -> None:
    side = torch.Stream(device="emu")
    seen: list[int] = []
    with side:
        worker = threading.Thread(
            target=lambda: seen.append(torch.accelerator.current_stream().stream_id)
        )
        worker.start()
        worker.join()
    assert seen == [0]


def test_pinned_host_memory(device: torch.device) -> None:
    assert torch.empty(8, pin_memory=True).is_pinned()
    pinned = torch.arange(8.0).pin_memory()
    assert pinned.is_pinned() and pinned[2:].is_pinned()
    assert not torch.arange(8.0).is_pinned()


def upload(device: torch.device, stream: torch.Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """A non_blocking host-to-device copy of [0, 1, 2, 3] into zeros, queued on `stream`."""
    source = torch.arange(4.0).pin_memory()
    destination = torch.zeros(4, device=device)
    with stream:
        destination.copy_(source, non_blocking=True)
    return source, destination


def test_a_copy_lands_before_a_later_op_on_its_stream(device: torch.device) -> None:
    side = torch.Stream(device="emu")
    _, destination = upload(device, side)
    assert pending_copies() == 1
    assert torch.equal(destination.cpu(), OLD)  # read on the default stream: not ordered
    with side:
        doubled = destination * 2  # same stream: ordered after the copy
    assert torch.equal(doubled.cpu(), NEW * 2)
    assert pending_copies() == 0


@pytest.mark.parametrize("wait", ["wait_stream", "wait_event"])
def test_another_stream_sees_the_copy_once_it_waits(device: torch.device, wait: str) -> None:
    side = torch.Stream(device="emu")
    early = side.record_event()  # before the copy: waiting on it orders nothing
    _, destination = upload(device, side)
    reader = torch.accelerator.current_stream()
    reader.wait_event(early)
    assert torch.equal(destination.cpu(), OLD)
    if wait == "wait_stream":
        reader.wait_stream(side)
    else:
        reader.wait_event(side.record_event())
    assert torch.equal(destination.cpu(), NEW)


def test_a_missing_wait_leaves_the_reader_with_the_old_bytes(device: torch.device) -> None:
    """The bug a GPU hides most of the time, made deterministic: a consumer stream that
    does not wait for the producer's copy computes with what was there before."""
    producer, consumer = torch.Stream(device="emu"), torch.Stream(device="emu")
    _, destination = upload(device, producer)
    with consumer:
        unordered = destination + 1
    consumer.wait_stream(producer)
    with consumer:
        ordered = destination + 1
    assert torch.equal(unordered.cpu(), OLD + 1)
    assert torch.equal(ordered.cpu(), NEW + 1)


@pytest.mark.parametrize("wait", ["event", "stream", "device"])
def test_the_host_sees_a_download_once_it_synchronizes(device: torch.device, wait: str) -> None:
    side = torch.Stream(device="emu")
    host = torch.zeros(4).pin_memory()
    values = torch.arange(4.0, device=device)
    with side:
        host.copy_(values, non_blocking=True)
        done = side.record_event()
    assert not done.query()
    assert torch.equal(host, OLD)  # a host read before the event: the old bytes
    if wait == "event":
        done.synchronize()
    elif wait == "stream":
        side.synchronize()
    else:
        torch.accelerator.synchronize()
    assert done.query()
    assert torch.equal(host, NEW)


def test_a_blocking_copy_on_the_stream_lands_its_pending_copies(device: torch.device) -> None:
    side = torch.Stream(device="emu")
    _, destination = upload(device, side)
    other = torch.empty(2, device=device)
    assert torch.equal(destination.cpu(), OLD)
    with side:
        other.copy_(torch.ones(2))  # blocking, on the same stream
    assert pending_copies() == 0
    assert torch.equal(destination.cpu(), NEW)


def test_a_copy_reads_its_source_when_it_lands(device: torch.device) -> None:
    """A host write into the pinned source before the wait (a reused staging buffer) is
    caught: the copy takes the bytes there when it lands."""
    side = torch.Stream(device="emu")
    source, destination = upload(device, side)
    source.fill_(9.0)
    side.synchronize()
    assert torch.equal(destination.cpu(), torch.full((4,), 9.0))


def test_device_to_device_non_blocking_copies_are_queued(device: torch.device) -> None:
    side = torch.Stream(device="emu")
    source = torch.arange(4.0, device=device)
    destination = torch.zeros(4, device=device)
    with side:
        destination.copy_(source, non_blocking=True)
    assert torch.equal(destination.cpu(), OLD)
    side.synchronize()
    assert torch.equal(destination.cpu(), NEW)


def test_copies_from_pageable_memory_and_blocking_copies_are_synchronous(
    device: torch.device,
) -> None:
    side = torch.Stream(device="emu")
    destination = torch.zeros(4, device=device)
    with side:
        destination.copy_(torch.arange(4.0), non_blocking=True)  # pageable source
    assert pending_copies() == 0
    assert torch.equal(destination.cpu(), NEW)
    pinned_result = torch.zeros(4).pin_memory()
    with side:
        pinned_result.copy_(destination)  # blocking
    assert torch.equal(pinned_result, NEW)


def test_freeing_a_storage_a_pending_copy_writes_raises(device: torch.device) -> None:
    side = torch.Stream(device="emu")
    _, destination = upload(device, side)
    with pytest.raises(RuntimeError, match="pending non_blocking copy"):
        destination.untyped_storage().resize_(0)
    side.synchronize()
    destination.untyped_storage().resize_(0)  # once landed, freeing is fine


def test_a_copy_landing_in_a_freed_storage_raises(device: torch.device) -> None:
    side = torch.Stream(device="emu")
    host = torch.zeros(4, pin_memory=True)  # resizable, unlike .pin_memory()'s
    with side:
        host.copy_(torch.arange(4.0, device=device), non_blocking=True)
    host.untyped_storage().resize_(0)  # the host frees the buffer before the copy landed
    with pytest.raises(RuntimeError, match="resize_"):
        side.synchronize()
    assert pending_copies() == 0


def test_a_copy_on_a_side_stream_into_a_dropped_device_tensor_raises(
    device: torch.device,
) -> None:
    """On a GPU a dropped tensor's block goes back to the caching allocator for the next
    allocation on the stream that made it, which a copy still pending on another stream may
    then overwrite: the landing raises. Not where the reuse is ordered after the copy: the
    copy on the stream that made the block, or the block named to the copy's stream by
    ``record_stream`` (review R13: both were flagged)."""
    side = torch.Stream(device="emu")
    _, destination = upload(device, side)
    del destination
    with pytest.raises(RuntimeError, match="nothing else holds"):
        torch.accelerator.synchronize()
    _, destination = upload(device, torch.accelerator.current_stream())  # the maker's stream
    del destination
    _, destination = upload(device, side)
    destination.record_stream(side)
    del destination
    with side:
        _, destination = upload(device, side)  # made on the side stream
    del destination
    torch.accelerator.synchronize()
    assert pending_copies() == 0


def test_autocast_linear_is_bf16_and_equals_the_cpus_bit_for_bit(device: torch.device) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = linear(x)
    on_device = copy.deepcopy(linear).to(device)
    with torch.autocast("emu", dtype=torch.bfloat16):
        result = on_device(x.to(device))
    assert result.dtype == torch.bfloat16
    assert torch.equal(result.cpu(), expected)


@pytest.mark.parametrize("name", LOWER)
def test_autocast_runs_cudas_lower_precision_ops_in_bf16(device: torch.device, name: str) -> None:
    a = torch.randn(4, 4, device=device)
    with torch.autocast("emu", dtype=torch.bfloat16):
        assert LOWER[name](a, a).dtype == torch.bfloat16


@pytest.mark.parametrize("name", FP32)
def test_autocast_runs_cudas_fp32_ops_in_fp32(device: torch.device, name: str) -> None:
    a = torch.randn(4, 4, device=device).to(torch.bfloat16)
    with torch.autocast("emu", dtype=torch.bfloat16):
        assert FP32[name](a).dtype == torch.float32


@pytest.mark.parametrize("cache", [True, False])
def test_autocast_keeps_one_cast_copy_of_a_leaf_weight_until_the_region_ends(
    device: torch.device, cache: bool
) -> None:
    weight = torch.randn(256, 256, device=device, requires_grad=True)
    x = torch.randn(4, 256, device=device)
    with torch.autocast("emu", dtype=torch.bfloat16, cache_enabled=cache):
        first = x @ weight
        allocations = torch.accelerator.memory_stats()["allocation.all.allocated"]
        second = x @ weight
        per_call = torch.accelerator.memory_stats()["allocation.all.allocated"] - allocations
        inside = torch.accelerator.memory_allocated()
    released = inside - torch.accelerator.memory_allocated()
    weight_copy = 256 * 256 * 2
    # A call casts x (freed at once) and makes its output; without the cache, the weight too.
    assert per_call == (2 if cache else 3)
    assert released == (weight_copy if cache else 0)
    del first, second


def train(device: torch.device | str, **adamw: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **adamw)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 16, generator=data).to(device)
        y = torch.randint(0, 4, (8,), generator=data).to(device)
        nn.functional.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("adamw", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_training_equals_the_cpu_bit_for_bit(device: torch.device, adamw: dict[str, bool]) -> None:
    """A small MLP, 3 AdamW steps with clipping: every weight equals the CPU run's."""
    on_cpu, on_device = train("cpu", **adamw), train(device, **adamw)
    assert all(torch.equal(a, b) for a, b in zip(on_cpu, on_device, strict=True))


def test_the_demo_gpt_with_checkpointing_trains_bit_for_bit_as_on_the_cpu(
    device: torch.device,
) -> None:
    """Embeddings, attention (the CPU's fused kernel is chosen, as on the CPU), layer norm
    and activation checkpointing's recomputation, 2 AdamW steps."""
    from gradient_cache.demo.models import GPTConfig, TinyGPT

    def run(where: torch.device | str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
        model = TinyGPT(config, activation_checkpointing=True).to(where)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        data = torch.Generator().manual_seed(1)
        for _ in range(2):
            tokens = torch.randint(0, 64, (4, 16), generator=data).to(where)
            _, loss = model(tokens, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run("cpu"), run(device), strict=True))


def test_a_convolution_and_its_gradients_equal_the_cpus(device: torch.device) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    on_device = copy.deepcopy(conv).to(device)
    x = torch.randn(2, 3, 8, 8)
    expected, result = conv(x), on_device(x.to(device))
    expected.square().sum().backward()
    result.square().sum().backward()
    assert torch.equal(result.cpu(), expected)
    for a, b in ((conv.weight, on_device.weight), (conv.bias, on_device.bias)):
        assert a.grad is not None and b.grad is not None and torch.equal(b.grad.cpu(), a.grad)


def test_an_out_argument_the_cpu_kernel_resizes_comes_back_resized(device: torch.device) -> None:
    out = torch.empty(0, device=device)
    result = torch.add(torch.ones(5, device=device), 1, out=out)
    assert result is out and out.shape == (5,)
    assert torch.equal(out.cpu(), torch.full((5,), 2.0))


def test_random_numbers_come_from_the_cpu_generator(device: torch.device) -> None:
    """Documented choice: torch.manual_seed(s) then randn on the device gives the CPU's."""
    torch.manual_seed(3)
    on_device = torch.randn(100, device=device)
    torch.manual_seed(3)
    assert torch.equal(on_device.cpu(), torch.randn(100))


def test_save_and_load_keep_the_device(device: torch.device) -> None:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(5.0, device=device)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["w"]
    assert loaded.device == device and torch.equal(loaded.cpu(), torch.arange(5.0))
    buffer.seek(0)
    assert torch.load(buffer, map_location="cpu")["w"].device.type == "cpu"
