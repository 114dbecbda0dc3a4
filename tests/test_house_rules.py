"""The house rules of docs/ARCHITECTURE.md that the import lines and attribute reads show,
checked on the source files (no import of the package: a rule holds whatever runs).

* The engine imports only the engine and the codecs; the codecs only the codecs. Every
  import counts: module level, inside a function, and under ``typing.TYPE_CHECKING`` (an
  annotation on a facade type is a dependency on it too; engine/budget.py's annotation on
  the Pipeline is inside the engine).
* Nothing outside ``engine/`` reaches a private member (``_name``, not a dunder) that the
  manager (`GradientCacheHookManager`) or a class of ``engine/`` defines: the package's
  modules outside the engine, the integrations and perf/ use the public faces
  (``manager.engine`` is how a benchmark looks inside the engine). A private member of
  another library (torch's ``_foreach_norm``, ``optimizer._optimizer_step_pre_hooks``) is
  not the project's and is not counted, unless one of our classes defines the same name
  (then rename ours, or read that library through a public name).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradient_cache"
ENGINE = PACKAGE / "engine"
CODECS = PACKAGE / "codecs"


def module_name(path: Path) -> str:
    """``gradient_cache/engine/pipeline.py`` -> ``gradient_cache.engine.pipeline``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, *, is_package: bool) -> Iterator[tuple[int, str]]:
    """Each module an import line of ``source`` (the module ``module``) names, absolute:
    ``from .. import stats`` names ``gradient_cache.stats``, ``from ..stats import MIB``
    names ``gradient_cache.stats``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            if node.level and node.module:
                base = f"{base}.{node.module}"
            elif not node.level:
                base = node.module or ""
            # `from X import name` may name a submodule of X: count X.name as imported.
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def under(name: str, packages: tuple[str, ...]) -> bool:
    """Whether ``name`` is one of ``packages`` or inside one."""
    return any(name == p or name.startswith(f"{p}.") for p in packages)


def outside(name: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``name`` is the package's but under none of the ``allowed`` packages."""
    return under(name, ("gradient_cache",)) and not under(name, allowed)


def import_violations(
    source: str, module: str, allowed: tuple[str, ...], *, is_package: bool = False
) -> list[str]:
    return [
        f"{module}:{line} imports {name}"
        for line, name in imported_modules(source, module, is_package=is_package)
        if outside(name, allowed)
    ]


def tree_violations(folder: Path, allowed: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        found += import_violations(
            path.read_text(), module_name(path), allowed, is_package=path.name == "__init__.py"
        )
    return found


ENGINE_MAY_IMPORT = ("gradient_cache.engine", "gradient_cache.codecs")
CODECS_MAY_IMPORT = ("gradient_cache.codecs",)


def test_the_engine_imports_only_the_engine_and_the_codecs() -> None:
    found = tree_violations(ENGINE, ENGINE_MAY_IMPORT)
    assert found == [], "the engine imports the engine and the codecs only:\n" + "\n".join(found)


def test_the_codecs_import_nothing_outside_the_codecs() -> None:
    found = tree_violations(CODECS, CODECS_MAY_IMPORT)
    assert found == [], "the codecs import the codecs only:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "from ..stats import MIB",
        "from .. import manager",
        "from .. import __version__",
        "import gradient_cache.planner",
        "from gradient_cache.integrations import optimize",
        "def f():\n    from ..demo import run",
        "if TYPE_CHECKING:\n    from ..manager import GradientCacheHookManager",
    ],
)
def test_the_import_rule_sees_each_way_of_importing_the_facade(line: str) -> None:
    """The checker itself: each spelling of an import of the facade from an engine module
    is seen, and the engine's and the codecs' own imports are not."""
    assert import_violations(line, "gradient_cache.engine.pipeline", ENGINE_MAY_IMPORT) != []
    allowed = "from . import sharding\nfrom ..codecs import TopK\nimport torch\n"
    allowed += "import gradient_cache.engine.route\nfrom .. import codecs"
    assert import_violations(allowed, "gradient_cache.engine.pipeline", ENGINE_MAY_IMPORT) == []


# --- private members -------------------------------------------------------------------


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def members_defined(cls: ast.ClassDef) -> set[str]:
    """The private names a class defines: its methods (properties included), its
    class-level fields, and what its methods assign to ``self._name``."""
    names = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id == "self"
                ):
                    names.add(part.attr)
    return {name for name in names if private(name)}


