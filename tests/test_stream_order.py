"""The accelerator backend's stream ordering, proven on the CPU.

The real `AcceleratorBackend` runs on CPU tensors with stand-in streams and events
(tests/stream_checker.py); the checker sees every tensor operation and fails a test on any
access a GPU could run out of order, any block the allocator could reuse too early, and
any host wait inside a backward hook. `../shared/tools/mutate_waits.py` deletes each wait
in gradient_cache/engine/ in turn: every deletion must make this file fail.
"""

from __future__ import annotations

import io

import helpers
import pytest
import torch
from helpers import (
    MadeGradients,
    assert_same_parameters,
    batches,
    loss_of,
    make_model,
    train,
    train_through_a_failed_step,
    train_with_a_skipped_batch,
)
from stream_checker import FakeAccelerator, FakeEvent, StreamChecker
from torch.utils._python_dispatch import TorchDispatchMode

import gradient_cache
from gradient_cache import Ladder, TopK
from gradient_cache.codecs import int8_kernels
from gradient_cache.codecs.registry import make_codec
from gradient_cache.engine.accelerator import AcceleratorBackend
from gradient_cache.engine.factory import build_accelerator_backend
from gradient_cache.engine.residuals import HostSlotResiduals

SMALL = 0.004  # MiB: several buckets per backward for these models


@pytest.fixture
def fake_accelerator():
    """Stand-in accelerator streams under the checker; ``fake_accelerator.factory`` is the
    backend factory that gives a manager the real `AcceleratorBackend` on CPU tensors and
    these streams."""
    checker = StreamChecker()
    accelerator = FakeAccelerator(checker)

    def factory(params, config, *, plan):
        backend = build_accelerator_backend(
            params,
            config,
            torch.device("cpu"),
            plan=plan,
            streams=accelerator,
            allocate=accelerator.allocate_pinned,
        )
        checker.watched |= {backend.encode_stream.name, backend.copy_stream.name}
        return backend

    accelerator.factory = factory
    with checker:
        yield accelerator


def cpu_backend_run(data, options, *, fused_step=False, micro_batches=1, each=True):
    """The same training on the CPU backend: what the CUDA path must reproduce exactly."""
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, **options, backend="cpu")
    train(
        model,
        data,
        manager=manager,
        fused_step=fused_step,
        micro_batches=micro_batches,
        compress_each_micro_batch=each,
    )
    return model


def layers(n: int = 8, width: int = 32) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)])


# --- the checker itself fails on what it must catch --------------------------------------


def test_checker_flags_an_unordered_read_and_an_early_free() -> None:
    checker = StreamChecker()
    accelerator = FakeAccelerator(checker)
    side = accelerator.new_stream()
    with checker:
        grad = torch.ones(1000)  # written on the compute stream
        with side:
            grad.sum()  # no wait: a race
        assert any("race" in v for v in checker.violations)
        checker.violations.clear()
        side.wait_stream(accelerator.compute)
        with side:
            grad.sum()
        assert not checker.violations
        del grad  # freed for the compute stream while the side stream may still read it
        torch.zeros(1)
        assert any("freed" in v for v in checker.violations)


def test_checker_flags_host_reads_before_the_copy_and_waits_inside_hooks() -> None:
    checker = StreamChecker()
    accelerator = FakeAccelerator(checker)
    copy = accelerator.new_stream()
    with checker:
        slot = accelerator.allocate_pinned(64).view(torch.float32)
        grad = torch.ones(16)
        copy.wait_stream(accelerator.compute)
        with copy:
            slot.copy_(grad, non_blocking=True)
        done = accelerator.new_event()
        done.record(copy)
        slot.sum()  # the host reads before synchronizing
        assert any("race: host reads" in v for v in checker.violations)
        checker.violations.clear()
        done.synchronize()
        slot.sum()
        assert not checker.violations
        weight = torch.nn.Parameter(torch.ones(3))

        def syncing_hook(param: torch.nn.Parameter) -> None:
            param.grad.sum().item()

        weight.register_post_accumulate_grad_hook(syncing_hook)
        (weight * 2).sum().backward()
        assert any("inside a backward hook" in v for v in checker.violations)


def test_the_checker_sends_int8_down_the_cuda_path_while_entered() -> None:
    """The compiled kernels write through raw pointers the checker cannot see: off, and
    the fused operations on, as on CUDA; leaving restores both."""
    kernels, fused = int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES
    with StreamChecker():
        assert int8_kernels.CPU_KERNELS is None
        assert "cpu" in int8_kernels.FUSED_DEVICE_TYPES
    assert int8_kernels.CPU_KERNELS is kernels
    assert int8_kernels.FUSED_DEVICE_TYPES is fused


