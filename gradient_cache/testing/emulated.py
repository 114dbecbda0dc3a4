"""An accelerator emulated on the CPU: PyTorch's PrivateUse1 backend, named ``"emu"``.

Device code paths (streams, events, pinned memory, non_blocking copies, a device memory
cap, autocast, a separate device type) run on a machine without a GPU. The device is a
small C++ extension (``csrc/``), compiled from the package's sources at first use with
``torch.utils.cpp_extension.load`` and cached per torch version and source hash, so a
later process only loads the library. Nothing is built at import.

What it emulates and what it cannot: docs/devices.md, "The emulated device".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import sys
import threading
import types
from pathlib import Path

import torch

DEVICE_NAME = "emu"
#: The torch minors whose PrivateUse1 interfaces the C++ sources are written and tested
#: against. They move between minors (DESIGN.md): support only what is tested.
SUPPORTED_TORCH = ("2.13",)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (
    "emulated_memory.cpp",
    "emulated_device.cpp",
    "emulated_kernels.cpp",
    "emulated_autocast.cpp",
)
_HEADERS = ("emulated_device.h",)
_LIBRARY = "gradient_cache_emulated"
_CFLAGS = ("-O1",)
_UNLIMITED = -1

_lock = threading.Lock()
_installed = False


class EmulatedDeviceError(RuntimeError):
    """The emulated device cannot be installed here; the message says why and the fix."""


def emulated_device(*, capacity_bytes: int | None = None) -> torch.device:
    """Install the emulated device (once per process) and set its memory capacity.

    ``capacity_bytes=None`` leaves it unlimited; an allocation past the capacity raises
    ``torch.OutOfMemoryError`` as CUDA's does. Call it again (between tests, say) to change
    the capacity. Returns ``torch.device("emu", 0)``.
    """
    if capacity_bytes is not None and (
        isinstance(capacity_bytes, bool)
        or not isinstance(capacity_bytes, int)
        or capacity_bytes < 0
    ):
        raise ValueError(
            f"Invalid capacity_bytes: {capacity_bytes!r}; expected None (unlimited) or an int >= 0."
        )
    with _lock:
        _install()
    capacity = _UNLIMITED if capacity_bytes is None else capacity_bytes
    torch.ops.gradient_cache_emu.set_capacity(capacity)
    return torch.device(DEVICE_NAME, 0)


def pending_copies() -> int:
    """How many non_blocking copies are queued on the emulated device's streams, not landed."""
    return int(torch.ops.gradient_cache_emu.pending_copies())


def build_directory() -> Path:
    """Where the compiled library is cached: ``$GRADIENT_CACHE_BUILD_DIR`` (or
    ``~/.cache/gradient_cache``) / ``emulated-<torch version>-<source hash>``."""
    root = os.environ.get("GRADIENT_CACHE_BUILD_DIR") or Path.home() / ".cache" / "gradient_cache"
    return Path(root) / f"emulated-{torch.__version__}-{_source_hash()}"


def _install() -> None:
    global _installed
    _check_torch_version()
    _check_backend_name()
    if _installed:
        return
    _load_library()
    if torch._C._get_privateuse1_backend_name() != DEVICE_NAME:
        torch.utils.rename_privateuse1_backend(DEVICE_NAME)
    if not hasattr(torch, DEVICE_NAME):
        torch._register_device_module(DEVICE_NAME, _device_module())
    if not hasattr(torch.Tensor, DEVICE_NAME):
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
        )
    _check_autograd_sees_it()
    _installed = True


def _check_autograd_sees_it() -> None:
    """A backward on the device, once: autograd sizes its device threads at a process's
    first backward, and one that ran before the install left the device out, which only
    an internal assertion in a later backward would say."""
    probe = torch.zeros((), device=torch.device(DEVICE_NAME, 0), requires_grad=True)
    try:
        (probe * 1).backward()
    except RuntimeError as error:
        if "device_ready_queues_" not in str(error):
            raise
        raise EmulatedDeviceError(
            "The emulated device was installed after this process's first backward: "
            "autograd made its device threads then, without it, and cannot run a backward "
            "on it. Call emulated_device() before any backward (at the top of the script, "
            "or in a session-scoped fixture)."
        ) from None


