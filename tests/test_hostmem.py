"""The host-memory budget (engine/hostmem.py): cgroup limits and the refusal to start."""

from __future__ import annotations

import pytest
import torch

import gradient_cache
from gradient_cache import HostMemoryError
from gradient_cache.engine import hostmem


def write_cgroup(root, path: str, files: dict[str, str]) -> None:
    directory = root / path.lstrip("/")
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text + "\n")


def test_cgroup_headroom_is_the_smallest_of_the_process_cgroup_and_its_ancestors(
    tmp_path,
) -> None:
    root = tmp_path / "fs"
    proc = tmp_path / "cgroup"
    proc.write_text("0::/outer/inner\n")
    write_cgroup(root, "/outer", {"memory.max": "1000", "memory.current": "900"})
    write_cgroup(root, "/outer/inner", {"memory.max": "max", "memory.current": "500"})
    assert hostmem.cgroup_headroom_bytes(proc, root) == 100  # the parent's limit binds
    write_cgroup(root, "/outer/inner", {"memory.max": "550", "memory.current": "500"})
    assert hostmem.cgroup_headroom_bytes(proc, root) == 50
    write_cgroup(root, "/outer", {"memory.max": "max", "memory.current": "900"})
    write_cgroup(root, "/outer/inner", {"memory.max": "max", "memory.current": "500"})
    assert hostmem.cgroup_headroom_bytes(proc, root) is None
    assert hostmem.cgroup_headroom_bytes(tmp_path / "absent", root) is None


def test_cgroup_v1_memory_hierarchy(tmp_path) -> None:
    root = tmp_path / "fs"
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/job\n4:memory:/job/step\n")
    limits = {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "5"}
    write_cgroup(root, "/memory/job/step", limits)
    write_cgroup(
        root, "/memory/job", {"memory.limit_in_bytes": "2000", "memory.usage_in_bytes": "1500"}
    )
    assert hostmem.cgroup_headroom_bytes(proc, root) == 500


def test_available_host_bytes_is_capped_by_the_cgroup(monkeypatch) -> None:
    monkeypatch.setattr(hostmem, "cgroup_headroom_bytes", lambda: 123)
    assert hostmem.available_host_bytes() == 123


def test_engine_refuses_to_start_when_the_host_cannot_hold_it(monkeypatch) -> None:
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda: 2**20)
    model = torch.nn.Linear(1024, 1024)
    with pytest.raises(HostMemoryError) as info:
        gradient_cache.create_gradient_cache(
            model, compression_ratio=100, codec="topk", residual_dtype="float32"
        )
    message = str(info.value)
    assert "needs about 8 MiB" in message and "may use 0 MiB" in message  # two residuals
    assert "host_memory_fraction=0.5" in message and "error_feedback=False" in message
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    gradient_cache.create_gradient_cache(
        model, compression_ratio=100, codec="topk", error_feedback=False
    )