@pytest.mark.parametrize("path", ["fused", "eager"])
def test_the_default_codec_runs_its_cuda_int8_path_under_the_checker(
    fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The default options give most tensors the int8 codec; the checker must see its
    encode (on the encode stream) and decode (on the restore stream) as a GPU runs them:
    one fused operation each where Triton is installed, else the eager path; never the
    compiled CPU kernels, whose writes no dispatch mode sees. Both give the CPU's bytes."""
    if path == "eager":
        monkeypatch.setattr(int8_kernels, "FUSED_DEVICE_TYPES", frozenset())
    data = batches(2)
    with fake_accelerator.checker.disabled():
        reference = cpu_backend_run(data, dict(bucket_size_mb=SMALL))
    cached = make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, backend_factory=fake_accelerator.factory, bucket_size_mb=SMALL
    )
    assert "int8" in {route.codec.name for route in manager.engine.routes.values()}
    train(cached, data, manager=manager)
    assert_same_parameters(reference, cached)
    fake_accelerator.checker.assert_clean()
    backend = manager.engine.backend
    seen = fake_accelerator.checker.dispatched
    encode_stream, restore_stream = backend.encode_stream.name, backend.restore_stream.name
    if path == "fused":
        assert seen[encode_stream, "int8_encode"] > 0, "no fused int8 encode on the encode stream"
        assert seen[restore_stream, "int8_decode"] > 0, "no fused decode on the restore stream"
        assert seen[encode_stream, "floor_"] == 0  # the eager path's rounding
        return
    # The block maxima and the stochastic rounding, then the codes times their scales.
    for op in ("abs", "amax", "floor_"):
        assert seen[encode_stream, op] > 0, f"no {op} on the encode stream"
    assert seen[restore_stream, "mul_"] > 0, "no int8 decode on the restore stream"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int8", "q4", "q3", "sign"])
def test_the_cuda_codec_paths_dispatch_a_bounded_number_of_operations(
    fake_accelerator: FakeAccelerator, name: str, dtype: torch.dtype
) -> None:
    """On CUDA each int8 or block-code encode and decode is one fused operation whatever
    the size (the eager path costs a fixed number per chunk of 2^18 entries): the host's
    launch cost in a hook does not grow with the tensor. Counted under the stand-in,
    kernels off."""
    codec = make_codec(name)
    codec.encode(torch.ones(1), None, loss_scale=None)  # the noise table, once a backward
    counts = []
    for numel in (100, 3 * int8_kernels.CODEC_CHUNK + 5):
        flat = torch.randn(numel).to(dtype)
        fake_accelerator.checker.dispatched.clear()
        payload, _ = codec.encode(flat, None, loss_scale=None)
        payload.decode_into(torch.empty(numel, dtype=dtype))
        counts.append(sum(fake_accelerator.checker.dispatched.values()))
    # Allocate, encode; allocate, decode (bf16: into fp32, rounded, copied into ``out``).
    assert counts[0] == counts[1] <= (4 if dtype == torch.float32 else 7), counts


# --- the engine ----------------------------------------------------------------------


@pytest.mark.parametrize("fused_step", [False, True])
@pytest.mark.parametrize("staging_depth", [1, 2, 3])
def test_lossless_training_is_exact_and_every_access_ordered(
    fake_accelerator: FakeAccelerator, fused_step: bool, staging_depth: int
) -> None:
    data = batches(4)
    plain = make_model()
    train(plain, data)
    cached = make_model()
    manager = gradient_cache.create_gradient_cache(
        cached,
        backend_factory=fake_accelerator.factory,
        compression_ratio=1,
        bucket_size_mb=SMALL,
        staging_depth=staging_depth,
    )
    assert isinstance(manager.engine.backend, AcceleratorBackend)
    train(cached, data, manager=manager, fused_step=fused_step)
    assert_same_parameters(plain, cached)
    fake_accelerator.checker.assert_clean()
    assert fake_accelerator.pinned_allocations == 1  # one slab, at construction


@pytest.mark.parametrize("staging_depth", [1, 2])
@pytest.mark.parametrize("ratio", [1, 100], ids=["lossless", "top-k"])
def test_device_memory_in_flight_is_bounded_by_the_staging_depth(
    fake_accelerator: FakeAccelerator, staging_depth: int, ratio: float
) -> None:
    """At most ``staging_depth`` buckets are in flight: a retired bucket's device tensors go
    before the next bucket's encode, which at ratio 100 allocates (top-k's temporaries, at
    most one tensor's size, come on top). Without error feedback: a device residual is held
    between steps, not in flight."""
    model = layers()
    codec = {} if ratio == 1 else dict(codec=TopK(error_feedback=False), min_compress_numel=1)
    manager = gradient_cache.create_gradient_cache(
        model,
        backend_factory=fake_accelerator.factory,
        compression_ratio=ratio,
        bucket_size_mb=SMALL,
        staging_depth=staging_depth,
        **codec,
    )
    model(torch.randn(4, 32)).sum().backward()
    manager.apply_gradients()
    fake_accelerator.checker.assert_clean()
    capacity = manager.config.bucket_size_bytes
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = staging_depth * (capacity + largest) + (0 if ratio == 1 else largest)
    assert bound < total  # holding every bucket would break the bound
    assert 0 < fake_accelerator.checker.peak_watched_bytes <= bound


