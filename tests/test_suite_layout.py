"""The test suite's own layout: any test folders collect together, in one process, in any order.

No test folder is a package, so pytest puts each on sys.path and imports its modules by their bare
names. Every folder's conftest.py is imported as `conftest`, each replacing the last in sys.modules:
`from conftest import ...` gets whichever folder's conftest pytest loaded last, which depends on the
folders named on the command line and their order. Shared names therefore live in helper modules
(`tests/kv_sim.py`, `tests/scheduler/scheduler_harness.py`) whose names no other file under tests/
takes; the conftests hold fixtures.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SOURCES = sorted(TESTS.rglob("*.py"))


def imported_top_names(source: str) -> set[str]:
    """The top-level module names a module's absolute imports name, function-level ones too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    "source",
    ["from conftest import X", "import conftest", "def f():\n    import conftest as c"],
    ids=["from", "import", "in-a-function"],
)
def test_the_scan_sees_a_conftest_import(source: str) -> None:
    assert "conftest" in imported_top_names(source)


def test_no_module_imports_a_conftest() -> None:
    found = [
        str(path.relative_to(TESTS))
        for path in SOURCES
        if "conftest" in imported_top_names(path.read_text(encoding="utf-8"))
    ]
    assert not found, f"{found} import a bare `conftest`: move those names to a helper module"


def test_no_two_test_folders_hold_a_module_of_one_name() -> None:
    # Two folders' `helpers.py` would both be imported as `helpers`: the first one wins.
    folders: dict[str, list[str]] = defaultdict(list)
    for path in SOURCES:
        if path.name != "conftest.py":
            folders[path.stem].append(str(path.parent.relative_to(TESTS)))
    clashes = {name: where for name, where in folders.items() if len(where) > 1}
    assert not clashes, f"module names taken in more than one test folder: {clashes}"
