"""The largest source files and functions of the package, by lines: `python scripts/code_sizes.py [--top N] [ROOT]`.

Reads the folders that install as the package (autodeploy/, transforms/, patterns/, custom_ops/, autotuner/) with
``ast``, so it can be pointed at an older checkout (``git worktree add /tmp/old <commit>``) to compare."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

FOLDERS = ("autodeploy", "transforms", "patterns", "custom_ops", "autotuner")


def sizes(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    files, functions = [], []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            name = str(path.relative_to(root))
            files.append((len(text.splitlines()), name))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.append((node.end_lineno - node.lineno + 1, f"{name}:{node.lineno} {node.name}"))
    return sorted(files, reverse=True), sorted(functions, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", nargs="?", default=Path(__file__).resolve().parents[1], type=Path)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    files, functions = sizes(args.root)
    print(f"{len(files)} files, {sum(n for n, _ in files)} lines; {len(functions)} functions")
    print("largest files:", *(f"  {n:5d}  {name}" for n, name in files[:args.top]), sep="\n")
    print("largest functions:", *(f"  {n:5d}  {name}" for n, name in functions[:args.top]), sep="\n")


if __name__ == "__main__":
    main()