@pytest.mark.parametrize("ratio", [1, 100], ids=["copy-reads-the-gradient", "encode-reads-it"])
def test_gradients_made_on_another_stream_are_reused_only_after_their_copy(
    fake_accelerator: FakeAccelerator, ratio: float
) -> None:
    """FSDP2 under HSDP: a gradient allocated on the reduce-scatter stream reaches the hook
    on the all-reduce stream, which the retirement wait is put on; its block must not go
    back to the reduce-scatter stream before the encode and copy have read it."""
    model = layers()
    manager = gradient_cache.create_gradient_cache(
        model,
        backend_factory=fake_accelerator.factory,
        compression_ratio=ratio,
        bucket_size_mb=SMALL,
        staging_depth=1,
        min_compress_numel=64,
    )
    pipeline = manager.engine
    pipeline.backend.record_gradients = True  # what DTensor (FSDP2) parameters set
    reduce_scatter, all_reduce = fake_accelerator.new_stream(), fake_accelerator.new_stream()
    for _ in range(2):
        for param in reversed(list(model.parameters())):
            reduce_scatter.wait_stream(fake_accelerator.compute)  # FSDP2: after backward made it
            with reduce_scatter:
                param.grad = torch.randn(param.shape)  # the reduce-scatter output
            all_reduce.wait_stream(reduce_scatter)
            with all_reduce:
                pipeline.capture.on_grad_ready(param)  # FSDP2 calls the hooks itself
        fake_accelerator.compute.wait_stream(all_reduce)
        manager.apply_gradients()
        with reduce_scatter:
            torch.zeros(4096)  # the next reduce-scatter takes freed blocks
    fake_accelerator.checker.assert_clean()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "options",
    [
        dict(compression_ratio=1),
        dict(compression_ratio=20, codec=TopK(residual_location="host", selection="exact")),
        dict(compression_ratio=20, codec=TopK(residual_location="device", selection="exact")),
        dict(compression_ratio=8, codec=Ladder(selection="exact")),
    ],
    ids=["lossless", "ef-host", "ef-device", "q3 by the ladder"],
)
def test_accumulation_without_a_drain_matches_the_cpu_backend(
    fake_accelerator: FakeAccelerator, options: dict
) -> None:
    """Micro-batches back to back: the encode reads slots whose copy the host never awaited."""
    options = dict(options, bucket_size_mb=SMALL, staging_depth=16, min_compress_numel=1)
    data = batches(3)
    with fake_accelerator.checker.disabled():
        reference = cpu_backend_run(data, options, micro_batches=3, each=False)
    cached = make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, backend_factory=fake_accelerator.factory, **options
    )
    train(cached, data, manager=manager, micro_batches=3, compress_each_micro_batch=False)
    assert_same_parameters(reference, cached)
    fake_accelerator.checker.assert_clean()


RECIPES = {
    "fp32": {},
    "int8+warmup": dict(residual_dtype="int8", warmup_steps=2),
    "bf16": dict(residual_dtype="bfloat16"),
    "int8 values": dict(value_dtype="int8", residual_dtype="int8"),
    "one residual slot": dict(residual_dtype="int8", keep_previous_residual=False),
}


@pytest.mark.parametrize("ratio", [1, 20])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_int8_values_match_the_cpu_backend(
    fake_accelerator: FakeAccelerator, ratio: int, micro_batches: int
) -> None:
    """Ratio 1: the int8 codec; 20: top-k's values as int8 codes (this test once passed
    ``value_dtype="int8"`` with ``codec=None`` there, where it did nothing: the ladder ran)."""
    int8_values = TopK(value_dtype="int8", error_feedback=False, selection="exact")
    options = dict(
        compression_ratio=ratio,
        codec="int8" if ratio == 1 else int8_values,
        min_compress_numel=1,
        bucket_size_mb=SMALL,
    )
    data = batches(3)
    with fake_accelerator.checker.disabled():
        reference = cpu_backend_run(data, options, micro_batches=micro_batches)
    cached = make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, backend_factory=fake_accelerator.factory, **options
    )
    train(cached, data, manager=manager, micro_batches=micro_batches)
    assert_same_parameters(reference, cached)
    summary = manager.get_compression_summary()
    if ratio == 1:  # a byte per entry and a 4-byte scale per 64: about a quarter of fp32
        assert 0.26 < summary["stored_fraction"] < 0.28
    fake_accelerator.checker.assert_clean()


