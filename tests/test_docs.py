"""docs/architecture.md stays true to the tree: every module of the package is on its folder map,
and every rule it states names a check that exists (a test function, or a test file)."""

from __future__ import annotations

import re
from pathlib import Path

import kvtier

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE_DIR = Path(kvtier.__file__).parent


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def rule_rows(text: str) -> list[str]:
    rows = section(text, "Rules, and the check that keeps each").splitlines()
    return [r for r in rows if r.startswith("| ") and not r.startswith("| rule") and "---" not in r]


def missing_checks(row: str, root: Path) -> list[str]:
    """The checks a rule row names that do not exist; a row naming none is itself reported."""
    refs = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`|`::(\w+)`", row)
    if not refs:
        return [f"no check named: {row[:80]}"]
    missing, current = [], None
    for path, name, same_file in refs:
        if path:
            current = root / path
            if not current.is_file():
                missing.append(path)
                continue
        target = name or same_file
        if target and (current is None or not re.search(rf"^def {target}\(", current.read_text(), re.M)):
            missing.append(f"{current}::{target}")
    return missing


def unmapped_modules(text: str, package_dir: Path) -> list[str]:
    folder_map = section(text, "The folder map")
    return sorted(
        str(p.relative_to(package_dir)) for p in package_dir.rglob("*.py")
        if p.stem != "__init__" and not re.search(rf"\b{p.stem}\b", folder_map)
    )


def test_every_rule_names_checks_that_exist() -> None:
    text = ARCHITECTURE.read_text()
    rows = rule_rows(text)
    assert len(rows) >= 10
    assert [m for row in rows for m in missing_checks(row, ROOT)] == []


def test_every_module_is_on_the_folder_map() -> None:
    assert unmapped_modules(ARCHITECTURE.read_text(), PACKAGE_DIR) == []


def test_the_checks_catch_a_stale_page(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_one():\n    pass\n")
    assert missing_checks("| a rule | `tests/test_a.py::test_one`, `::test_two` |", tmp_path) == [
        f"{tmp_path / 'tests' / 'test_a.py'}::test_two"]
    assert missing_checks("| a rule | `tests/test_b.py` |", tmp_path) == ["tests/test_b.py"]
    assert missing_checks("| a rule with no check | nothing |", tmp_path) == [
        "no check named: | a rule with no check | nothing |"]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mapped.py").write_text("")
    (tmp_path / "pkg" / "forgotten.py").write_text("")
    page = "## The folder map\nmapped: it does things\n## Next\nforgotten\n"
    assert unmapped_modules(page, tmp_path / "pkg") == ["forgotten.py"]
