"""The suite's costliest files are handed out first (tests/conftest.py), so that neither
pytest-xdist worker is left alone with a 40 s file at the end of the run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest

TESTS = Path(__file__).resolve().parent


def test_every_file_named_costliest_exists_once() -> None:
    names = conftest.COSTLIEST_FIRST
    assert len(set(names)) == len(names)
    assert [name for name in names if not (TESTS / name).is_file()] == []


def test_the_costliest_files_come_first_in_their_order_and_the_rest_keep_theirs() -> None:
    first, second = conftest.COSTLIEST_FIRST[:2]
    paths = ["test_a.py", second, "test_b.py", first, "test_a.py", second]
    items = [SimpleNamespace(path=TESTS / name, at=place) for place, name in enumerate(paths)]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [(item.path.name, item.at) for item in items] == [
        (first, 3),
        (second, 1),
        (second, 5),
        ("test_a.py", 0),
        ("test_b.py", 2),
        ("test_a.py", 4),
    ]


def test_xdist_keeps_the_collection_order(pytestconfig: pytest.Config) -> None:
    pytest.importorskip("xdist")
    assert pytestconfig.option.loadscopereorder is False
