"""Engine parts on their own: buckets, backends, host-memory budget."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import batches, loss_of, make_model

import gradient_cache
from gradient_cache import EngineConfig, HostMemoryError
from gradient_cache.compression import DensePayload
from gradient_cache.engine import pool
from gradient_cache.engine.backend import ThreadedCPUBackend, parameter_device
from gradient_cache.engine.buckets import BucketAssembler, chunk_by_bytes


def test_bucket_assembler_fills_to_capacity_in_arrival_order() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 5, 40)]
    assembler = BucketAssembler(capacity_bytes=100)
    full = [assembler.add(p, torch.zeros(p.numel())) for p in params]
    assert full[0] is None and full[1] is not None  # 40 B, then 120 B >= 100 B
    assert [p for p, _ in full[1]] == params[:2]
    assert full[2] is None and [p for p, _ in full[3]] == params[2:]
    assert assembler.flush() is None


def test_chunk_by_bytes() -> None:
    chunks = list(chunk_by_bytes([3, 3, 3, 9, 1, 2, 4], 6, lambda x: x))
    assert chunks == [[3, 3], [3], [9], [1, 2], [4]]


def test_buckets_follow_backward_order_and_launch_during_backward(monkeypatch) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1, bucket_size_mb=1e-6)
    pipeline = manager._pipeline
    launched: list[list[str]] = []
    grads_left: list[int] = []
    original = pipeline._encode_bucket

    def spy(bucket):
        launched.append([pipeline.names[p] for p, _ in bucket])
        grads_left.append(sum(p.grad is not None for p in model.parameters()))
        return original(bucket)

    monkeypatch.setattr(pipeline, "_encode_bucket", spy)
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    order = [names[0] for names in launched]
    assert order.index("mlp.2.weight") < order.index("mlp.0.weight")  # backward order
    assert all(left == 0 for left in grads_left)  # each freed as soon as it was ready


def test_worker_thread_encodes_off_the_backward_thread(monkeypatch) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, bucket_size_mb=1e-6, cpu_worker_thread=True
    )
    pipeline = manager._pipeline
    assert isinstance(pipeline.backend, ThreadedCPUBackend)
    threads = set()
    original = pipeline._encode_bucket
    monkeypatch.setattr(
        pipeline,
        "_encode_bucket",
        lambda bucket: threads.add(threading.current_thread().name) or original(bucket),
    )
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    manager.apply_gradients()
    assert threads == {"gradient-cache-encode"}
    manager.remove_hooks()
    assert not pipeline.backend._thread.is_alive()


def test_worker_thread_error_is_raised_at_the_drain() -> None:
    backend = ThreadedCPUBackend(deliver=lambda param, payload: None)

    def failing():
        raise ValueError("boom")

    backend.launch([], failing)
    with pytest.raises(RuntimeError, match="not kept") as info:
        backend.wait()
    assert isinstance(info.value.__cause__, ValueError)
    delivered = []
    backend = ThreadedCPUBackend(deliver=lambda param, payload: delivered.append(payload))
    backend.launch([], lambda: [(None, DensePayload(torch.ones(2)))])
    backend.wait()
    assert len(delivered) == 1
    backend.close()


def test_parameters_on_several_devices_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match=r"several devices \['cpu', 'meta'\]"):
        parameter_device(params)


def test_cgroup_headroom(tmp_path) -> None:
    limit, usage = tmp_path / "max", tmp_path / "current"
    usage.write_text("300\n")
    limit.write_text("1000\n")
    assert pool.cgroup_headroom_bytes([(str(limit), str(usage))]) == 700
    limit.write_text("max\n")
    assert pool.cgroup_headroom_bytes([(str(limit), str(usage))]) is None
    assert pool.cgroup_headroom_bytes([(str(tmp_path / "absent"), str(usage))]) is None


def test_available_host_bytes_is_capped_by_the_cgroup(monkeypatch) -> None:
    monkeypatch.setattr(pool, "cgroup_headroom_bytes", lambda: 123)
    assert pool.available_host_bytes() == 123


def test_host_estimate_counts_payloads_and_residuals() -> None:
    big, small = torch.nn.Parameter(torch.zeros(100_000)), torch.nn.Parameter(torch.zeros(10))
    config = EngineConfig(min_compress_numel=1000, error_feedback=True)
    with_payloads = pool.estimate_host_bytes(
        [big, small], ratio=100, config=config, count_payloads=True
    )
    # 1000 kept (+10% band): 4400 B of values and 4400 B of indices, each padded to the
    # pool's 64-byte alignment (4416 B); the small one dense (40 B, padded to 64 B); a
    # 4 B/elt residual.
    assert with_payloads == 2 * 4416 + 64 + 100_000 * 4
    residual_only = pool.estimate_host_bytes(
        [big, small], ratio=100, config=config, count_payloads=False
    )
    assert residual_only == 100_000 * 4
    no_feedback = EngineConfig(min_compress_numel=1000, error_feedback=False)
    assert pool.estimate_host_bytes([big], ratio=100, config=no_feedback, count_payloads=False) == 0


def test_engine_refuses_to_start_when_the_host_cannot_hold_it(monkeypatch) -> None:
    monkeypatch.setattr(pool, "available_host_bytes", lambda: 2**20)
    model = torch.nn.Linear(1024, 1024)
    with pytest.raises(HostMemoryError) as info:
        gradient_cache.create_gradient_cache(model, compression_ratio=100, error_feedback=True)
    message = str(info.value)
    assert "needs about 4 MiB" in message and "may use 0 MiB" in message
    assert "host_memory_fraction=0.5" in message and "error_feedback=False" in message
    gradient_cache.create_gradient_cache(model, compression_ratio=100, error_feedback=False)


def test_host_pool_hands_out_aligned_views_and_overflows_to_fresh_memory() -> None:
    host_pool = pool.HostPool(1024, pin=False)
    a = host_pool.take(10, torch.float32)
    b = host_pool.take(3, torch.int32)
    assert a.dtype == torch.float32 and a.numel() == 10 and b.numel() == 3
    assert b.data_ptr() - a.data_ptr() == 64  # 40 bytes, rounded up to the alignment
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one slab
    big = host_pool.take(1000, torch.float32)
    assert big.numel() == 1000 and host_pool.overflow_bytes == 4000
    assert big.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    host_pool.reset()
    assert host_pool.take(10, torch.float32).data_ptr() == a.data_ptr()  # reused after reset


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA is present")
def test_host_pool_falls_back_to_pageable_memory_with_one_warning() -> None:
    with pytest.warns(RuntimeWarning, match="could not pin host memory") as record:
        host_pool = pool.HostPool(1024, pin=True)
        host_pool.take(10_000, torch.float32)  # an overflow allocation does not warn again
    assert len(record) == 1
    assert not host_pool.pinned


def test_cuda_backend_refuses_a_host_residual_before_touching_cuda() -> None:
    from gradient_cache.engine.backend import _cuda_backend

    config = EngineConfig(error_feedback=True)
    with pytest.raises(ValueError, match="residual_location='device'"):
        _cuda_backend([], config, lambda p, q: None, torch.device("cuda"), ratio=100)


def test_auto_selection_depends_on_the_device() -> None:
    config = EngineConfig()
    assert config.selection_for(torch.device("cpu")) == "threshold"
    assert config.selection_for(torch.device("cuda")) == "exact"
    assert EngineConfig(selection="exact").selection_for(torch.device("cpu")) == "exact"
