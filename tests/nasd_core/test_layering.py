"""nasd_core's packages import only those below them (docs/development.md): no circle, no arrow
up. Read from the source's import statements, lazy ones inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "nasd_core"
# Bottom up: a package may import its own modules and those of lower ranks.
RANKS = {"native": 0, "layers": 1, "loader": 2, "runner": 2, "speculation": 3, "engine": 4}


def imported_packages(path: Path) -> set[str]:
    """The nasd_core subpackages of RANKS that ``path`` imports from."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "nasd_core" and len(parts) > 1 and parts[1] in RANKS:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(RANKS))
def test_a_package_imports_only_those_below_it(package):
    assert (PACKAGE / package).is_dir()
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for other in imported_packages(path) - {package}:
            assert RANKS[other] < RANKS[package], f"{path.relative_to(PACKAGE)} imports nasd_core.{other}"


def test_the_check_sees_an_arrow_up(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("def f():\n    from nasd_core.engine import engine\n")
    assert imported_packages(module) == {"engine"}
