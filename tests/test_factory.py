"""Building a backend (engine/factory.py): the device chosen and checked, the CUDA backend's
refusals before it touches CUDA, its host check, the top-k selection it resolves."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model

import gradient_cache
from gradient_cache import EngineConfig
from gradient_cache.engine.backend import CpuBackend
from gradient_cache.engine.cuda import CudaBackend
from gradient_cache.engine.factory import build_cuda_backend, parameter_device
from gradient_cache.engine.route import planner


def test_the_removed_cpu_worker_thread_option_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"Unknown engine option\(s\) \['cpu_worker_thread'\]"):
        gradient_cache.create_gradient_cache(make_model(), cpu_worker_thread=True)


def test_parameters_on_several_devices_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match=r"several devices \['cpu', 'meta'\]"):
        parameter_device(params)


def test_the_cuda_backends_host_check_counts_what_the_pool_reserves(monkeypatch) -> None:
    """The budget check sees the slabs' bytes (what gets pinned), not the slots' sum."""
    from stream_checker import FakeCuda, StreamChecker

    from gradient_cache.engine import factory

    checked = []
    monkeypatch.setattr(factory, "check_host_budget", lambda needed, **_: checked.append(needed))
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300_000, 70_000, 10)]
    cuda = FakeCuda(StreamChecker())
    backend = build_cuda_backend(
        params,
        EngineConfig(),
        torch.device("cpu"),
        plan=planner(params, EngineConfig(), ratio=1),
        cuda=cuda,
        allocate=cuda.allocate_pinned,
    )
    assert checked == [backend.pool.capacity_bytes]
    assert backend.pool.capacity_bytes > backend.pool.needed_bytes  # 1.48 MB needs 2 MiB


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(selection="threshold"), "selection='threshold' is not supported on CUDA"),
        (dict(host_pool_mb=0.001), r"host_pool_mb=0.001 is below the 4.0 MiB"),
    ],
)
def test_cuda_backend_refusals_come_before_touching_cuda(options: dict, match: str) -> None:
    params = [torch.nn.Parameter(torch.zeros(1024, 1024))]
    with pytest.raises(ValueError, match=match):
        config = EngineConfig.from_options(options)  # the ladder's selection, at ratio 3
        plan = planner(params, config, ratio=1)
        build_cuda_backend(params, config, torch.device("cuda"), plan=plan)


def test_auto_selection_depends_on_the_backend() -> None:
    assert CpuBackend.default_selection == "threshold"
    assert CudaBackend.default_selection == "exact"  # torch.topk: no host sync
    manager = gradient_cache.create_gradient_cache(make_model(), compression_ratio=10, codec="topk")
    assert manager.engine.codecs.candidates[0].encoder.selector.method == "threshold"
