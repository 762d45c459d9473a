"""docs/architecture.md stays true to the tree:

- every module of the package is on its folder map, and its layer order is `LAYERS`, the order
  tests/test_layering.py enforces;
- its contract table ("Where each contract lives") names modules that exist, names they define and
  methods their classes have, read by the rule the page states above the table;
- every rule of its rules table names tests, and each test it names is one pytest collects;
- tests/ mirrors the package as the folder map says.

Two things are read from source rather than run, because running them imports vLLM (10-20 s on 2
cores): pytest's collection (a `test_*.py` file's last module-level binding of a name is a
`def test...`, and the module does not opt out with `__test__ = False`; the page names no test
classes), and a module that imports vLLM at its top (its own definitions and imports; each class's
body and what its methods set on `self`, not what it inherits).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kvtier
from kvtier.ops.metrics import SPECS
from tests.test_layering import LAYERS

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE_DIR = Path(kvtier.__file__).parent
CONTRACTS = "Where each contract lives"
RULES = "Rules, and the check that keeps each"
NOT_MIRRORED = frozenset({"services"})
"""Folders of tests/ that are no folder of the package: the servers the tier tests start."""
UNTESTED_HERE = frozenset({"clib"})
"""Package folders without a tests/ folder: clib's helpers are tested through their users."""
MISSING = object()


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def table(text: str, title: str) -> list[list[str]]:
    """The cells of each body row of the table in section `title`."""
    rows = [r for r in section(text, title).splitlines() if r.startswith("| ")]
    return [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows[1:]]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# -- the folder map and the layers ------------------------------------------------------------------

def unmapped_modules(text: str, package_dir: Path) -> list[str]:
    folder_map = section(text, "The folder map")
    return sorted(
        str(p.relative_to(package_dir)) for p in package_dir.rglob("*.py")
        if p.stem != "__init__" and not re.search(rf"\b{p.stem}\b", folder_map)
    )


def page_layers(text: str) -> tuple[str, ...]:
    """The layer order the page draws: the code block of "The layers" that holds arrows."""
    block = re.search(r"```\n([^`\n]*→[^`\n]*)\n```", section(text, "The layers"))
    return tuple(p.strip() for p in block[1].split("→")) if block else ()


def unmirrored(tests_dir: Path, package_dir: Path) -> list[str]:
    """Folders of tests/ that are no folder of the package, and top-level package folders that
    have no folder in tests/ (but those the page names as exceptions)."""
    out = []
    for folder in sorted(p for p in tests_dir.rglob("*") if p.is_dir() and any(p.glob("*.py"))):
        rel = folder.relative_to(tests_dir)
        if rel.parts[0] not in NOT_MIRRORED and not (package_dir / rel).is_dir():
            out.append(f"tests/{rel.as_posix()} is no folder of the package")
    for folder in sorted(p for p in package_dir.iterdir() if (p / "__init__.py").is_file()):
        if folder.name not in UNTESTED_HERE and not (tests_dir / folder.name).is_dir():
            out.append(f"{folder.name}/ has no tests/{folder.name}/")
    return out


# -- the contract table -----------------------------------------------------------------------------

