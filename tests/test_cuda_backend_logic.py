"""The CUDA backend's own logic on the CPU, with synchronous stand-ins for streams and events.

No GPU runs here: the stand-ins execute everything at once, so these tests cannot find a
missing wait. They do run every line of `CudaBackend` (staging, the host pool, the fused
step's restore stream, the pool's release) against plain PyTorch, and they check that every
event is recorded before anything waits on it. tests/test_cuda.py covers the real thing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from conftest import assert_same_parameters, batches, loss_of, make_model, train

import gradient_cache
from gradient_cache.engine import pipeline as pipeline_module
from gradient_cache.engine.cuda import CudaBackend
from gradient_cache.engine.pool import HostPool, estimate_host_bytes


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "synchronize() on an event that was never recorded"

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.recorded and end.recorded
        return 0.0


class FakeStream:
    def __init__(self, device: object = None) -> None:
        self.waited_events = 0

    def wait_stream(self, other: FakeStream) -> None:
        assert isinstance(other, FakeStream)

    def wait_event(self, event: FakeEvent) -> None:
        assert event.recorded, "a stream waits on an event that was never recorded"
        self.waited_events += 1


class FakeCuda:
    """What `CudaBackend` calls in torch.cuda, executed synchronously on the CPU."""

    def __init__(self) -> None:
        self.compute = FakeStream()
        self.active = self.compute

    def current_stream(self, device: object = None) -> FakeStream:
        return self.active

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = previous


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Managers built inside the test get a CudaBackend on CPU tensors and fake streams."""
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)

    def create_backend(params, config, deliver, *, ratio):
        capacity = estimate_host_bytes(params, ratio=ratio, config=config, count_payloads=True)
        return CudaBackend(
            deliver,
            torch.device("cpu"),
            staging_depth=config.staging_depth,
            pool=HostPool(capacity, pin=False),
        )

    monkeypatch.setattr(pipeline_module, "create_backend", create_backend)
    return cuda


@pytest.mark.parametrize("fused_step", [False, True])
@pytest.mark.parametrize("staging_depth", [1, 2])
def test_lossless_training_matches_plain_and_reuses_the_pool(
    fake_cuda: FakeCuda, fused_step: bool, staging_depth: int
) -> None:
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, compression_ratio=1, bucket_size_mb=0.004, staging_depth=staging_depth
    )
    backend = manager._pipeline.backend
    assert isinstance(backend, CudaBackend)
    in_flight = []
    launch = backend.launch

    def counting_launch(grads, work) -> None:
        launch(grads, work)
        in_flight.append(len(backend._in_flight))

    backend.launch = counting_launch
    data = batches(6)
    assert train(plain, data) == train(cached, data, manager=manager, fused_step=fused_step)
    assert_same_parameters(plain, cached)
    assert len(in_flight) > 6 and max(in_flight) == staging_depth
    # Every step's payloads fit the slab, and the slab was handed out again each step.
    assert backend.pool.overflow_bytes == 0
    assert backend.pool.used_bytes == 0
    summary = manager.get_compression_summary()
    assert summary["host_pool"]["capacity_mb"] > 0 and not summary["host_pool"]["pinned"]
    if fused_step:  # the compute stream waited on each prefetched bucket's event
        assert fake_cuda.compute.waited_events >= 6 * 2


@pytest.mark.parametrize("ratio", [1, 20])
def test_fused_step_with_clipping_matches_apply_and_clip_grad_norm(
    fake_cuda: FakeCuda, ratio: int
) -> None:
    reference, fused = make_model(), make_model()
    options = dict(
        compression_ratio=ratio, min_compress_numel=1, selection="exact", bucket_size_mb=0.004
    )
    ref_manager = gradient_cache.create_gradient_cache(reference, **options)
    fused_manager = gradient_cache.create_gradient_cache(fused, **options)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    fused_opt = torch.optim.SGD(fused.parameters(), lr=0.5)
    for tokens, targets in batches(3):
        loss_of(reference, tokens, targets).backward()
        ref_manager.apply_gradients()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(fused, tokens, targets).backward()
        total = fused_manager.step(fused_opt, max_grad_norm=0.05)
        fused_opt.zero_grad()
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    assert_same_parameters(reference, fused, atol=1e-6)


def test_discarding_releases_the_pool(fake_cuda: FakeCuda) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    pool = manager._pipeline.backend.pool
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    manager.compress_and_free_gradients()
    assert pool.used_bytes > 0
    manager.discard_gradients()
    assert pool.used_bytes == 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("ratio", [1, 20])
def test_pool_sized_from_the_model_holds_odd_sized_payloads(
    fake_cuda: FakeCuda, ratio: int
) -> None:
    """Each pool view starts on a 64-byte boundary; the sizing must count that padding."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=ratio, min_compress_numel=1
    )
    pool = manager._pipeline.backend.pool
    for _ in range(2):
        model(torch.randn(4, 7)).sum().backward()
        manager.apply_gradients()
        assert pool.step_overflow_bytes == 0
        assert 0 < pool.step_used_bytes <= pool.capacity_bytes
    summary = manager.get_compression_summary()["host_pool"]
    assert summary["used_mb"] == pool.step_used_bytes / 2**20 and summary["overflow_mb"] == 0
