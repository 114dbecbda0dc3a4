"""Testing aids: an accelerator emulated on the CPU (``emulated_device``).

Importing this package builds nothing; the device's C++ extension is compiled (once, then
cached) at the first call of ``emulated_device()``.
"""

from .emulated import EmulatedDeviceError, emulated_device

__all__ = ["EmulatedDeviceError", "emulated_device"]
