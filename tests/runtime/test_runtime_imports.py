"""The runtime sees only the executable graph and its serving signature: no module of it imports the
pipeline or a transform (the signature lives in custom_ops/serving_signature.py)."""

import ast
from pathlib import Path

import autodeploy.runtime

FORBIDDEN = ("autodeploy.pipeline", "autodeploy.transforms", "autodeploy.patterns", "autodeploy.api")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_runtime_module_imports_the_pipeline_or_a_transform():
    runtime = Path(autodeploy.runtime.__file__).parent
    offenders = {
        path.name: sorted(m for m in imported_modules(path) if m.startswith(FORBIDDEN))
        for path in runtime.glob("*.py")
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
