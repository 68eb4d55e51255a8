"""The package layout: dependencies point one way and no file imports itself in a circle.

Every import counts, type-checking and function-level ones included. The layers, lowest first:
cache <- scheduler <- engine <- options <- chat, serve; kernels <- engine; bundled_model (the
default model's one-time conversion, no radixkv import) <- engine; cache <- kv_events (the KV-event
transport) <- engine. `serve` never imports `chat`, and no layer imports the package's lazy public
module `radixkv/__init__.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"radixkv": ROOT / "radixkv", "radixkv.kernels": ROOT / "kernels"}
PACKAGE_DIRS["radixkv.scheduler"] = ROOT / "scheduler"

# layer -> the layers it may import (besides itself)
ALLOWED = {
    "cache": set(),
    "scheduler": {"cache"},
    "kernels": set(),
    "bundled_model": set(),
    "kv_events": {"cache"},
    "engine": {"cache", "scheduler", "kernels", "bundled_model", "kv_events"},
    "options": {"engine"},  # the command-line table of the engine's settings
    "chat": {"cache", "scheduler", "engine", "options"},
    "serve": {"cache", "scheduler", "engine", "options"},
}


def module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "radixkv" and parts and parts[0] in ("kernels", "scheduler"):
                continue
            modules[name] = path
    return modules


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The radixkv modules `path` imports (a `from package import name` of a submodule counts
    as that submodule)."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                pkg = name.split(".")
                pkg = pkg if is_package else pkg[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + [node.module])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # radixkv/__init__.py: the public re-exports
    return parts[1] if parts[1] in ALLOWED else None


MODULES = module_files()
GRAPH = {m: imports_of(p, m, set(MODULES)) for m, p in MODULES.items()}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m)))
def test_imports_point_down_the_layers(module: str) -> None:
    layer = layer_of(module)
    assert layer is not None
    for dep in GRAPH[module]:
        dep_layer = layer_of(dep)
        assert dep_layer == layer or dep_layer in ALLOWED[layer], (
            f"{module} ({layer}) imports {dep} ({dep_layer})"
        )


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m)))
def test_no_layer_imports_the_lazy_public_module(module: str) -> None:
    # `radixkv/__init__.py` re-exports every layer's names for users; a layer importing it would
    # depend on the layers above it.
    assert "radixkv" not in GRAPH[module], f"{module} imports radixkv/__init__.py"


@pytest.mark.parametrize(
    ("low", "high"), [("serve", "chat"), ("engine", "chat"), ("engine", "serve")]
)
def test_front_doors_stay_apart(low: str, high: str) -> None:
    found = [
        m for m in MODULES if layer_of(m) == low and any(layer_of(d) == high for d in GRAPH[m])
    ]
    assert not found, f"{found} import {high}"


def test_every_file_belongs_to_a_layer() -> None:
    unplaced = [m for m in MODULES if m not in ("radixkv", "radixkv.__main__") and not layer_of(m)]
    assert not unplaced, f"add a layer for {unplaced}"


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(GRAPH[m]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_cache_stays_pure_python() -> None:
    for module, path in MODULES.items():
        if layer_of(module) != "cache":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in ("torch", "transformers", "triton"), (module, n)
                # the cache plans, the engine runs: no file, process or socket in the cache
                assert n.split(".")[0] not in ("os", "pathlib", "shutil", "socket"), (module, n)


def test_the_cache_alone_loads_no_scheduler_and_sampling_params_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\nimport radixkv.cache\n"
        "assert not [m for m in sys.modules if m.startswith('radixkv.scheduler')], 'scheduler'\n"
        "from radixkv import SamplingParams\nfrom radixkv.engine import EngineConfig\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
    )
    # From the tests folder: the repository root (with its top-level kernels/) stays off sys.path.
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
