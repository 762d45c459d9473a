"""The house rules of the package, checked on its source (docs/architecture.md):

- the core (everything but `integrations/`, `bench/`, `tools/` and `cli`) imports nothing from
  vLLM and nothing from those folders;
- no import circle anywhere in `kvtier`, counting imports inside functions and under
  `TYPE_CHECKING` (a lazy import is still a dependency);
- no module over 400 lines.

Each rule is also run on a small package written here that breaks it, so the checks can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvtier

PACKAGE_DIR = Path(kvtier.__file__).parent
OUTSIDE_CORE = ("integrations", "bench", "tools", "cli")
FORBIDDEN_IN_CORE = ("vllm", *(f"kvtier.{name}" for name in OUTSIDE_CORE))
MAX_LINES = 400


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `root` (a package named `package`)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module `name` (at `path`) imports, anywhere in the file; `from X import Y` counts as
    importing X.Y when that is a known module, else X."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def graph(root: Path, package: str) -> dict[str, set[str]]:
    mods = modules(root, package)
    known = set(mods)
    return {name: imports(path, name, known) for name, path in mods.items()}


def is_core(name: str, package: str) -> bool:
    parts = name.split(".")
    return len(parts) < 2 or parts[1] not in OUTSIDE_CORE


def core_violations(deps: dict[str, set[str]], package: str) -> list[str]:
    forbidden = tuple(f.replace("kvtier", package, 1) for f in FORBIDDEN_IN_CORE)
    return sorted(
        f"{name} imports {dep}"
        for name, targets in deps.items()
        if is_core(name, package)
        for dep in targets
        if any(dep == f or dep.startswith(f + ".") for f in forbidden)
    )


def cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in deps.get(v, ()):
            if w not in deps:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in deps.get(v, ()):
                found.append(sorted(component))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return found


def long_modules(root: Path) -> list[str]:
    return sorted(
        f"{path.relative_to(root)}: {n} lines"
        for path in root.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    )


def test_core_imports_nothing_from_vllm_or_the_outer_folders() -> None:
    assert core_violations(graph(PACKAGE_DIR, "kvtier"), "kvtier") == []


def test_no_import_circle() -> None:
    assert cycles(graph(PACKAGE_DIR, "kvtier")) == []


def test_no_module_over_the_size_limit() -> None:
    assert long_modules(PACKAGE_DIR) == []


@pytest.fixture()
def bad_package(tmp_path: Path) -> Path:
    """A package that breaks every rule: a core module importing vLLM and an integration, a
    lazy-import circle, and an over-long module."""
    root = tmp_path / "pkg"
    for folder in ("", "transfer", "integrations"):
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "__init__.py").write_text("")
    (root / "manager.py").write_text("from pkg.integrations import glue\nimport vllm.config\n")
    (root / "integrations" / "glue.py").write_text("from pkg import manager\n")
    (root / "transfer" / "a.py").write_text("def f():\n    from pkg.transfer import b\n")
    (root / "transfer" / "b.py").write_text("from .a import f\n")
    (root / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    return root


def test_the_checks_catch_what_they_guard(bad_package: Path) -> None:
    deps = graph(bad_package, "pkg")
    assert core_violations(deps, "pkg") == [
        "pkg.manager imports pkg.integrations.glue", "pkg.manager imports vllm.config",
    ]
    assert sorted(cycles(deps)) == [
        ["pkg.integrations.glue", "pkg.manager"], ["pkg.transfer.a", "pkg.transfer.b"],
    ]
    assert long_modules(bad_package) == [f"long.py: {MAX_LINES + 1} lines"]