def _check_torch_version() -> None:
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if minor not in SUPPORTED_TORCH:
        raise EmulatedDeviceError(
            f"The emulated device supports torch {', '.join(SUPPORTED_TORCH)}, not "
            f"{torch.__version__}: PyTorch's PrivateUse1 interfaces change between minor "
            "versions. Install a supported torch to use it."
        )


def _check_backend_name() -> None:
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", DEVICE_NAME):
        raise EmulatedDeviceError(
            f"PyTorch's PrivateUse1 backend is already registered as {name!r} in this "
            f"process, and a process has one: the emulated device ({DEVICE_NAME!r}) cannot "
            f"be installed beside it. Run the emulated device in a process without {name!r}."
        )


def _load_library() -> None:
    directory = build_directory()
    library = directory / f"{_LIBRARY}.so"
    # A finished build has the library and no lock (cpp_extension holds `lock` while it
    # builds): load it without importing cpp_extension, which is slow to import.
    if library.is_file() and not (directory / "lock").exists():
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:
            pass  # an unfinished or foreign file: build it again below
    _check_build_tools()
    directory.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=_LIBRARY,
        sources=[str(_CSRC / source) for source in _SOURCES],
        extra_cflags=list(_CFLAGS),
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def _check_build_tools() -> None:
    missing = []
    compiler = shlex.split(os.environ.get("CXX", "c++"))[0]
    if shutil.which(compiler) is None:
        missing.append(
            f"a C++ compiler ({compiler!r} is not on PATH: `apt-get install g++` on Debian "
            "or Ubuntu, `xcode-select --install` on macOS)"
        )
    # pip puts ninja beside the interpreter, which may not be on PATH (an unactivated venv).
    beside_python = str(Path(sys.executable).parent)
    ninja = shutil.which("ninja") or shutil.which("ninja", path=beside_python)
    if ninja is None:
        missing.append("ninja (`pip install ninja`)")
    elif shutil.which("ninja") is None:
        os.environ["PATH"] = beside_python + os.pathsep + os.environ.get("PATH", "")
    if missing:
        raise EmulatedDeviceError(
            "The emulated device is compiled at its first use and needs "
            + " and ".join(missing)
            + "."
        )


def _source_hash() -> str:
    digest = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        digest.update(name.encode())
        digest.update((_CSRC / name).read_bytes())
    # The library links against this Python's libtorch_python: one build per Python too.
    digest.update(f"{sys.version_info[:2]} {_CFLAGS}".encode())
    return digest.hexdigest()[:16]


# ---- torch.emu: the device module PyTorch looks up by the device's name ----------------


def _is_available() -> bool:
    return True


def _device_count() -> int:
    return 1


def _current_device() -> int:
    return 0


def _is_initialized() -> bool:
    return True


def _device(device: object) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()  # one device: selecting it changes nothing


def _synchronize(device: object = None) -> None:
    torch.accelerator.synchronize()


def _get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def _is_in_bad_fork() -> bool:
    return False


def _manual_seed_all(seed: int) -> None:
    """Nothing to seed: random numbers on the device come from the CPU's generator (the
    CPU kernel runs on the device's memory), which ``torch.manual_seed`` seeds."""


def _get_rng_state(device: object = None) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: object = None) -> None:
    torch.set_rng_state(state)


def _device_module() -> types.ModuleType:
    module = types.ModuleType(f"torch.{DEVICE_NAME}", "The emulated device (gradient_cache).")
    module.is_available = _is_available  # type: ignore[attr-defined]
    module.device_count = _device_count  # type: ignore[attr-defined]
    module.current_device = _current_device  # type: ignore[attr-defined]
    module.is_initialized = _is_initialized  # type: ignore[attr-defined]
    module.device = _device  # type: ignore[attr-defined]
    module.synchronize = _synchronize  # type: ignore[attr-defined]
    module.get_amp_supported_dtype = _get_amp_supported_dtype  # type: ignore[attr-defined]
    module._is_in_bad_fork = _is_in_bad_fork  # type: ignore[attr-defined]
    module.manual_seed_all = _manual_seed_all  # type: ignore[attr-defined]
    module.get_rng_state = _get_rng_state  # type: ignore[attr-defined]
    module.set_rng_state = _set_rng_state  # type: ignore[attr-defined]
    return module