def classes_of(path: Path, only: str | None = None) -> Iterator[ast.ClassDef]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and only in (None, node.name):
            yield node


def project_private_names() -> set[str]:
    """Every private name the manager class or a class of the engine defines."""
    names = set()
    for cls in classes_of(PACKAGE / "manager.py", "GradientCacheHookManager"):
        names |= members_defined(cls)
    for path in ENGINE.rglob("*.py"):
        for cls in classes_of(path):
            names |= members_defined(cls)
    return names


def private_reaches(source: str, where: str, names: set[str]) -> list[str]:
    """Each ``x._name`` in ``source``, and each ``getattr(x, "_name")`` (``setattr``,
    ``hasattr``, ``delattr``, a monkeypatch's ``setattr``), where ``_name`` is one of
    ``names`` and ``x`` is not ``self`` or ``cls`` (a class reading its own members)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner, name = node.value, node.attr
        elif isinstance(node, ast.Call) and by_name(node) and len(node.args) >= 2:
            owner, key = node.args[0], node.args[1]
            name = key.value if isinstance(key, ast.Constant) else None
        else:
            continue
        if name not in names:
            continue
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        found.append((node.lineno, f"{where}:{node.lineno} {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def by_name(call: ast.Call) -> bool:
    """Whether ``call`` reaches an attribute by a name it is given (``getattr`` and kin)."""
    function = call.func
    name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", None)
    return name in ("getattr", "setattr", "hasattr", "delattr")


def private_imports(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Each import of a private name (``from ..engine.fused_step import _clip``) from the
    engine or the manager's module."""
    owners = ("gradient_cache.engine", "gradient_cache.manager")
    return [
        f"{module}:{line} imports {name}"
        for line, name in imported_modules(source, module, is_package=is_package)
        if private(name.rpartition(".")[2]) and under(name.rpartition(".")[0], owners)
    ]


def files_outside_the_engine() -> list[Path]:
    """The package's modules outside engine/ (the integrations among them), and perf/."""
    package = [p for p in PACKAGE.rglob("*.py") if ENGINE not in p.parents]
    return sorted(package + list((ROOT / "perf").rglob("*.py")))


def test_nothing_outside_the_engine_reaches_a_private_member_of_the_manager_or_the_engine() -> None:
    names = project_private_names()
    found = []
    for path in files_outside_the_engine():
        source, where = path.read_text(), str(path.relative_to(ROOT))
        found += private_reaches(source, where, names)
        is_package = path.name == "__init__.py"
        found += private_imports(source, module_name(path), is_package=is_package)
    assert found == [], "use the public face (manager.engine, ...):\n" + "\n".join(found)


def test_the_private_member_rule_sees_the_projects_names_only() -> None:
    """The checker itself: a private member the engine defines is seen through any object
    but ``self``; a private member of torch's that the project does not define is not."""
    names = project_private_names()
    assert {"_live", "_enter"} <= names  # the manager's, the Pipeline's
    assert not {"_foreach_norm", "_orig_mod", "_optimizer_step_pre_hooks"} & names
    reaching = "manager._live()\npipeline.x._enter(s)\ngetattr(manager, '_live')"
    assert len(private_reaches(reaching, "m.py", names)) == 3
    foreign = "self._live()\nmodel._orig_mod\ntorch._foreach_norm(x)\ngetattr(m, '_orig_mod')"
    assert private_reaches(foreign, "m.py", names) == []
    module = "gradient_cache.integrations.routing"
    assert private_imports("from ..engine.fused_step import _clip", module) != []
    assert private_imports("from gradient_cache.manager import _attached", module) != []
    assert private_imports("from ..engine.pipeline import Pipeline", module) == []


def test_no_text_file_holds_a_merge_conflicts_markers() -> None:
    """A conflict resolved in one file and committed with the rest left two sides of
    docs/summary.md's table in the tree."""
    markers = ("<<<<<<< ", "=======\n", ">>>>>>> ")
    folders = ("gradient_cache", "tests", "docs", "perf", "tools", "examples", ".ci")
    texts = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in folders:
        texts += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".sh", ""}]
    marked = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in texts
        if path.is_file()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(True), 1)
        if line.startswith(markers)
    ]
    assert marked == []