@pytest.mark.parametrize("fused_step", [False, True])
@pytest.mark.parametrize("location", ["host", "device"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_error_feedback_matches_the_cpu_backend(
    fake_accelerator: FakeAccelerator, fused_step: bool, location: str, recipe: str
) -> None:
    options = dict(
        compression_ratio=20,
        codec="topk",
        error_feedback=True,
        residual_location=location,
        selection="exact",
        min_compress_numel=1,
        bucket_size_mb=SMALL,
        **RECIPES[recipe],
    )
    data = batches(5)
    with fake_accelerator.checker.disabled():
        reference = cpu_backend_run(data, options, fused_step=fused_step)
    cached = make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, backend_factory=fake_accelerator.factory, **options
    )
    train(cached, data, manager=manager, fused_step=fused_step)
    assert_same_parameters(reference, cached)
    backend = manager.engine.backend
    assert isinstance(backend.residuals, HostSlotResiduals) == (location == "host")
    dense_room = [route.dense_room for route in manager.engine.routes.values()]
    assert not any(dense_room)  # the warm-up's room dropped once it ended
    assert backend.pool.layout == {p: r.slot for p, r in manager.engine.routes.items()}
    fake_accelerator.checker.assert_clean()


def test_the_pool_has_room_for_warmup_then_its_slots_shrink_in_place(
    fake_accelerator: FakeAccelerator,
) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model,
        backend_factory=fake_accelerator.factory,
        compression_ratio=20,
        codec="topk",
        warmup_steps=1,
        min_compress_numel=1,
        error_feedback=False,
    )
    pool = manager.engine.backend.pool
    dense = sum(4 * p.numel() for p in model.parameters())
    assert pool.capacity_bytes > dense  # dense values and room for indices
    train(model, batches(2), manager=manager)
    steady = manager.engine.backend.pool
    assert steady.needed_bytes < dense / 5
    assert steady.capacity_bytes == pool.capacity_bytes  # the same slabs
    assert fake_accelerator.pinned_allocations == 1
    fake_accelerator.checker.assert_clean()


