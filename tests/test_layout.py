"""The layout of ``kernels``: one package per syllabus part, infrastructure at the top, no import
cycles (lazy imports inside functions included), and chapters that name the modules they teach."""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

from tools import syllabus
from tools.notebooks import book_notebooks

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kernel_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "kernels").rglob("*.py"))}


def imported_modules(path: Path, known: set[str], importer: str) -> set[str]:
    """Every ``kernels`` module that ``path`` imports anywhere (top level or inside a function),
    with the packages whose ``__init__`` that import runs on the way (less the importer's own
    packages, which are already running when it is imported)."""
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                       for a in node.names]
        for t in targets:
            parts = t.split(".")
            found.update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in known)
    return found - own


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = kernel_modules(root)
    return {name: imported_modules(path, set(mods), name) - {name} for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}       # 1 on the current path, 2 done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between top-level packages (``kernels.attention`` ...), edges inside one dropped."""
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    out: dict[str, set[str]] = {}
    for a, bs in graph.items():
        if a == "kernels":
            continue
        out.setdefault(top(a), set()).update(top(b) for b in bs if top(b) != top(a) and b != "kernels")
    return out


def test_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail(tmp_path):
    """A lazy import inside a function still closes a cycle, and the check names it."""
    pkg = tmp_path / "kernels"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from kernels.b import y\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from kernels.a.x import g\n")
    graph = import_graph(tmp_path)
    assert find_cycle(graph) == ["kernels.a.x", "kernels.b.y", "kernels.a.x"]
    assert find_cycle(package_graph(graph)) == ["kernels.a", "kernels.b", "kernels.a"]
    (pkg / "b" / "y.py").write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_every_part_has_a_package_name():
    assert set(syllabus.KERNEL_PACKAGES) == {p["id"] for p in syllabus.parts()}


def test_kernels_holds_one_package_per_part_and_infrastructure_modules():
    part_packages = {p for p in syllabus.KERNEL_PACKAGES.values() if p}
    problems = []
    for entry in sorted(KERNELS.iterdir()):
        if entry.name.startswith(("_", ".")) or entry.name == "cuda":   # cuda/: CUDA C++ sources, not Python
            continue
        if entry.is_dir() and entry.name not in part_packages:
            problems.append(f"kernels/{entry.name}/ is not the package of a syllabus part (tools/syllabus.py)")
        if entry.is_dir() and not (entry / "__init__.py").is_file():
            problems.append(f"kernels/{entry.name}/ has no __init__.py")
        if entry.suffix == ".py" and entry.stem not in syllabus.INFRASTRUCTURE_MODULES:
            problems.append(f"kernels/{entry.name} is a mechanism outside its part's package")
    assert not problems, "\n".join(problems)


def notebook_modules(nb: dict) -> list[str]:
    return nb.get("metadata", {}).get("course", {}).get("modules", [])


def module_problems(nb: dict, relpath: str) -> list[str]:
    mods = notebook_modules(nb)
    if not mods:
        return [f"{relpath}: metadata course.modules names no kernels module"]
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    tree = ast.parse("\n".join(l for l in code.splitlines() if not l.lstrip().startswith(("%", "!"))))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
    problems = []
    for m in mods:
        if not m.startswith("kernels.") or importlib.util.find_spec(m) is None:
            problems.append(f"{relpath}: course.modules names {m!r}, which is not a module of kernels")
        elif m not in imported and m.rsplit(".", 1)[0] not in imported:   # the module, or its package
            problems.append(f"{relpath}: course.modules names {m!r}, which the notebook never imports")
    return problems


@pytest.mark.parametrize("path", book_notebooks(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_notebook_names_the_modules_it_teaches(path):
    problems = module_problems(json.loads(path.read_text()), path.relative_to(ROOT).as_posix())
    assert not problems, "\n".join(problems)


def test_module_rule_can_fail():
    cell = {"cell_type": "code", "source": "from kernels.softmax import online as sm\n"}
    nb = lambda mods: {"cells": [cell], "metadata": {"course": {"modules": mods}}}  # noqa: E731
    assert module_problems(nb(["kernels.softmax.online"]), "a") == []
    assert "names no kernels module" in module_problems(nb([]), "a")[0]
    assert "not a module of kernels" in module_problems(nb(["kernels.no_such"]), "a")[0]
    assert "never imports" in module_problems(nb(["kernels.norm.rms_norm"]), "a")[0]
