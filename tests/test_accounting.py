"""Device-memory accounting: what the CPU tracker counts, and cache against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradient_cache
from gradient_cache import TopK
from gradient_cache.demo.accounting import (
    ENGINE_SCRATCH,
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    CudaMemoryMeter,
    MemoryReading,
    PhasePeak,
    TensorMemoryTracker,
    device_memory_meter,
    storage_bytes,
)
from gradient_cache.demo.models import GPTConfig, TinyGPT

MIB = 2**20


def test_counts_an_allocation_once_with_its_views_until_it_is_freed() -> None:
    with TensorMemoryTracker() as tracker:
        before = tracker.reading().device_bytes
        with tracker.phase("allocate"):
            x = torch.empty(MIB // 4)
            y = x.view(512, 512)[::2]  # a view: no new storage
            assert tracker.reading().device_bytes - before == MIB
            del x, y
        after = tracker.reading().device_bytes
    assert tracker.peaks["allocate"].peak.device_bytes - before == MIB
    assert after == before


def test_phases_do_not_nest() -> None:
    tracker = TensorMemoryTracker()
    outer, inner = tracker.phase("outer"), tracker.phase("inner")
    with tracker, outer, pytest.raises(RuntimeError, match="nest"), inner:
        pass


def mlp(layers: int = 6, width: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def dense_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_parameters_gradients_and_optimizer_state_are_told_apart() -> None:
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    train_step(model, optimizer)  # creates the optimizer state
    dense = dense_bytes(model)
    with device_memory_meter(model, optimizer=optimizer) as meter:
        model(torch.randn(2, 256)).sum().backward()
        reading = meter.reading()
    by_category = reading.by_category
    assert by_category[PARAMETERS] == dense
    assert by_category[GRADIENTS] == dense
    steps = 4 * len(list(model.parameters()))  # Adam's 0-dim fp32 step counters
    assert by_category[OPTIMIZER_STATE] == 2 * dense + steps
    assert reading.device_bytes == sum(by_category.values())
    assert reading.host_bytes == 0


def test_host_copies_and_what_is_made_from_them_alone_count_apart() -> None:
    host = torch.ones(MIB // 4)
    with TensorMemoryTracker(host=lambda: [host]) as tracker:
        device = torch.ones(MIB // 4)
        merged = host.clone()  # made from host tensors only: host memory on a GPU machine too
        mixed = host + device  # reads a device tensor: runs on the device
        reading = tracker.reading()
    assert reading.host_bytes == 2 * MIB
    assert reading.by_category[OTHER] == 2 * MIB  # device and mixed
    assert merged.numel() == mixed.numel()


def cached_and_plain(ratio: float, **options: object):
    plain, cached = mlp(), mlp()
    cache = gradient_cache.create_gradient_cache(
        cached, compression_ratio=ratio, bucket_size_mb=0.25, **options
    )
    plain_optimizer = torch.optim.Adam(plain.parameters())
    cached_optimizer = torch.optim.Adam(cached.parameters())
    train_step(plain, plain_optimizer)
    cached(torch.randn(2, 256)).sum().backward()
    cache.step(cached_optimizer)
    return (plain, plain_optimizer), (cached, cached_optimizer, cache)


def measure(
    model, optimizer, cache=None, *, fused: bool
) -> tuple[dict[str, PhasePeak], MemoryReading]:
    """Peaks of two micro-batches' backward and of the step; the reading between them."""
    meter = device_memory_meter(model, optimizer=optimizer, cache=cache)
    with meter:
        for name in ("backward 1", "backward 2"):
            loss = model(torch.randn(2, 256)).sum()
            with meter.phase(name):
                loss.backward()
                if cache is not None:
                    cache.compress_and_free_gradients()
            if name == "backward 1":
                between = meter.reading()
        with meter.phase("step"):
            if cache is None:
                optimizer.step()
            elif fused:
                cache.step(optimizer)
            else:
                cache.apply_gradients()
                optimizer.step()
        optimizer.zero_grad()
    return meter.peaks, between