def static_module(source: str) -> SimpleNamespace:
    """A module read from its source: its top-level definitions and imports (an import as None),
    each class as a namespace of its body's names and of what its methods set on `self`, each
    function as its `ast` node."""

    def names(body: list[ast.stmt]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for node in body:
            if isinstance(node, ast.ClassDef):
                on_self = {t.attr: None for n in ast.walk(node) if isinstance(n, ast.Assign | ast.AnnAssign)
                           for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                           if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}
                out[node.name] = SimpleNamespace(**{**on_self, **names(node.body)})
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out[node.name] = node
            elif isinstance(node, ast.Import | ast.ImportFrom):
                out.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.update({t.id: None for t in targets if isinstance(t, ast.Name)})
        return out

    return SimpleNamespace(**names(ast.parse(source).body))


def load_module(path: Path, package_dir: Path, package: str) -> Any:
    """The module at `path`, imported; read from its source when it imports vLLM at its top."""
    source = path.read_text()
    if re.search(r"^(?:import|from) vllm\b", source, re.M):
        return static_module(source)
    return importlib.import_module(".".join([package, *path.relative_to(package_dir).with_suffix("").parts]))


def attribute(owner: Any, name: str) -> Any:
    """`owner.name`: an attribute it has, a dataclass field, or one its (or a base's) methods set on
    `self` (None for the last two); MISSING when there is none."""
    if hasattr(owner, name):
        return getattr(owner, name)
    if name in getattr(owner, "__dataclass_fields__", {}):
        return None
    for klass in getattr(owner, "__mro__", ()):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{name}\s*(?::[^=\n]*)?=(?!=)", source):
            return None
    return MISSING


def parameters(obj: Any) -> set[str] | None:
    """The parameter names of a callable; None when unknown or when it takes any keyword."""
    if isinstance(obj, ast.FunctionDef | ast.AsyncFunctionDef):
        a = obj.args
        return None if a.kwarg else {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
    if isinstance(obj, SimpleNamespace):
        return parameters(getattr(obj, "__init__", None))
    try:
        found = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    return None if any(p.kind is p.VAR_KEYWORD for p in found) else {p.name for p in found}


def resolve(owner: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        owner = MISSING if owner is MISSING or owner is None else attribute(owner, name)
    return owner


def is_class(obj: Any) -> bool:
    return inspect.isclass(obj) or isinstance(obj, SimpleNamespace)


def contract_problems(cells: list[str], package_dir: Path, package: str,
                      metrics: frozenset[str] = frozenset(SPECS)) -> list[str]:
    """What a contract row names that does not exist, by the rule stated above the table."""
    contract, where, holds = cells
    problems: list[str] = []
    modules: list[Any] = []
    classes: list[Any] = []
    for token in backticked(where):
        if token.endswith(".py"):
            path = package_dir / token
            modules.append(load_module(path, package_dir, package) if path.is_file() else None)
            if modules[-1] is None:
                problems.append(f"{contract}: no module {token}")
        elif not modules:
            problems.append(f"{contract}: {token} follows no module")
        elif modules[-1] is not None:
            found = resolve(modules[-1], token)
            if found is MISSING:
                problems.append(f"{contract}: its module defines no {token}")
            elif is_class(found):
                classes.append(found)
    modules = [m for m in modules if m is not None]
    for token in backticked(holds):
        call = re.fullmatch(r"(\w+(?:\.\w+)*)(?:\((.*)\))?", token)
        if re.fullmatch(r"[\w/]+\.py", token):
            if not (package_dir / token).is_file():
                problems.append(f"{contract}: no module {token}")
        elif re.fullmatch(r"kvtier_\w+", token):
            if token.removeprefix("kvtier_").removesuffix("_total") not in metrics:
                problems.append(f"{contract}: {token} is no declared metric")
        elif call and ("." in call[1] or call[2] is not None):
            head, _, rest = call[1].partition(".")
            owners = modules if rest else [*classes, *modules]
            found = next((f for o in owners if (f := attribute(o, head)) is not MISSING), MISSING)
            found = resolve(found, rest) if rest and found is not MISSING else found
            if found is MISSING:
                problems.append(f"{contract}: no {token} on what the row names")
                continue
            known = parameters(found) if call[2] else None
            for arg in (call[2] or "").split(","):
                name = arg.split("=")[0].strip()
                if known is not None and re.fullmatch(r"[a-z_]\w*", name) and name not in known:
                    problems.append(f"{contract}: {call[1]} has no parameter {name}")
    return problems


# -- the rules table --------------------------------------------------------------------------------

def collected_tests(path: Path) -> set[str]:
    """The test functions pytest collects in the file at `path` (read from its source)."""
    if not re.fullmatch(r"test_\w*\.py", path.name):
        return set()
    bound: dict[str, ast.stmt] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    opt_out = bound.get("__test__")
    if isinstance(opt_out, ast.Assign) and isinstance(opt_out.value, ast.Constant) \
            and not opt_out.value.value:
        return set()
    return {name for name, node in bound.items()
            if name.startswith("test") and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def rule_problems(cells: list[str], root: Path) -> list[str]:
    """What a rule row names that does not exist, or is no test pytest collects. In its check cell
    a backticked `tests/...py` names a test file, `tests/...py::name` a test in it, `::name` a test
    in the file named last, `name.py` a file in the folder of the file named last; a row must name
    at least one test. Any other backticked path, in either cell, must exist."""
    rule, checks = cells
    problems: list[str] = []
    current: str | None = None
    named = False
    for token in backticked(rule):
        if re.fullmatch(r"(?:[\w.-]+/)+[\w.-]+\.py", token) and not (root / token).is_file() \
                and not (root / "kvtier" / token).is_file():
            problems.append(f"no file {token}")
    for token in backticked(checks):
        ref = re.fullmatch(r"((?:[\w.-]+/)*[\w.-]+\.py)(?:::(\w+))?|::(\w+)", token)
        if ref is None:
            continue
        path, name = ref[1], ref[2] or ref[3]
        if path:
            current = path if "/" in path or current is None else f"{Path(current).parent}/{path}"
            if not (root / current).is_file():
                problems.append(f"no file {current}")
                current = None
                continue
            named = named or current.startswith("tests/")
            if current.startswith("tests/") and not name and not collected_tests(root / current):
                problems.append(f"{current} holds no test pytest collects")
        if name and (current is None or name not in collected_tests(root / current)):
            problems.append(f"{current}::{name} is not a test pytest collects")
    if not named:
        problems.append(f"no test named: {rule[:60]}")
    return problems


# -- the tests --------------------------------------------------------------------------------------

def test_every_module_is_on_the_folder_map() -> None:
    assert unmapped_modules(ARCHITECTURE.read_text(), PACKAGE_DIR) == []


def test_the_layer_order_is_the_one_enforced() -> None:
    assert page_layers(ARCHITECTURE.read_text()) == LAYERS


def test_the_contract_table_names_what_exists() -> None:
    rows = table(ARCHITECTURE.read_text(), CONTRACTS)
    assert len(rows) >= 15
    assert [p for row in rows for p in contract_problems(row, PACKAGE_DIR, "kvtier")] == []


def test_every_rule_names_tests_pytest_collects() -> None:
    rows = table(ARCHITECTURE.read_text(), RULES)
    assert len(rows) >= 20
    assert [p for row in rows for p in rule_problems(row, ROOT)] == []


def test_tests_mirror_the_package() -> None:
    assert unmirrored(ROOT / "tests", PACKAGE_DIR) == []


def test_the_checks_catch_a_stale_page(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "import pytest\n\ndef test_one():\n    pass\n\ndef helper():\n    pass\n\n"
        "def test_shadowed():\n    pass\n\ntest_shadowed = pytest.mark.skip\n")
    assert rule_problems(["a rule", "`tests/test_a.py::test_one`, `::test_two`, `::helper`"], tmp_path) == [
        "tests/test_a.py::test_two is not a test pytest collects",
        "tests/test_a.py::helper is not a test pytest collects"]
    assert rule_problems(["a rule", "`tests/test_a.py::test_shadowed`, `test_c.py`"], tmp_path) == [
        "tests/test_a.py::test_shadowed is not a test pytest collects", "no file tests/test_c.py"]
    assert rule_problems(["a rule in `gone/away.py`", "`tests/test_b.py`"], tmp_path) == [
        "no file gone/away.py", "no file tests/test_b.py", "no test named: a rule in `gone/away.py`"]
    assert rule_problems(["a rule with no check", "nothing"], tmp_path) == [
        "no test named: a rule with no check"]

    def row(where: str, holds: str) -> list[str]:
        return contract_problems(["c", where, holds], PACKAGE_DIR, "kvtier")

    assert row("`host/tier.py` `HostTier`", "`reserve()` → `commit(success)`, `check()`") == []
    assert row("`host/tier.py` `HostTeir`", "") == ["c: its module defines no HostTeir"]
    assert row("`host/tear.py` `HostTier`", "") == ["c: no module host/tear.py"]
    assert row("`host/tier.py` `HostTier`", "`prepare_store()` → `commit(succes)`; `HostTier.gone`") == [
        "c: no prepare_store() on what the row names", "c: commit has no parameter succes",
        "c: no HostTier.gone on what the row names"]
    assert row("`tiers/base.py` `SecondaryTier`",
               "`JobResult(success=False, keys=...)`, `kvtier_nothing_total`, `tiers/gone.py`") == [
        "c: JobResult has no parameter keys", "c: kvtier_nothing_total is no declared metric",
        "c: no module tiers/gone.py"]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "conn.py").write_text(
        "import vllm\n\nclass Conn:\n    def __init__(self):\n        self.planner = None\n\n"
        "    def hook(self, request):\n        pass\n")
    assert contract_problems(["c", "`conn.py` `Conn`", "`Conn.planner`, `hook(request)`, `hook(req)`, "
                              "`Conn.copier`"], tmp_path / "pkg", "pkg") == [
        "c: hook has no parameter req", "c: no Conn.copier on what the row names"]

    (tmp_path / "pkg" / "mapped.py").write_text("")
    (tmp_path / "pkg" / "forgotten.py").write_text("")
    page = "## The folder map\nmapped conn: they do things\n## Next\nforgotten\n"
    assert unmapped_modules(page, tmp_path / "pkg") == ["forgotten.py"]
    assert page_layers("## The layers\n\n```\nformat → host → engine\n```\n") == ("format", "host", "engine")
    for folder in ("pkg/host", "pkg/clib", "tests/host", "tests/lost", "tests/services"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "engine").mkdir()
    (tmp_path / "pkg" / "engine" / "__init__.py").write_text("")
    assert unmirrored(tmp_path / "tests", tmp_path / "pkg") == [
        "tests/lost is no folder of the package", "engine/ has no tests/engine/"]
