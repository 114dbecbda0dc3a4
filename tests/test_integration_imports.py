"""An integration whose optional package is missing or broken says which extra installs it.

Each case makes the package unimportable in this process only (``sys.modules[name] = None``
halts its import; a stand-in module without the names the integration imports breaks it),
imports the integration module afresh, and puts ``sys.modules`` back afterwards, so it runs
whether or not the extra is installed.
"""

from __future__ import annotations

import importlib
import re
import sys
import types

import pytest

INTEGRATIONS = [
    # (integration module, the package it needs, the extra that installs it)
    ("gradient_cache.integrations.lightning", "lightning", "lightning"),
    ("gradient_cache.integrations.transformers", "transformers", "transformers"),
]
IDS = [package for _, package, _ in INTEGRATIONS]
#: The package's submodules each integration imports names from.
SUBMODULES = {"lightning": ("pytorch", "pytorch.strategies"), "transformers": ("trainer_utils",)}


def forget(monkeypatch: pytest.MonkeyPatch, module: str, package: str) -> None:
    """Drop the integration module and the package's modules from ``sys.modules`` for this
    test only, so the next import runs both afresh."""
    for name in list(sys.modules):
        if name in (module, package) or name.startswith(f"{package}."):
            monkeypatch.delitem(sys.modules, name)


def install_hint(extra: str) -> str:
    return re.escape(f"pip install 'gradient-cache[{extra}]'")


@pytest.mark.parametrize("module,package,extra", INTEGRATIONS, ids=IDS)
def test_a_missing_package_names_the_extra_that_installs_it(
    monkeypatch: pytest.MonkeyPatch, module: str, package: str, extra: str
) -> None:
    forget(monkeypatch, module, package)
    monkeypatch.setitem(sys.modules, package, None)  # "import <package>" now fails
    with pytest.raises(ModuleNotFoundError, match=install_hint(extra)) as caught:
        importlib.import_module(module)
    error = caught.value
    assert str(error).startswith(f"{module} needs {package}: ")
    # Still the missing module's name: tests/test_docs.py skips a page's block by its top
    # level ("lightning" of "lightning.pytorch").
    assert error.name.partition(".")[0] == package
    assert isinstance(error.__cause__, ModuleNotFoundError)
    assert module not in sys.modules  # a failed import leaves nothing half-made behind


@pytest.mark.parametrize("module,package,extra", INTEGRATIONS, ids=IDS)
def test_a_package_without_the_names_used_names_the_extra_and_the_cause(
    monkeypatch: pytest.MonkeyPatch, module: str, package: str, extra: str
) -> None:
    forget(monkeypatch, module, package)
    # A package that imports but lacks what the integration takes from it (a wrong
    # version, say): an empty top-level package and empty submodules.
    stand_in = types.ModuleType(package)
    stand_in.__path__ = []
    monkeypatch.setitem(sys.modules, package, stand_in)
    for submodule in SUBMODULES[package]:
        name = f"{package}.{submodule}"
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    with pytest.raises(ImportError, match=install_hint(extra)) as caught:
        importlib.import_module(module)
    assert not isinstance(caught.value, ModuleNotFoundError)
    assert "cannot import name" in str(caught.value)  # the cause, on the same line
    assert isinstance(caught.value.__cause__, ImportError)


@pytest.mark.parametrize("module,package,extra", INTEGRATIONS, ids=IDS)
def test_the_package_is_back_after_the_tests_above(module: str, package: str, extra: str) -> None:
    """monkeypatch restored sys.modules: the real integration still imports where the extra
    is installed."""
    pytest.importorskip(package)
    assert importlib.import_module(module).__name__ == module
