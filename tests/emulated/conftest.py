"""The tests in this folder run on the emulated device (`gradient_cache.testing`), in a
pytest run of their own (README's test command runs ``pytest tests/emulated`` after the
rest; pyproject.toml's ``norecursedirs`` keeps the first run out of here): installing the
device is for the whole process and cannot be undone (``torch.accelerator`` then answers
for it, pinning works, FSDP2 builds its default mesh on it), which the CPU tests must not
meet. The extension is built once (a minute on two cores, then cached)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gradient_cache.testing import emulated_device


@pytest.fixture(scope="session")
def installed() -> torch.device:
    return emulated_device()


@pytest.fixture
def device(installed: torch.device) -> Iterator[torch.device]:
    """Each test starts uncapped with nothing pending, and leaves the device so."""
    yield installed
    torch.accelerator.synchronize()
    emulated_device()
