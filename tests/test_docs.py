"""The documentation runs: every Python block of README.md and docs/*.md, and the pages that
must list what the code has.

Each ```python block of a page runs here, in order, in one namespace per page (a page's
later blocks use what its earlier ones built), in a scratch folder, on the CPU. Hidden
set-up blocks (`<!-- invisible-code-block: python ... -->`, invisible on GitHub) build the
tiny models and data a snippet leaves to the reader (`model`, `dataloader`), so each
snippet shows only the calls it is about and still runs. A block that cannot run here is
preceded by `<!-- skip: next "the reason" -->` and reported as skipped with that reason; a
block whose optional extra (lightning, transformers, metaflow, eightbit) is not installed
is skipped naming the extra. Anything else that fails, fails the suite: a public name a
snippet uses that is renamed or deleted is an AttributeError or ImportError here.
docs/ARCHITECTURE.md and the generated docs/bad-inputs.md are collected like every page;
neither has a Python block today.

Why Sybil rather than pytest-codeblocks or pytest-markdown-docs: its invisible set-up
blocks keep the snippets as short as a user's code while the hidden lines they depend on sit
next to them in the page (pytest-codeblocks has no hidden blocks; pytest-markdown-docs
takes set-up from conftest hooks, away from the page), its skip directive carries a reason,
and its parsing API is called from this ordinary test file, so plain `python -m pytest`
(testpaths: tests, perf) runs the pages with no conftest change or command-line flag.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import unittest
from pathlib import Path
from typing import Any

import pytest
from sybil import Sybil
from sybil.example import Example
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

from gradient_cache.engine.config import EngineConfig
from gradient_cache.stats import CompressionSummary, LayerSummary, PoolSummary

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])
# Top-level module a snippet imports -> the extra that installs it.
EXTRAS = {
    "lightning": "lightning",
    "metaflow": "metaflow",
    "transformers": "transformers",
    "accelerate": "transformers",
    "peft": "transformers",
    "bitsandbytes": "eightbit",
}
README_WORD_LIMIT = 1200
GUIDE_PAGES = [
    "saving.md",
    "training-loop.md",
    "integrations.md",
    "devices.md",
    "options.md",
    "summary.md",
    "compression.md",
    "alternatives.md",
]


def kind(example: Example) -> str:
    """'block' (a visible ```python block), 'hidden' (set-up) or 'directive' (skip)."""
    text = example.document.text[example.start :]
    if text.startswith("```"):
        return "block"
    return "hidden" if text.startswith("<!-- invisible-code-block") else "directive"


def relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def collect() -> list[Any]:
    cases = []
    for page in PAGES:
        for index, example in enumerate(SYBIL.parse(page)):
            if kind(example) == "directive":
                continue  # a skip directive acts on the block after it
            suffix = "" if kind(example) == "block" else "-hidden"
            cases.append(pytest.param(page, index, id=f"{relative(page)}:{example.line}{suffix}"))
    return cases


class PageRun:
    """One page's examples, evaluated in order in the page's namespace, each once."""

    def __init__(self, page: Path, workdir: Path) -> None:
        self.examples = list(SYBIL.parse(page))
        self.workdir = workdir
        self.outcomes: list[tuple[str, Any]] = []
        self.missing_extra: str | None = None

    def outcome(self, index: int) -> tuple[str, Any]:
        if not self.outcomes:
            _leave_no_process_state()  # what an earlier page's failed block may have left
        while len(self.outcomes) <= index:
            self.outcomes.append(self._evaluate(self.examples[len(self.outcomes)]))
        return self.outcomes[index]

    def _evaluate(self, example: Example) -> tuple[str, Any]:
        previous = os.getcwd()
        os.chdir(self.workdir)
        try:
            example.evaluate()
        except unittest.SkipTest as skip:
            return "skipped", str(skip)
        except ModuleNotFoundError as error:
            extra = EXTRAS.get((error.name or "").partition(".")[0])
            if extra is None:
                return "failed", error
            self.missing_extra = extra
            return "skipped", f"needs the {extra} extra: pip install -e '.[{extra}]'"
        except NameError as error:
            if self.missing_extra is None:
                return "failed", error
            return "skipped", f"an earlier block needs the {self.missing_extra} extra"
        except Exception as error:
            return "failed", error
        finally:
            os.chdir(previous)
        return "passed", None


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    runs: dict[Path, PageRun] = {}

    def run_of(page: Path) -> PageRun:
        if page not in runs:
            runs[page] = PageRun(page, tmp_path_factory.mktemp(page.stem))
        return runs[page]

    yield run_of
    _leave_no_process_state()


def _leave_no_process_state() -> None:
    """Undo what a failed snippet may have left process-wide: a process group (FSDP2
    snippets), accelerate's singletons."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if "accelerate.state" in sys.modules:
        state = sys.modules["accelerate.state"]
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


# Lightning 2.6 on torch 2.13 warns about its own use of a deprecated pytree class.
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`")
@pytest.mark.parametrize("page,index", collect())
def test_block_runs(page_runs: Any, page: Path, index: int) -> None:
    status, detail = page_runs(page).outcome(index)
    if status == "skipped":
        pytest.skip(detail)
    if status == "failed":
        raise detail


def python_fences(page: Path) -> list[tuple[int, str]]:
    """(line, info string) of every fenced block of a page that looks like Python."""
    found, fence = [], None
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        match = re.match(r"^\s*(`{3,}|~{3,})\s*(\S*)", line)
        if not match:
            continue
        if fence is None:
            fence = match.group(1)
            if match.group(2).lower() in {"python", "py", "python3", "pycon", "ipython"}:
                found.append((number, match.group(2)))
        elif match.group(1).startswith(fence) and not match.group(2):
            fence = None
    return found


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_every_python_block_of_a_page_is_collected(page: Path) -> None:
    """A block tagged `py` or `Python` would be skipped silently by the parser."""
    fences = python_fences(page)
    assert [info for _, info in fences] == ["python"] * len(fences), (
        f"tag Python blocks ```python: {fences}"
    )
    blocks = [example for example in SYBIL.parse(page) if kind(example) == "block"]
    assert [example.line for example in blocks] == [line for line, _ in fences]


def test_the_options_page_lists_every_engine_option_exactly_once() -> None:
    text = (ROOT / "docs" / "options.md").read_text()
    section = text.split("## Engine options", 1)[1]
    listed = re.findall(r"^### `(\w+)`$", section, flags=re.MULTILINE)
    assert len(re.findall(r"^### ", section, flags=re.MULTILINE)) == len(listed)
    assert listed == [field.name for field in dataclasses.fields(EngineConfig)]


def table_keys(text: str, heading: str) -> list[str]:
    """The backticked first cells of the first table after ``heading``."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)


def test_the_summary_page_lists_every_key_exactly_once() -> None:
    text = (ROOT / "docs" / "summary.md").read_text()
    top = [field.name for field in dataclasses.fields(CompressionSummary)]
    assert sorted(table_keys(text, "## Keys")) == sorted([*top, "memory_saved_mb"])
    assert table_keys(text, "## Per layer") == [f.name for f in dataclasses.fields(LayerSummary)]
    assert table_keys(text, "## The pinned pool") == [
        f.name for f in dataclasses.fields(PoolSummary)
    ]


def test_the_readme_is_short_and_links_every_guide_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= README_WORD_LIMIT  # as `wc -w` counts
    for name in GUIDE_PAGES:
        assert f"(docs/{name}" in text, name


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_relative_links_of_a_page_lead_to_files(page: Path) -> None:
    text = page.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    for target in targets:
        path = target.split("#", 1)[0]
        if not path or re.match(r"^[a-z]+:", path):
            continue  # an anchor on the same page, or a web address
        assert (page.parent / path).exists(), f"{relative(page)} links to missing {target}"


HARNESS_PAGE = """\
<!-- invisible-code-block: python
size = 3
-->

```python
numbers = list(range(size))
```

<!-- skip: next "needs a GPU" -->

```python
raise AssertionError("a skipped block ran")
```

```python
import metaflow
```

```python
print(metaflow)
```

```python
assert numbers == [0, 1]
```
"""


def test_the_harness_skips_only_what_is_marked_or_missing_and_fails_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set-up carries over, a marked block is skipped with its reason, a missing extra
    skips its block and the ones that need it, and a wrong block fails."""
    page = tmp_path / "page.md"
    page.write_text(HARNESS_PAGE)
    monkeypatch.setitem(sys.modules, "metaflow", None)  # as if the extra were missing
    run = PageRun(page, tmp_path)
    outcomes = [run.outcome(index) for index in range(len(run.examples))]
    statuses = [status for status, _ in outcomes]
    assert statuses == ["passed", "passed", "passed", "skipped", "skipped", "skipped", "failed"]
    assert outcomes[3][1] == "needs a GPU"
    assert "metaflow extra" in outcomes[4][1] and "metaflow extra" in outcomes[5][1]
    assert isinstance(outcomes[6][1], AssertionError)
