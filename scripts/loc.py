"""Count lines that hold code: not blank, not comment-only, not docstrings.

    python scripts/loc.py            cache + scheduler + engine (the bar of the layout issue)
    python scripts/loc.py PATH ...   any files or folders

Docstrings are found with `ast` (a string expression first in a module, class or function), so a
string literal used as a value still counts as code.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PARTS = {
    "cache": ["radixkv/cache"],
    "scheduler": ["scheduler"],
    "engine": ["radixkv/engine"],
}


def docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(path: Path) -> int:
    source = path.read_text(encoding="utf-8")
    skip = docstring_lines(ast.parse(source))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in skip:
                code.add(line)
    return len(code)


def count(paths: list[str]) -> int:
    total = 0
    for p in paths:
        path = ROOT / p
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        total += sum(code_lines(f) for f in files)
    return total


def main(argv: list[str]) -> int:
    parts = {p: [p] for p in argv} if argv else DEFAULT_PARTS
    total = 0
    for name, paths in parts.items():
        n = count(paths)
        total += n
        print(f"{name:<12} {n:>6}")
    print(f"{'total':<12} {total:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
