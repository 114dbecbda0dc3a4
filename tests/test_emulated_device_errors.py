"""The emulated device's clear errors (no compiler, no ninja, an unsupported torch, another
PrivateUse1 name), and that importing it builds nothing: in a process that never installs
it (tests/emulated/ holds the tests on the device)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradient_cache.testing import EmulatedDeviceError, emulated, emulated_device

ROOT = Path(__file__).resolve().parents[1]


def uninstalled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As if this process had not installed the device, with an empty build cache."""
    monkeypatch.setattr(emulated, "_installed", False)
    monkeypatch.setenv("GRADIENT_CACHE_BUILD_DIR", str(tmp_path))


@pytest.mark.parametrize("missing", ["c++", "ninja"])
def test_a_missing_build_tool_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, missing: str
) -> None:
    uninstalled(monkeypatch, tmp_path)
    real_which = emulated.shutil.which
    monkeypatch.setattr(
        emulated.shutil,
        "which",
        lambda name, **kw: None if name == missing else real_which(name, **kw),
    )
    fix = "apt-get install g++" if missing == "c++" else "pip install ninja"
    with pytest.raises(RuntimeError, match=fix):
        emulated_device()


def test_an_unsupported_torch_names_its_version_and_the_supported_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.99.1+cpu")
    with pytest.raises(EmulatedDeviceError, match=r"supports torch 2\.13, not 2\.99\.1"):
        emulated_device()


def test_another_privateuse1_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    with pytest.raises(EmulatedDeviceError, match="'npu'"):
        emulated_device()


def run_python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_importing_builds_nothing_and_a_second_process_loads_without_compiling(
    tmp_path: Path,
) -> None:
    """In a fresh process: importing the package and training on the CPU builds nothing
    and loads no compiler (nor ``torch._dynamo`` and ``torch.distributed.tensor``, 2.5 s
    of every process's start, which nothing here needs); then installing the device loads
    the library this run built (the default cache), still without torch's extension
    builder, and, a backward having run before it, refuses to go on, saying so (autograd
    left the device out of its threads: a later backward on it failed with an internal
    assertion)."""
    code = (
        "import os, sys, torch, gradient_cache, gradient_cache.testing\n"
        "model = torch.nn.Linear(4, 4)\n"
        "cache = gradient_cache.create_gradient_cache(model, compression_ratio=1)\n"
        "model(torch.randn(2, 4)).sum().backward()\n"
        "cache.remove_hooks()\n"
        "print('torch._dynamo' in sys.modules, 'torch.distributed.tensor' in sys.modules)\n"
        "print(torch._C._get_privateuse1_backend_name())\n"
        "print('torch.utils.cpp_extension' in sys.modules)\n"
        "print(os.path.exists(os.environ['GRADIENT_CACHE_BUILD_DIR']))\n"
        "del os.environ['GRADIENT_CACHE_BUILD_DIR']\n"
        "try:\n"
        "    gradient_cache.testing.emulated_device()\n"
        "except gradient_cache.testing.EmulatedDeviceError as error:\n"
        "    print('after this process' + \"'\" + 's first backward' in str(error))\n"
        "print('torch.utils.cpp_extension' in sys.modules)\n"
    )
    output = run_python(code, GRADIENT_CACHE_BUILD_DIR=str(tmp_path / "cache"))
    assert output.split() == ["False", "False", "privateuseone", "False", "False", "True", "False"]