@pytest.mark.parametrize("ratio", [1, 100])
def test_cache_holds_far_fewer_gradient_bytes_than_plain(ratio: float) -> None:
    # The offload alone; error feedback's scratch is the next test's.
    (plain, plain_optimizer), (cached, cached_optimizer, cache) = cached_and_plain(
        ratio, **({"codec": TopK(error_feedback=False)} if ratio > 1 else {})
    )
    dense = dense_bytes(plain)
    expected, expected_between = measure(plain, plain_optimizer, fused=False)
    got, between = measure(cached, cached_optimizer, cache, fused=True)
    # Backward holds about a bucket (0.25 MiB) of the 1.5 MiB of gradients at once; at
    # ratio 100 the selector's scratch (a fifth of dense here) is on the device too.
    for name in ("backward 1", "backward 2"):
        assert got[name].peak.device_bytes <= expected[name].peak.device_bytes - 0.4 * dense
        assert got[name].max_by_category[GRADIENTS] <= 0.5 * dense
        # Plain ends backward holding every gradient (and, briefly, a transposed weight
        # gradient and its contiguous copy at once).
        assert expected[name].max_by_category[GRADIENTS] >= dense
    saved = expected_between.device_bytes - between.device_bytes
    assert saved >= 0.99 * dense
    assert between.by_category[GRADIENTS] == between.by_category[ENGINE_SCRATCH] == 0
    if ratio == 1:
        assert between.host_bytes == dense  # the same tensors, now counted as host
    else:
        assert 0 < between.host_bytes < 0.05 * dense  # payloads: about 2% of dense
    assert got["step"].peak.device_bytes <= expected["step"].peak.device_bytes - 0.6 * dense


