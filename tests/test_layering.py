"""The layering of docs/architecture.md, read from the import graph of ``src/tierflow``.

Every ``import`` and ``from ... import`` counts, also one inside a function (a lazy import is
still a dependency: it only runs later), except those under ``if TYPE_CHECKING:``, which
type checkers read and Python never runs. A node of the graph is a subpackage of tierflow
(``plan``, ``exec``, ``sim``, ...); ``tierflow/__init__.py`` is the node ``tierflow``. The
rules:

- no module at the package root but ``__init__.py`` and ``__main__.py``: each has a package;
- ``core/`` imports no torch and no other package of tierflow: it is what every one shares;
- ``plan/`` imports no torch: the planner is data, tested and run without a GPU;
- ``models/`` does not import ``exec/``: a model knows nothing about memory;
- ``sim/`` does not import ``train/``: the simulator prices a run without the trainer;
- ``exec/`` imports neither ``sim/`` nor ``train/``: the executor only reads a plan;
- no import cycle between nodes (cycles between the files of one package are not counted);
- no import cycle between any two modules either, type-only imports included: a circle of
  files reads as one tangle, whatever Python runs.

The checker is tested on made-up trees first, so that a rule that can no longer fail is seen.
"""
from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "tierflow"

# (importing node, imported node or top-level package, why not)
RULES = (
    ("core", "torch", "what every package shares imports no torch"),
    ("plan", "torch", "the planner is pure data and imports no torch"),
    ("models", "exec", "a model knows nothing about memory: place its tensors from outside"),
    ("sim", "train", "the simulator prices a run without importing the trainer"),
    ("exec", "sim", "the executor only reads a plan"),
    ("exec", "train", "the executor only reads a plan"),
)