@pytest.mark.parametrize("ratio", [1, 20])
def test_fused_step_with_clipping_matches_apply_and_clip_grad_norm(
    fake_accelerator: FakeAccelerator, ratio: int
) -> None:
    options = dict(
        compression_ratio=ratio,
        min_compress_numel=1,
        codec=Ladder(selection="exact"),
        bucket_size_mb=SMALL,
    )
    reference, fused = make_model(), make_model()
    made = MadeGradients(reference)
    ref_manager = gradient_cache.create_gradient_cache(
        reference, backend_factory=fake_accelerator.factory, **options
    )
    fused_manager = gradient_cache.create_gradient_cache(
        fused, backend_factory=fake_accelerator.factory, **options
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    fused_opt = torch.optim.SGD(fused.parameters(), lr=0.5)
    for step, (tokens, targets) in enumerate(batches(3)):
        loss_of(reference, tokens, targets).backward()
        ref_manager.apply_gradients()
        expected = made.clip_as_the_fused_step(reference, step, 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(fused, tokens, targets).backward()
        total = fused_manager.step(fused_opt, max_grad_norm=0.05)
        fused_opt.zero_grad()
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    assert_same_parameters(reference, fused, atol=1e-6)
    fake_accelerator.checker.assert_clean()


def lossless_small_buckets(model, fake_accelerator: FakeAccelerator, **options):
    """A lossless cache on the stand-in streams, several buckets, the norm layer excluded
    (its gradients stay on the device)."""
    return gradient_cache.create_gradient_cache(
        model,
        backend_factory=fake_accelerator.factory,
        compression_ratio=1,
        bucket_size_mb=SMALL,
        exclude_layers=["norm"],
        **options,
    )


def test_only_the_fused_step_restores_ahead(fake_accelerator: FakeAccelerator) -> None:
    """apply_gradients() restores a bucket at a time (each stays in .grad: a bucket ahead
    would only raise the device peak), the fused step one bucket ahead (each is freed once
    stepped)."""
    model = make_model()
    manager = lossless_small_buckets(model, fake_accelerator)
    backend = manager.engine.backend
    in_flight, most = [0], {"apply": 0, "step": 0}
    start, finish = backend.start_restore, backend.finish_restore

    def counted(phase: str):
        def start_restore(*args, **kwargs):
            in_flight[0] += 1
            most[phase] = max(most[phase], in_flight[0])
            return start(*args, **kwargs)

        return start_restore

    def finish_restore(restore):
        in_flight[0] -= 1
        return finish(restore)

    backend.finish_restore = finish_restore
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for phase, tokens_targets in zip(most, batches(2), strict=True):
        loss_of(model, *tokens_targets).backward()
        backend.start_restore = counted(phase)
        if phase == "apply":
            manager.apply_gradients()
            optimizer.zero_grad()
        else:
            manager.step(optimizer)
    assert most == {"apply": 1, "step": 2}
    fake_accelerator.checker.assert_clean()


@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_failed_fused_step_retried_gives_the_plain_result(
    fake_accelerator: FakeAccelerator, nth: int, clip: float | None
) -> None:
    """Bucket ``nth`` fails with the next bucket restoring ahead; the retry finishes the step."""
    plain, cached = make_model(), make_model()
    manager = lossless_small_buckets(cached, fake_accelerator)
    train_through_a_failed_step(plain, cached, manager, nth=nth, clip=clip)
    assert_same_parameters(plain, cached, atol=0 if clip is None else 1e-6)
    fake_accelerator.checker.assert_clean()


@pytest.mark.parametrize("nth", [None, 2])
def test_the_optimizer_state_streamed_through_the_fused_step_is_ordered(
    fake_accelerator: FakeAccelerator, nth: int | None
) -> None:
    """offload_optimizer_state: each bucket's state comes to the device on the restore
    stream a bucket ahead, steps, goes back on the copy stream and is freed only after;
    the host reads it after ``optimizer.state_dict()``, which waits for the copies back
    (the step's end does not: the next step's bring is ordered on the device). With ``nth``,
    that optimizer.step() of the second step raises once, with a bucket's state on its
    way, and the retry finishes the step. AdamW with clipping, as plain, bit for bit."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    failure = helpers.FailsOnce(cached_opt)
    manager = lossless_small_buckets(cached, fake_accelerator, offload_optimizer_state=True)
    for i, (tokens, targets) in enumerate(batches(3)):
        with fake_accelerator.checker.disabled():
            loss_of(plain, tokens, targets).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
            plain_opt.step()
            plain_opt.zero_grad()
        loss_of(cached, tokens, targets).backward()
        if i == 1 and nth is not None:
            failure.arm(nth)
            with pytest.raises(torch.OutOfMemoryError):
                manager.step(cached_opt, max_grad_norm=0.05)
        manager.step(cached_opt, max_grad_norm=0.05)
        cached_opt.zero_grad()
        saved = cached_opt.state_dict()["state"]  # waits for the copies back
        host = manager.engine.optimizer_state.copies_of(cached_opt)
        for index, (p, q) in enumerate(zip(plain.parameters(), cached.parameters(), strict=True)):
            state = cached_opt.state[q]
            assert state["exp_avg"] is host[q]["exp_avg"]
            with fake_accelerator.checker.disabled():
                assert torch.equal(plain_opt.state[p]["exp_avg_sq"], state["exp_avg_sq"])
            assert state["exp_avg"].sum() is not None  # host reads, checked
            assert saved[index]["exp_avg"].sum() is not None
    assert_same_parameters(plain, cached)
    fake_accelerator.checker.assert_clean()


@pytest.mark.parametrize("offload_state_of", [False, True])
def test_a_state_loaded_onto_the_device_goes_to_the_host_in_order(
    fake_accelerator: FakeAccelerator, offload_state_of: bool
) -> None:
    """A state loaded without offload_state_of sits on the device. The fused step's begin
    (or offload_state_of, after which the host reads it) copies it to the host on the copy
    stream; the first bucket brings it back on the restore stream after that copy; a closed
    cache copies it to the device again after the last copy back. AdamW, bit for bit with
    plain."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    data = batches(3)
    with fake_accelerator.checker.disabled():
        for tokens, targets in data:
            loss_of(plain, tokens, targets).backward()
            plain_opt.step()
            plain_opt.zero_grad()
        warm = make_model()
        warm_opt = torch.optim.AdamW(warm.parameters(), lr=1e-2)
        loss_of(warm, *data[0]).backward()
        warm_opt.step()
        cached.load_state_dict(warm.state_dict())
        cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
        cached_opt.load_state_dict(warm_opt.state_dict())  # on the device, no cache yet
    manager = lossless_small_buckets(cached, fake_accelerator, offload_optimizer_state=True)
    if offload_state_of:
        manager.offload_state_of(cached_opt)
        assert all(s["exp_avg"].sum() is not None for s in cached_opt.state.values())  # host
    for tokens, targets in data[1:]:
        loss_of(cached, tokens, targets).backward()
        manager.step(cached_opt)
        cached_opt.zero_grad()
    manager.remove_hooks()
    assert_same_parameters(plain, cached)
    fake_accelerator.checker.assert_clean()


class HostWaits:
    """Which events the host waits on (`FakeEvent.synchronize`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[FakeEvent] = []
        synchronize = FakeEvent.synchronize

        def recorded(event: FakeEvent) -> None:
            self.events.append(event)
            synchronize(event)

        monkeypatch.setattr(FakeEvent, "synchronize", recorded)


def test_the_steps_end_leaves_the_host_free_and_state_dict_waits_and_is_compact(
    fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """offload_optimizer_state on the stand-in streams: the host never waits for a copy of
    state back inside ``manager.step`` (the next forward can be queued); the next step's
    bring and ``optimizer.state_dict()`` still read complete host copies (the checker);
    ``state_dict()`` waits, and ``torch.save`` of it writes the state's bytes, not the
    slabs' (within 5%, beside plain PyTorch's own pickle overhead). AdamW as plain, bit
    for bit."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    manager = lossless_small_buckets(cached, fake_accelerator, offload_optimizer_state=True)
    backend = manager.engine.backend
    copies_back = []
    start_to_host = backend.start_to_host

    def recorded_start_to_host(pairs):
        transfer = start_to_host(pairs)
        copies_back.append(transfer.done)
        return transfer

    monkeypatch.setattr(backend, "start_to_host", recorded_start_to_host)
    waits = HostWaits(monkeypatch)
    for tokens, targets in batches(3):
        with fake_accelerator.checker.disabled():
            loss_of(plain, tokens, targets).backward()
            plain_opt.step()
            plain_opt.zero_grad()
        loss_of(cached, tokens, targets).backward()
        manager.step(cached_opt)
        cached_opt.zero_grad()
    assert copies_back and not set(map(id, waits.events)) & set(map(id, copies_back))
    waited_before = len(waits.events)
    saved = cached_opt.state_dict()
    # The host waits where it reads: for the last copy back.
    assert any(event is copies_back[-1] for event in waits.events[waited_before:])
    fake_accelerator.checker.assert_clean()
    with fake_accelerator.checker.disabled():
        assert_same_parameters(plain, cached)
        expected = plain_opt.state_dict()
        for index, values in expected["state"].items():
            for key, value in values.items():
                assert torch.equal(saved["state"][index][key], value), key
        state_bytes = sum(
            v.numel() * v.element_size()
            for values in expected["state"].values()
            for v in values.values()
            if v.dim() > 0
        )
        plain_file, cached_file = io.BytesIO(), io.BytesIO()
        torch.save(expected, plain_file)
        torch.save(saved, cached_file)
    overhead = plain_file.tell() - state_bytes  # the pickle's, plain PyTorch's own
    assert cached_file.tell() <= 1.05 * state_bytes + overhead
    # A load overwrites host copies that the last step's copies back may still write; and
    # once the cache closes, the optimizer's host copies are the host's to read.
    for load in (True, False):
        loss_of(cached, *batches(1)[0]).backward()
        manager.step(cached_opt)
        if load:
            cached_opt.load_state_dict(saved)
    manager.remove_hooks()
    assert not cached_opt._optimizer_state_dict_post_hooks  # the closed cache let go
    assert all(state["exp_avg"].sum() is not None for state in cached_opt.state.values())
    fake_accelerator.checker.assert_clean()


def test_discard_then_train_on(fake_accelerator: FakeAccelerator) -> None:
    """Discarded payloads are never read; the slots are rewritten by the next step."""
    data = batches(3)
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, backend_factory=fake_accelerator.factory, compression_ratio=1, bucket_size_mb=SMALL
    )
    loss_of(cached, *data[0]).backward()
    manager.discard_gradients()
    assert not manager.engine.store and all(p.grad is None for p in cached.parameters())
    train(plain, data[1:])
    train(cached, data[1:], manager=manager)
    assert_same_parameters(plain, cached)
    fake_accelerator.checker.assert_clean()


