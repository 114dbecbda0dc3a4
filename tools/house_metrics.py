"""Sizes of the engine's classes and functions, from the source (no import).

    python tools/house_metrics.py [--max-class N] [--max-function M]   (project root)

Issue 42 ("House v5") asks for the largest class in ``gradient_cache/engine/`` under 350
lines and no function there over 80. This prints every engine class's line count, largest
first, every function or method over ``--max-function`` lines (80 by default), and
``Pipeline``'s method count; with ``--max-class`` / ``--max-function`` given, it exits
with status 1 when a class or a function is longer.

A length is ``end_lineno - lineno + 1`` of the ``class`` / ``def`` node: from its first
line (the ``def``, not a decorator above it) to its last, docstring and comments inside
included, as a reader scrolls through it. Nested functions and classes are measured too,
each on its own (and also inside their parent's length).
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

ENGINE = pathlib.Path(__file__).resolve().parent.parent / "gradient_cache" / "engine"
FUNCTION_LIMIT = 80  # the bound: no function over 80 lines


@dataclass(frozen=True)
class Span:
    """A class or a function, where it is and how long it is."""

    name: str  # qualified: "Pipeline.restore", "step.<locals>.inner"
    file: str  # relative to the engine folder
    lines: int


@dataclass(frozen=True)
class Metrics:
    classes: list[Span]  # largest first
    functions: list[Span]  # every function, largest first
    methods: dict[str, int]  # per class name: its own methods (defs directly in its body)


def _walk(
    node: ast.AST, prefix: str
) -> Iterator[tuple[ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """Every class and function under ``node`` with its qualified name."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            yield child, name
            inner = ".<locals>." if not isinstance(child, ast.ClassDef) else "."
            yield from _walk(child, name + inner)
        else:
            yield from _walk(child, prefix)


def _length(node: ast.stmt) -> int:
    assert node.end_lineno is not None  # set by ast.parse on every statement
    return node.end_lineno - node.lineno + 1


def _by_size(span: Span) -> tuple[int, str, str]:
    return -span.lines, span.file, span.name


def measure(folder: pathlib.Path = ENGINE) -> Metrics:
    """Every class and function of the ``*.py`` files in ``folder`` (not its subfolders)."""
    classes: list[Span] = []
    functions: list[Span] = []
    methods: dict[str, int] = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, name in _walk(tree, ""):
            span = Span(name, path.name, _length(node))
            if isinstance(node, ast.ClassDef):
                classes.append(span)
                methods[name] = sum(
                    isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body
                )
            else:
                functions.append(span)
    return Metrics(sorted(classes, key=_by_size), sorted(functions, key=_by_size), methods)


def report(metrics: Metrics, *, max_function: int = FUNCTION_LIMIT) -> str:
    lines = ["classes in gradient_cache/engine/ (largest first):", f"  {'lines':>5}  class"]
    lines += [f"  {c.lines:5d}  {c.file}:{c.name}" for c in metrics.classes]
    long = [f for f in metrics.functions if f.lines > max_function]
    lines += ["", f"functions over {max_function} lines: {len(long)}", f"  {'lines':>5}  function"]
    lines += [f"  {f.lines:5d}  {f.file}:{f.name}" for f in long]
    lines += ["", f"Pipeline's methods: {metrics.methods.get('Pipeline', 'no Pipeline class')}"]
    return "\n".join(lines)


def breaches(metrics: Metrics, *, max_class: int | None, max_function: int | None) -> list[str]:
    """A line per class or function longer than its bound (none: within bounds)."""
    found = []
    if max_class is not None:
        found += [
            f"class {c.file}:{c.name} has {c.lines} lines > {max_class}"
            for c in metrics.classes
            if c.lines > max_class
        ]
    if max_function is not None:
        found += [
            f"function {f.file}:{f.name} has {f.lines} lines > {max_function}"
            for f in metrics.functions
            if f.lines > max_function
        ]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-class", type=int, default=None, metavar="N")
    parser.add_argument("--max-function", type=int, default=None, metavar="M")
    options = parser.parse_args(argv)
    metrics = measure()
    shown = FUNCTION_LIMIT if options.max_function is None else options.max_function
    print(report(metrics, max_function=shown))
    found = breaches(metrics, max_class=options.max_class, max_function=options.max_function)
    for line in found:
        print(f"BREACH {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
