"""The house rules of the package, checked on its source (docs/architecture.md):

- the core (everything but `integrations/`, `bench/`, `tools/` and `cli`) imports nothing from
  vLLM and nothing from those folders; `integrations/` imports nothing from `bench/`, `tools/` or
  `cli`;
- the core's parts stand in one order (`LAYERS`, the data path from the format up to the request
  path) and each imports only parts before it: no back-arrow;
- no import circle anywhere in `kvtier`, counting imports inside functions and under
  `TYPE_CHECKING` (a lazy import is still a dependency);
- no module over 400 lines, at most 6 modules at the top of the package, no folder of over 20 files;
- no two modules share a name unless they play the same role in sibling folders (`SAME_ROLE`);
- a secondary tier never touches the accelerator: nothing under `tiers/` imports torch;
- nothing in the package imports a deserializer that runs code (pickle and its kin): stored chunks
  are parsed by their header, never unpickled.

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
MAX_TOP_MODULES = 6
MAX_FOLDER_FILES = 20
OUTSIDE_INTEGRATIONS = ("bench", "tools", "cli")
# The core's parts, each importing only the parts before it (a part is a top-level module or folder).
LAYERS = ("errors", "plugins", "clib", "format", "ops", "policies", "host", "tiers", "transfer", "config",
          "manager", "trace", "engine")
UNSAFE_DESERIALIZERS = ("pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib",
                        "multiprocessing.connection")  # Connection.recv unpickles
# Names several modules may share because each plays that role for its own family or command.
SAME_ROLE = frozenset({"__init__", "base", "cli", "index", "presets", "registry", "report", "runner",
                       "tier"})


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


def part(name: str) -> str:
    """The top-level module or folder a module belongs to (`kvtier.host.tier` -> `host`)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def back_arrows(deps: dict[str, set[str]], package: str, layers: tuple[str, ...]) -> list[str]:
    """Imports from a core part to a core part after it in `layers` (or to one not listed)."""
    rank = {p: i for i, p in enumerate(layers)}
    out = []
    for name, targets in deps.items():
        if not is_core(name, package) or name == package:
            continue
        for dep in targets:
            if not dep.startswith(package + ".") or part(dep) == part(name) or not is_core(dep, package):
                continue
            if rank.get(part(name), -1) <= rank.get(part(dep), len(layers)):
                out.append(f"{name} imports {dep}")
    return sorted(out)


def integration_violations(deps: dict[str, set[str]], package: str) -> list[str]:
    forbidden = tuple(f"{package}.{name}" for name in OUTSIDE_INTEGRATIONS)
    return sorted(
        f"{name} imports {dep}"
        for name, targets in deps.items()
        if part(name) == "integrations"
        for dep in targets
        if any(dep == f or dep.startswith(f + ".") for f in forbidden)
    )


def host_tier_bypasses(root: Path, deps: dict[str, set[str]], package: str) -> list[str]:
    """Where the request path (`engine/`) or an integration reaches the host tier other than
    through the manager: an import of the host tier's module, or a `<...manager>.host` attribute.
    `engine.tiering_start` alone builds the host tier, to hand it to the manager it starts."""
    builder = f"{package}.engine.tiering_start"
    out = [f"{name} imports {dep}" for name, targets in deps.items()
           if part(name) in ("engine", "integrations") and name != builder
           for dep in targets if dep == f"{package}.host.tier"]
    for folder in ("engine", "integrations"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr == "host" and \
                        ast.unparse(node.value).endswith("manager"):
                    out.append(f"{path.relative_to(root)}:{node.lineno} reads {ast.unparse(node)}")
    return sorted(out)


def crowding(root: Path) -> list[str]:
    """Too many modules at the top of the package, or too many files in one folder."""
    out = []
    top = sorted(p.name for p in root.glob("*.py"))
    if len(top) > MAX_TOP_MODULES:
        out.append(f"{len(top)} top-level modules: {', '.join(top)}")
    for folder in sorted({root, *(p.parent for p in root.rglob("*.py"))}):
        n = sum(1 for p in folder.iterdir() if p.is_file() and p.suffix == ".py")
        if n > MAX_FOLDER_FILES:
            out.append(f"{folder.relative_to(root.parent)}: {n} modules")
    return out


def shared_names(root: Path) -> list[str]:
    """Module names used by more than one module (or a module and a folder), outside `SAME_ROLE`."""
    seen: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        seen.setdefault(path.stem, []).append(str(path.relative_to(root)))
    for path in sorted(p for p in root.rglob("*") if p.is_dir() and (p / "__init__.py").exists()):
        seen.setdefault(path.name, []).append(str(path.relative_to(root)) + "/")
    return sorted(f"{n}: {', '.join(where)}" for n, where in seen.items()
                  if len(where) > 1 and n not in SAME_ROLE)


def tier_device_imports(deps: dict[str, set[str]], package: str) -> list[str]:
    return sorted(f"{name} imports {dep}" for name, targets in deps.items()
                  if part(name) == "tiers" for dep in targets
                  if dep == "torch" or dep.startswith("torch."))


def unsafe_deserializers(deps: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} imports {dep}" for name, targets in deps.items() for dep in targets
                  if any(dep == u or dep.startswith(u + ".") for u in UNSAFE_DESERIALIZERS))


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