@dataclass(frozen=True)
class Import:
    """One import statement's dependency: ``source`` (a dotted module) imports ``target``."""

    file: str  # relative to the source root, e.g. tierflow/models/load.py
    line: int
    source: str
    target: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target}"


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def _type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST, typing_too: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` at any depth, less those under ``if TYPE_CHECKING``
    unless ``typing_too``."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        if isinstance(child, ast.If) and _type_checking(child.test) and not typing_too:
            for orelse in child.orelse:
                yield from _statements(ast.Module(body=[orelse], type_ignores=[]))
            continue
        yield from _statements(child, typing_too)


def read_imports(root: Path, package: str = PACKAGE, typing_too: bool = False) -> list[Import]:
    """Every import of the ``.py`` files of ``root/package`` (those under ``if TYPE_CHECKING``
    only when ``typing_too``), each resolved to the module it names: a relative import to its
    absolute name, ``from pkg import name`` to ``pkg.name`` when that is a module of the
    tree, else to ``pkg``."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        here = module.split(".") if is_package else module.split(".")[:-1]
        for node in _statements(ast.parse(path.read_text(), str(path)), typing_too):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here[:len(here) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names
                        if base.split(".")[0] == package and _is_module(root, f"{base}.{a.name}")]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            found += [Import(str(rel), node.lineno, module, t) for t in targets]
    return found


def node_of(module: str, package: str = PACKAGE) -> str:
    """The graph node of a dotted module: ``tierflow.exec.offload`` -> ``exec``,
    ``tierflow`` -> ``tierflow``; outside the package its
    top-level name (``torch.nn`` -> ``torch``)."""
    parts = module.split(".")
    if parts[0] != package:
        return parts[0]
    return parts[1] if len(parts) > 1 else package


def forbidden(imports: Iterable[Import], rules=RULES) -> list[str]:
    """One line per import that a rule forbids, naming the file, the line and the import."""
    lines = []
    for imp in imports:
        for source, target, why in rules:
            if node_of(imp.source) == source and node_of(imp.target) == target:
                lines.append(f"{imp} ({source}/ must not import {target}: {why})")
    return lines


def cycles(imports: Iterable[Import], package: str = PACKAGE,
           node: Callable[[str, str], str] = node_of) -> list[str]:
    """One line per import cycle between nodes (a strongly connected set of several), naming
    every import that joins two of its nodes; ``node`` maps a module to its node (a package,
    or with ``module_itself`` each module)."""
    edges: dict[str, dict[str, list[Import]]] = {}
    for imp in imports:
        if imp.target.split(".")[0] != package:
            continue
        a, b = node(imp.source, package), node(imp.target, package)
        if a != b:
            edges.setdefault(a, {}).setdefault(b, []).append(imp)
            edges.setdefault(b, {})
    lines = []
    for group in _strongly_connected(edges):
        if len(group) < 2:
            continue
        joins = [str(imp) for a in sorted(group) for b, via in sorted(edges[a].items())
                 if b in group for imp in via]
        lines.append(f"import cycle between {', '.join(sorted(group))}: " + "; ".join(joins))
    return lines


def module_itself(module: str, package: str = PACKAGE) -> str:
    """Each module its own node (for cycles between files)."""
    return module


def _strongly_connected(edges: dict[str, dict[str, list[Import]]]) -> list[set[str]]:
    """Tarjan's strongly connected components of the graph ``edges`` (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.add(w)
                        if w == v:
                            break
                    groups.append(group)
    return groups


# ------------------------------------------------------------------- the checker, on made-up trees

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checker_names_the_file_and_the_import_a_rule_forbids(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "plan/__init__.py": "",
        "plan/ops.py": "def f():\n    import torch.nn\n",  # inside a function: counted
        "models/__init__.py": "",
        "models/load.py": "from ..exec.offload import attach\n",
        "exec/__init__.py": "",
        "exec/offload.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from ..train.loop import run\nelse:\n    import json\n"),
        "sim/__init__.py": "from .. import train\n",
        "train/__init__.py": "",
    })
    rules = (("plan", "torch", "pure"), ("models", "exec", "no memory"),
             ("sim", "train", "no trainer"), ("exec", "train", "reads a plan"))
    assert forbidden(read_imports(root), rules) == [
        "tierflow/models/load.py:1 imports tierflow.exec.offload (models/ must not import "
        "exec: no memory)",
        "tierflow/plan/ops.py:2 imports torch.nn (plan/ must not import torch: pure)",
        "tierflow/sim/__init__.py:1 imports tierflow.train (sim/ must not import train: "
        "no trainer)",
    ]  # exec's import of train is under TYPE_CHECKING: not a dependency


def test_the_checker_finds_a_cycle_between_packages_and_not_within_one(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "from .errors import Error\n",
        "errors.py": "class Error(Exception): ...\n",
        "api.py": "from .profile import head\nfrom . import errors\n",
        "profile/head.py": "from ..sim.stages import X\n",
        "sim/stages.py": "from .hardware import H\n",
        "sim/hardware.py": "def h():\n    from .stages import X\n    from ..api import fit\n",
        "plan/a.py": "from .b import B\n",
        "plan/b.py": "from .a import A\n",
    })
    imports = read_imports(root)
    assert {(i.source, i.target) for i in imports} >= {
        ("tierflow.api", "tierflow.profile.head"), ("tierflow.api", "tierflow.errors"),
        ("tierflow", "tierflow.errors")}
    assert cycles(imports) == [
        "import cycle between api, profile, sim: tierflow/api.py:1 imports tierflow.profile.head; "
        "tierflow/profile/head.py:1 imports tierflow.sim.stages; "
        "tierflow/sim/hardware.py:3 imports tierflow.api"]
    assert cycles([i for i in imports if i.file != "tierflow/sim/hardware.py"]) == []


def test_the_checker_finds_a_cycle_between_files_through_type_only_imports(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "train/__init__.py": "",
        "train/options.py": "from .roles import rule\n",
        "train/roles.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from .options import Options\n",
    })
    assert cycles(read_imports(root), node=module_itself) == []  # Python runs no circle
    assert cycles(read_imports(root, typing_too=True), node=module_itself) == [
        "import cycle between tierflow.train.options, tierflow.train.roles: "
        "tierflow/train/options.py:1 imports tierflow.train.roles; "
        "tierflow/train/roles.py:3 imports tierflow.train.options"]


# ---------------------------------------------------------------------------- the real tree

@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = read_imports(SRC)
    assert len(found) > 500 and any(i.target == "tierflow.plan.plan" for i in found)
    return found


def test_no_package_imports_what_the_layering_forbids(imports):
    found = forbidden(imports)
    assert not found, "\n".join(found)


def test_core_imports_no_other_package_of_tierflow(imports):
    found = [str(i) for i in imports if node_of(i.source) == "core"
             and i.target.split(".")[0] == PACKAGE and node_of(i.target) != "core"]
    assert not found, "\n".join(found)


def test_no_module_sits_at_the_package_root():
    loose = sorted(p.name for p in (SRC / PACKAGE).glob("*.py")
                   if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"give these modules a package: {loose}"


def test_no_import_cycle_between_packages(imports):
    found = cycles(imports)
    assert not found, "\n".join(found)


def test_no_import_cycle_between_files_type_only_imports_included():
    found = cycles(read_imports(SRC, typing_too=True), node=module_itself)
    assert not found, "\n".join(found)