def test_error_feedback_adds_a_few_gradients_of_scratch_and_keeps_its_residual_on_the_host() -> (
    None
):
    """Encoding with a residual needs gradient + residual in fp32 and the int8 codec's
    temporaries, each at most the largest gradient (the codec works in chunks); the
    residual itself stays in host memory between steps."""
    figures = {}
    for error_feedback in (False, True):
        _, (cached, optimizer, cache) = cached_and_plain(
            100, codec="topk", error_feedback=error_feedback, selection="exact"
        )
        figures[error_feedback] = measure(cached, optimizer, cache, fused=True)
    largest = max(p.numel() * 4 for p in cached.parameters())
    (without, between_without), (with_ef, between_with) = figures[False], figures[True]
    for name in ("backward 1", "backward 2"):
        extra = with_ef[name].peak.device_bytes - without[name].peak.device_bytes
        assert 0 < extra <= 3 * largest
    assert between_with.device_bytes == between_without.device_bytes
    residual = sum(-(-p.numel() // 64) * 68 for p in cached.parameters() if p.numel() >= 16384)
    # Between backward and step both residuals exist: the current one and the pending
    # step's new one (discard_gradients() can still drop it).
    assert between_with.host_bytes == between_without.host_bytes + 2 * residual


def test_apply_gradients_brings_the_step_peak_back() -> None:
    (plain, plain_optimizer), (cached, cached_optimizer, cache) = cached_and_plain(1)
    expected = measure(plain, plain_optimizer, fused=False)[0]["step"].peak
    got = measure(cached, cached_optimizer, cache, fused=False)[0]["step"].peak
    assert got.device_bytes == expected.device_bytes
    assert got.by_category[GRADIENTS] == dense_bytes(plain)


def test_storage_bytes_counts_shared_storage_once() -> None:
    x = torch.empty(1000)
    assert storage_bytes([x, x[10:], x.view(10, 100)]) == 4000


def test_meter_follows_the_model_device() -> None:
    assert isinstance(device_memory_meter(mlp()), TensorMemoryTracker)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_meter_reads_the_allocator() -> None:
    device = torch.device("cuda")
    model = mlp().to(device)
    meter = device_memory_meter(model)
    assert isinstance(meter, CudaMemoryMeter)
    with meter:
        before = meter.reading().device_bytes
        with meter.phase("allocate"):
            x = torch.empty(MIB // 4, device=device)
            del x
    assert meter.peaks["allocate"].peak.device_bytes - before >= MIB


def test_gradients_the_cache_holds_on_the_device_count_as_gradients() -> None:
    """With a bucket larger than the model, every gradient waits in the open bucket."""
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    cache = gradient_cache.create_gradient_cache(model, compression_ratio=1, bucket_size_mb=64)
    with device_memory_meter(model, optimizer=optimizer, cache=cache) as meter:
        loss = model(torch.randn(2, 256)).sum()
        with meter.phase("backward"):
            loss.backward()
        waiting = meter.reading()
        cache.compress_and_free_gradients()
        offloaded = meter.reading()
    assert meter.peaks["backward"].max_by_category[GRADIENTS] >= dense_bytes(model)
    assert waiting.by_category[GRADIENTS] == dense_bytes(model)
    assert offloaded.by_category[GRADIENTS] == 0
    assert offloaded.host_bytes == dense_bytes(model)


def test_the_fused_steps_restored_bucket_counts_on_the_device() -> None:
    """On the CPU backend a lossless restore hands over the cached tensor itself: while it
    is a parameter's .grad it is device memory (a restored copy on a GPU), host memory too."""
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    cache = gradient_cache.create_gradient_cache(model, compression_ratio=1, bucket_size_mb=0.25)
    train_step_with(model, optimizer, cache)  # creates the optimizer state
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    peaks, _ = measure(model, optimizer, cache, fused=True)
    step = peaks["step"]
    assert largest <= step.max_by_category[GRADIENTS] <= 2 * (MIB // 4 + largest)
    assert step.peak.host_bytes > 0


def train_step_with(model: nn.Module, optimizer: torch.optim.Optimizer, cache) -> None:
    model(torch.randn(2, 256)).sum().backward()
    cache.step(optimizer)


def test_one_optimizer_per_parameter_counts_as_one() -> None:
    """The optimizer step in backward keeps an optimizer per parameter."""
    model = mlp()
    optimizers = [torch.optim.Adam([p]) for p in model.parameters()]
    model(torch.randn(2, 256)).sum().backward()
    for optimizer in optimizers:
        optimizer.step()
    with device_memory_meter(model, optimizer=optimizers) as meter:
        state = meter.reading().by_category[OPTIMIZER_STATE]
    assert state == 2 * dense_bytes(model) + 4 * len(optimizers)


def test_weights_on_the_host_count_only_while_they_are_on_the_device() -> None:
    """offload_parameters: the masters are host memory, and a weight's device tensor holds
    memory only between its storage's refill and its emptying (resizes no operator sees).
    At each block's start and end, and after the step, the tracker counts as parameters
    exactly what the cache's weights say the device holds."""
    config = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)
    torch.manual_seed(0)
    model = TinyGPT(config, activation_checkpointing=True)
    optimizer = torch.optim.AdamW(model.parameters())
    cache = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
    )
    weights = cache.engine.weights
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(tokens, tokens)[1].backward()
        cache.step(optimizer)
        optimizer.zero_grad()

    step()  # the optimizer state exists from here on
    seen: list[tuple[int, int]] = []
    with device_memory_meter(model, optimizer=optimizer, cache=cache) as meter:

        def compare(*_: object) -> None:
            seen.append((meter.reading().by_category[PARAMETERS], weights.device_bytes()))

        for block in model.blocks:
            block.register_forward_pre_hook(compare)
            block.register_forward_hook(compare)
        with meter.phase("step"):
            step()
        after = meter.reading()
    counted, held = zip(*seen, strict=True)
    assert counted == held and max(held) > 0
    assert after.by_category[PARAMETERS] == 0
    assert meter.peaks["step"].max_by_category[PARAMETERS] < dense_bytes(model)
    assert after.host_bytes >= 3 * dense_bytes(model)  # masters and AdamW's two moments


def test_a_cap_raises_out_of_memory_at_the_operator_that_passes_it() -> None:
    """The tracker holds a device cap as an allocator would: within a phase, the operator
    after which more bytes are counted than the cap raises torch.OutOfMemoryError; up to
    the cap nothing happens, and outside phases nothing is checked."""
    kept = torch.empty(MIB // 4)  # 1 MiB, counted once an operator touches it
    with TensorMemoryTracker(cap_bytes=2 * MIB) as meter:
        kept.zero_()
        larger = torch.empty(3 * MIB // 4 // 4)  # outside a phase: not checked
        del larger
        with meter.phase("under"):
            under = torch.empty(MIB // 4 - 1024)  # 2 MiB less 4 KiB in all
        over_the_cap = pytest.raises(torch.OutOfMemoryError, match=r"over the cap of 2\.00 MiB")
        with over_the_cap, meter.phase("over"):
            torch.empty(2048)  # 8 KiB more: 4 KiB over
    del under
    assert meter.peaks["under"].peak.device_bytes <= 2 * MIB
    assert meter.peaks["over"].peak.device_bytes > 2 * MIB