def test_integrations_import_nothing_from_bench_tools_or_cli() -> None:
    assert integration_violations(graph(PACKAGE_DIR, "kvtier"), "kvtier") == []


def test_core_parts_import_only_earlier_parts() -> None:
    assert back_arrows(graph(PACKAGE_DIR, "kvtier"), "kvtier", LAYERS) == []


def test_every_core_part_has_a_layer() -> None:
    parts = {p.stem for p in PACKAGE_DIR.glob("*.py")} | {
        p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").exists()}
    assert sorted(parts - set(LAYERS) - set(OUTSIDE_CORE) - {"__init__"}) == []


def test_few_top_level_modules_and_no_crowded_folder() -> None:
    assert crowding(PACKAGE_DIR) == []


def test_no_two_modules_share_a_name() -> None:
    assert shared_names(PACKAGE_DIR) == []


def test_integrations_and_the_request_path_reach_the_host_tier_through_the_manager() -> None:
    assert host_tier_bypasses(PACKAGE_DIR, graph(PACKAGE_DIR, "kvtier"), "kvtier") == []


def test_no_tier_imports_torch() -> None:
    assert tier_device_imports(graph(PACKAGE_DIR, "kvtier"), "kvtier") == []


def test_nothing_imports_pickle_or_its_kin() -> None:
    assert unsafe_deserializers(graph(PACKAGE_DIR, "kvtier")) == []


def test_no_import_circle() -> None:
    assert cycles(graph(PACKAGE_DIR, "kvtier")) == []


def test_no_module_over_the_size_limit() -> None:
    assert long_modules(PACKAGE_DIR) == []


@pytest.fixture()
def bad_package(tmp_path: Path) -> Path:
    """A package that breaks every rule: a core module importing vLLM and an integration, an
    integration importing a tool, a back-arrow, a lazy-import circle, an over-long module, too
    many top-level modules, a crowded folder and two modules of one name."""
    root = tmp_path / "pkg"
    for folder in ("", "transfer", "integrations", "tools", "format", "tiers", "engine", "host"):
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "__init__.py").write_text("")
    (root / "manager.py").write_text("from pkg.integrations import glue\nimport vllm.config\n")
    (root / "integrations" / "glue.py").write_text("from pkg import manager\nfrom pkg.tools import t\n")
    (root / "tools" / "t.py").write_text("")
    (root / "host" / "tier.py").write_text("")
    (root / "engine" / "plan.py").write_text("from pkg.host.tier import HostTier\n\n"
                                             "def f(self):\n    self.manager.host.pin([])\n")
    (root / "tiers" / "disk.py").write_text(
        "import pickle\nfrom multiprocessing.connection import Connection\n\n"
        "def f():\n    import torch.cuda\n")
    (root / "transfer" / "a.py").write_text("def f():\n    from pkg.transfer import b\n")
    (root / "transfer" / "b.py").write_text("from .a import f\n")
    (root / "format" / "keys.py").write_text("from pkg.transfer import a\n")
    (root / "format" / "manager.py").write_text("")
    (root / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    for i in range(MAX_TOP_MODULES):
        (root / f"top{i}.py").write_text("")
    for i in range(MAX_FOLDER_FILES):
        (root / "tools" / f"m{i}.py").write_text("")
    return root


def test_the_checks_catch_what_they_guard(bad_package: Path) -> None:
    deps = graph(bad_package, "pkg")
    assert core_violations(deps, "pkg") == [
        "pkg.manager imports pkg.integrations.glue", "pkg.manager imports vllm.config",
    ]
    assert integration_violations(deps, "pkg") == ["pkg.integrations.glue imports pkg.tools.t"]
    assert back_arrows(deps, "pkg", ("format", "transfer", "manager")) == [
        "pkg.engine.plan imports pkg.host.tier", "pkg.format.keys imports pkg.transfer.a"]
    assert back_arrows(deps, "pkg", ("transfer", "format", "manager")) == [
        "pkg.engine.plan imports pkg.host.tier"]
    crowded = crowding(bad_package)
    assert len(crowded) == 2
    assert crowded[0].startswith(f"{MAX_TOP_MODULES + 3} top-level modules: __init__.py, long.py")
    assert crowded[1] == f"pkg/tools: {MAX_FOLDER_FILES + 2} modules"
    assert shared_names(bad_package) == ["manager: format/manager.py, manager.py"]
    assert tier_device_imports(deps, "pkg") == ["pkg.tiers.disk imports torch.cuda"]
    assert unsafe_deserializers(deps) == [
        "pkg.tiers.disk imports multiprocessing.connection", "pkg.tiers.disk imports pickle"]
    assert sorted(cycles(deps)) == [
        ["pkg.integrations.glue", "pkg.manager"], ["pkg.transfer.a", "pkg.transfer.b"],
    ]
    assert long_modules(bad_package) == [f"long.py: {MAX_LINES + 1} lines"]
    assert host_tier_bypasses(bad_package, deps, "pkg") == [
        "engine/plan.py:4 reads self.manager.host", "pkg.engine.plan imports pkg.host.tier"]
