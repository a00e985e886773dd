"""Prompts that quote code to be rewritten, for issue 42's speculative-decoding benchmarks (``--dataset``).

Each prompt quotes a function of the Python standard library (a file the demo model's training held out when
possible: every 50th), then asks for it again: ``# Rewrite of the function above, same behaviour:`` and the
function's first line. The continuation often repeats the quoted code: what prompt lookup (n-gram) drafts
from, and what an edit request to a code assistant looks like. Seeded: the same file gives the same prompts.

  python scripts/code_rewrite_prompts.py --out build/code-rewrite.jsonl --count 200 --output-len 128
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path


def functions(source_dir: Path, max_lines: int) -> list[str]:
    found = []
    paths = sorted(p for p in source_dir.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.name)
    for index, path in enumerate(paths):
        if index % 50 != 49:  # the demo model's held-out files
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (UnicodeDecodeError, SyntaxError, OSError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 6 <= node.end_lineno - node.lineno + 1 <= max_lines:
                body = lines[node.lineno - 1 : node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                found.append("\n".join(line[indent:] for line in body))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-lines", type=int, default=40)
    parser.add_argument("--source-dir", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    found = functions(args.source_dir, args.max_lines)
    random.Random(args.seed).shuffle(found)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for code in found[: args.count]:
            prompt = f"{code}\n\n\n# Rewrite of the function above, same behaviour:\n{code.splitlines()[0]}\n"
            out.write(json.dumps({"prompt": prompt, "output_len": args.output_len}) + "\n")
    print(f"{min(args.count, len(found))} prompts of {len(found)} functions → {args.out}")


if __name__ == "__main__":
    main()