@pytest.mark.parametrize("fused_step", [False, True])
def test_a_discarded_step_leaves_the_host_residual_as_it_was(
    fake_accelerator: FakeAccelerator, fused_step: bool
) -> None:
    """The discarded step's residual went to the spare slot; the current one is intact."""
    options = dict(
        compression_ratio=20,
        codec="topk",
        min_compress_numel=1,
        selection="exact",
        bucket_size_mb=SMALL,
    )
    with fake_accelerator.checker.disabled():
        reference = train_with_a_skipped_batch(
            {**options, "backend": "cpu"}, skip=False, fused_step=fused_step
        )
    skipping = train_with_a_skipped_batch(
        {**options, "backend_factory": fake_accelerator.factory}, skip=True, fused_step=fused_step
    )
    assert_same_parameters(reference, skipping)
    fake_accelerator.checker.assert_clean()


@pytest.mark.parametrize(
    "residuals",
    [{}, dict(residual_location="device", keep_previous_residual=False)],
    ids=["host slots", "one device residual"],
)
@pytest.mark.parametrize("cut", [4, 5], ids=["between steps", "mid-accumulation"])
def test_a_resumed_run_continues_bit_for_bit(
    fake_accelerator: FakeAccelerator, cut: int, residuals: dict
) -> None:
    """Host residuals and cached payloads go back into their pinned slots. A device residual
    is loaded on the compute stream: the encode that reads it (and replaces it, with one
    residual a parameter) keeps it until its bucket is known to be done."""
    options = dict(
        compression_ratio=20, codec="topk", selection="exact", bucket_size_mb=SMALL, **residuals
    )
    with fake_accelerator.checker.disabled():
        reference, reference_manager, optimizer = helpers.build_checkpointed(
            {**options, "backend": "cpu"}
        )
        helpers.run_checkpointed(
            reference, reference_manager, optimizer, range(len(helpers.CHECKPOINT_DATA))
        )
    resumed, manager = helpers.resumed_run(
        {**options, "backend_factory": fake_accelerator.factory}, cut
    )
    assert manager.engine.backend.residuals.current()
    assert_same_parameters(reference, resumed)
    fake_accelerator.checker.assert_clean()


