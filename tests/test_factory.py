"""Building a backend (engine/factory.py): the device chosen and checked, the accelerator
backend's refusals before it touches the device, its host check, the top-k selection it
resolves."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model

import gradient_cache
from gradient_cache import EngineConfig
from gradient_cache.engine.accelerator import AcceleratorBackend
from gradient_cache.engine.backend import CpuBackend
from gradient_cache.engine.factory import build_accelerator_backend, parameter_device
from gradient_cache.engine.route import planner


def test_the_removed_cpu_worker_thread_option_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"Unknown engine option\(s\) \['cpu_worker_thread'\]"):
        gradient_cache.create_gradient_cache(make_model(), cpu_worker_thread=True)


def test_parameters_on_several_devices_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match=r"several devices \['cpu', 'meta'\]"):
        parameter_device(params)


def test_the_accelerator_backends_host_check_counts_what_the_pool_reserves(monkeypatch) -> None:
    """The budget check sees the slabs' bytes (what gets pinned), not the slots' sum."""
    from stream_checker import FakeAccelerator, StreamChecker

    from gradient_cache.engine import factory

    checked = []
    monkeypatch.setattr(factory, "check_host_budget", lambda needed, **_: checked.append(needed))
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300_000, 70_000, 10)]
    accelerator = FakeAccelerator(StreamChecker())
    backend = build_accelerator_backend(
        params,
        EngineConfig(),
        torch.device("cpu"),
        plan=planner(params, EngineConfig(), ratio=1),
        streams=accelerator,
        allocate=accelerator.allocate_pinned,
    )
    assert checked == [backend.pool.capacity_bytes]
    assert backend.pool.capacity_bytes > backend.pool.needed_bytes  # 1.48 MB needs 2 MiB


@pytest.mark.parametrize(
    ("accelerator", "device", "built"),
    [
        ("cuda", "cuda:0", "accelerator"),
        ("xpu", "xpu:1", "accelerator"),
        ("privateuseone", "privateuseone:0", "accelerator"),  # a PrivateUse1 device (emu)
        ("cuda", "cpu", "cpu"),
        (None, "cpu", "cpu"),
        ("privateuseone", "cuda:0", "refused"),  # a registered PrivateUse1 device goes first
        (None, "cuda:0", "refused"),
    ],
)
def test_the_backend_follows_the_current_accelerator(
    monkeypatch: pytest.MonkeyPatch, accelerator: str | None, device: str, built: str
) -> None:
    """Parameters on `torch.accelerator`'s device type get the accelerator backend, CPU ones
    the CPU backend; any other device is refused with the reason."""
    from gradient_cache.engine import factory

    current = None if accelerator is None else torch.device(accelerator)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *_: current)
    monkeypatch.setattr(factory, "parameter_device", lambda params: torch.device(device))
    monkeypatch.setattr(factory, "build_accelerator_backend", lambda *args, **kwargs: "accelerator")
    params = [torch.nn.Parameter(torch.zeros(4))]
    config = EngineConfig()
    plan = planner(params, config, ratio=1)
    if built == "refused":
        match = (
            rf"{device}, which is neither the CPU nor this process's accelerator \({accelerator}\)"
        )
        with pytest.raises(ValueError, match=match):
            factory.create_backend(params, config, plan=plan)
        return
    backend = factory.create_backend(params, config, plan=plan)
    if built == "accelerator":
        assert backend == "accelerator"
    else:
        assert isinstance(backend, CpuBackend)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(selection="threshold"), "selection='threshold' is not supported on cuda"),
        (dict(host_pool_mb=0.001), r"host_pool_mb=0.001 is below the 4.0 MiB"),
    ],
)
def test_accelerator_backend_refusals_come_before_touching_the_device(
    options: dict, match: str
) -> None:
    params = [torch.nn.Parameter(torch.zeros(1024, 1024))]
    with pytest.raises(ValueError, match=match):
        config = EngineConfig.from_options(options)  # the ladder's selection, at ratio 3
        plan = planner(params, config, ratio=1)
        build_accelerator_backend(params, config, torch.device("cuda"), plan=plan)


def test_auto_selection_depends_on_the_backend() -> None:
    assert CpuBackend.default_selection == "threshold"
    assert AcceleratorBackend.default_selection == "exact"  # torch.topk: no host sync
    manager = gradient_cache.create_gradient_cache(make_model(), compression_ratio=10, codec="topk")
    assert manager.engine.codecs.candidates[0].encoder.selector.method == "threshold"