def test_refused_construction_leaves_no_pinned_memory_or_hook(
    fake_accelerator: FakeAccelerator,
) -> None:
    model = make_model()
    with pytest.raises(gradient_cache.HostMemoryError):  # a share no host can give
        gradient_cache.create_gradient_cache(
            model, backend_factory=fake_accelerator.factory, host_memory_fraction=1e-15
        )
    assert fake_accelerator.pinned_allocations == 0
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


class PinnedNeverGivenBack:
    """A pinned allocator that never gives memory back, as PyTorch's caching host allocator
    keeps a freed pinned block for requests of its size: every slab it ever handed out stays
    held, and `held_bytes` is what the process pins."""

    def __init__(self, accelerator: FakeAccelerator) -> None:
        self._allocate = accelerator.allocate_pinned
        self.slabs: list[torch.Tensor] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        slab = self._allocate(nbytes)
        self.slabs.append(slab)
        return slab

    @property
    def held_bytes(self) -> int:
        return sum(slab.numel() for slab in self.slabs)


@pytest.mark.parametrize(
    "codec",
    [{}, dict(compression_ratio=20, codec="topk")],
    ids=["default", "top-k"],
)
def test_the_warmups_end_pins_nothing_beyond_what_the_host_check_approved(
    fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch, codec: dict
) -> None:
    """The steady slots are cut from the warm-up's slabs: new, smaller slabs could not reuse
    the old ones' pinned bytes, so the process would pin more than the check approved."""
    from gradient_cache.engine import factory

    approved = []
    check = factory.check_host_budget

    def recording_check(needed: int, *, what: str, **options) -> None:
        if what == "the host pool of payload slots":
            approved.append(needed)
        check(needed, what=what, **options)

    monkeypatch.setattr(factory, "check_host_budget", recording_check)
    allocate = PinnedNeverGivenBack(fake_accelerator)
    fake_accelerator.allocate_pinned = allocate  # what the fixture's factory pins with
    options = dict(warmup_steps=2, bucket_size_mb=SMALL, min_compress_numel=1, **codec)
    data = batches(4)
    with fake_accelerator.checker.disabled():
        reference = cpu_backend_run(data, options)
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model, backend_factory=fake_accelerator.factory, **options
    )
    warmup_pool = manager.engine.backend.pool
    train(model, data, manager=manager)
    pool = manager.engine.backend.pool
    assert not any(route.dense_room for route in manager.engine.routes.values())
    assert pool.layout != warmup_pool.layout and pool.needed_bytes < warmup_pool.needed_bytes
    assert len(approved) == 1 and allocate.slabs
    assert allocate.held_bytes <= approved[0]
    assert pool.capacity_bytes == allocate.held_bytes  # the slabs held, counted once
    assert_same_parameters(reference, model)
    fake_accelerator.checker.assert_clean()


class CopiesInto(TorchDispatchMode):
    """Each ``copy_``'s destination storage and whether it was non-blocking."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            self.copies.append((args[0].untyped_storage().data_ptr(), non_blocking))
        return func(*args, **kwargs)


def test_a_slab_that_could_not_be_pinned_blocks_only_its_own_copies(
    fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OS refuses to pin the pool's second slab: copies into the first stay
    non-blocking (one refused pin once made every copy block), those into the second
    block (the price of pageable memory, warned of)."""
    allocate = fake_accelerator.allocate_pinned

    def second_refused(nbytes: int) -> torch.Tensor:
        if fake_accelerator.pinned_allocations == 1:
            fake_accelerator.pinned_allocations += 1
            raise RuntimeError("cannot lock more pages")
        return allocate(nbytes)

    fake_accelerator.allocate_pinned = second_refused  # what the fixture's factory pins with
    model = layers(n=2, width=512)  # two 1 MiB weights: two slabs
    with pytest.warns(RuntimeWarning, match="could not pin host memory") as record:
        manager = gradient_cache.create_gradient_cache(
            model,
            backend_factory=fake_accelerator.factory,
            compression_ratio=1,
            bucket_size_mb=SMALL,
        )
    assert record[0].filename == __file__  # the user's line, not the pool's
    pool = manager.engine.backend.pool
    slabs = {
        view.untyped_storage().data_ptr(): pool.is_pinned(view)
        for slot in pool.slots.values()
        for view in slot.regions
    }
    assert sorted(slabs.values()) == [False, True]
    recorder = CopiesInto()
    with recorder:
        model(torch.randn(4, 512)).sum().backward()
        manager.compress_and_free_gradients()
    into_slabs = [
        (slabs[ptr], non_blocking) for ptr, non_blocking in recorder.copies if ptr in slabs
    ]
    assert {pinned for pinned, _ in into_slabs} == {False, True}
    assert all(pinned == non_blocking for pinned, non_blocking in into_slabs)


@pytest.mark.parametrize("nth", [1, 2])
def test_a_load_after_a_failed_step_waits_for_the_state_brought_ahead(
    fake_accelerator: FakeAccelerator, nth: int
) -> None:
    """``optimizer.step()`` raises with a bucket's state on its way to the device (brought
    ahead, after the last copy back): a load then overwrites host copies that copy may
    still read, so the load's host wait covers the copies to the device too. The retry
    after the load steps from the loaded state."""
    cached = make_model()
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    failure = helpers.FailsOnce(cached_opt)
    manager = lossless_small_buckets(cached, fake_accelerator, offload_optimizer_state=True)
    (tokens, targets), then = batches(2)
    loss_of(cached, tokens, targets).backward()
    manager.step(cached_opt)
    cached_opt.zero_grad()
    saved = cached_opt.state_dict()
    loss_of(cached, *then).backward()
    failure.arm(nth)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(cached_opt)
    cached_opt.load_state_dict(saved)
    fake_accelerator.checker.assert_clean()
    manager.step(cached_opt)


def test_a_step_post_hook_reads_the_host_state_after_its_copy_back(
    fake_accelerator: FakeAccelerator,
) -> None:
    """offload_optimizer_state: a step post-hook (a logger) reads every parameter's
    exp_avg on the host. It fires once, after the whole fused step, the copies back of the
    state settled first: no read races a copy back on the copy stream."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = lossless_small_buckets(model, fake_accelerator, offload_optimizer_state=True)
    reads = []

    def log(optimizer, args, kwargs) -> None:
        host = manager.engine.optimizer_state.copies_of(optimizer)
        for param in model.parameters():
            state = optimizer.state[param].get("exp_avg")
            if state is not None and state is host.get(param, {}).get("exp_avg"):
                reads.append(state.sum())  # a host read, checked

    optimizer.register_step_post_hook(log)
    for tokens, targets in batches(3):
        loss_of(model, tokens, targets).backward()
        manager.step(optimizer, max_grad_norm=0.05)
    assert reads
    fake_accelerator.checker.assert_clean()


def test_fsdp2s_copy_in_stream_reads_a_refilled_shard_after_its_copy(
    fake_accelerator: FakeAccelerator,
) -> None:
    """offload_parameters under FSDP2: FSDP2's all-gather copy-in reads a shard on a stream
    of its own; `let_read` orders it after the refill the compute stream waited for."""
    manager = lossless_small_buckets(make_model(), fake_accelerator, offload_optimizer_state=True)
    backend = manager.engine.backend
    master = fake_accelerator.allocate_pinned(64).view(torch.float32)
    shard = torch.empty(16)
    backend.resize_storage(shard, 0)  # at rest
    backend.resize_storage(shard, 64)
    backend.finish_to_device(backend.start_refill([(shard, master)]))
    copy_in = fake_accelerator.new_stream()
    backend.let_read(copy_in)
    with copy_in:
        shard.sum()
    fake_accelerator.checker.assert_clean()
    manager.remove_hooks()


def test_fsdp2s_copy_in_waits_for_the_refill_and_not_for_the_module_running_before(
    fake_accelerator: FakeAccelerator,
) -> None:
    """Given the refill, `let_read` orders the copy-in after its event only: the copy-in
    reads the refilled shard in order, and is not held behind compute work queued after
    the refill started (the module before it: a read of that work's output from the
    copy-in stream is unordered, which the checker flags)."""
    manager = lossless_small_buckets(make_model(), fake_accelerator, offload_optimizer_state=True)
    backend = manager.engine.backend
    master = fake_accelerator.allocate_pinned(64).view(torch.float32)
    shard = torch.empty(16)
    backend.resize_storage(shard, 0)  # at rest
    backend.resize_storage(shard, 64)
    refill = backend.start_refill([(shard, master)])
    later = torch.ones(16) * 2  # the module running before, queued on compute after it
    copy_in = fake_accelerator.new_stream()
    backend.let_read(copy_in, [refill])
    with copy_in:
        shard.sum()
    fake_accelerator.checker.assert_clean()
    with copy_in:
        later.sum()
    assert fake_accelerator.checker.violations  # not ordered after the compute stream
    fake_accelerator.checker.violations.clear()
    backend.finish_to_device(refill)
    manager.remove_hooks()


def test_a_shard_given_up_waits_for_fsdp2s_copy_in_that_read_it(
    fake_accelerator: FakeAccelerator,
) -> None:
    """offload_parameters under FSDP2: a shard FSDP2 prefetched (its copy-in read it, on a
    stream of its own, unwaited) is given up only after `join` orders the compute stream
    after that copy-in: the allocator hands the block on in compute-stream order."""
    manager = lossless_small_buckets(make_model(), fake_accelerator, offload_optimizer_state=True)
    backend = manager.engine.backend
    master = fake_accelerator.allocate_pinned(64).view(torch.float32)
    shard = torch.empty(16)
    backend.finish_to_device(backend.start_refill([(shard, master)]))
    copy_in = fake_accelerator.new_stream()
    backend.let_read(copy_in)
    with copy_in:
        shard.sum()  # FSDP2's copy-in
    backend.join(copy_in)
    backend.resize_storage(shard, 0)
    torch.zeros(16)  # the block reused on the compute stream
    fake_accelerator.checker.assert_clean()
    manager.remove_hooks()
