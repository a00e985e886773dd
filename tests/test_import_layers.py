"""Imports point downward: every module of the package sits in one layer, and imports only from its own layer or
the ones below, with no circle between modules anywhere.

The layers, lowest first (``LAYERS`` below is the rule; this is what it says):

1. ``errors`` — the typed errors everything raises.
2. ``custom_ops`` — canonical ops and their kernels; the serving signature a graph is served by.
3. records — ``deployment`` (the built model handed to the runtime, save and load) and ``build_report``.
4. ``runtime`` — engine, scheduler, KV pool, graphs and sampler. It sees only a ``Deployment``: it imports no
   transform, pattern, pipeline, front end or server.
5. models — the model factory, checkpoints and their formats, random weights, auto settings, preflight, planning.
6. ``autotuner``, 7. ``patterns``, 8. ``transforms`` — the passes (export, weight loading and calibration
   among them) and what they rewrite with.
9. pipeline — settings (``config``) and the pipeline that runs the passes.
10. ``verification`` — builds a reduced twin through the pipeline and serves it on the runtime.
11. ``artifact`` — saving and reloading a ``Deployment``.
12. ``frontend`` — ``LLM``, ``AsyncLLM``, chat, tool calls, reasoning.
13. api — ``autodeploy()``, the processes of a deployment over several ranks, ``autodeploy quantize``.
14. entry points — the HTTP and Triton servers, the CLI, the benchmarks, and the ``autodeploy`` package's
    public names.

A pass's module is the pass's own: outside ``transforms/`` only the package and its registry are imported, so
what passes hand each other travels through ``TransformContext``, not through another module's constants.

Imports are read with ``ast``: module level, inside functions, and under ``TYPE_CHECKING``.
``KNOWN_EXCEPTIONS`` lists what breaks the rule today and is being fixed; an entry that no longer breaks it
fails the test until it is removed.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]

PACKAGE = "autodeploy"  # the package itself (its public names, loaded lazily), not everything under it

# Lowest first; a module's layer is the one with the longest prefix of its name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("autodeploy.errors",)),
    ("custom_ops", ("autodeploy.custom_ops",)),
    ("records", ("autodeploy.deployment", "autodeploy.build_report")),
    ("runtime", ("autodeploy.runtime",)),
    ("models", ("autodeploy.models", "autodeploy.auto_settings", "autodeploy.preflight", "autodeploy.planning")),
    ("autotuner", ("autodeploy.autotuner",)),
    ("patterns", ("autodeploy.patterns",)),
    ("transforms", ("autodeploy.transforms", "autodeploy.export")),
    ("pipeline", ("autodeploy.config", "autodeploy.pipeline", "autodeploy.configs")),
    ("verification", ("autodeploy.verification",)),
    ("artifact", ("autodeploy.artifact",)),
    ("frontend", ("autodeploy.frontend",)),
    ("api", ("autodeploy.api", "autodeploy.distributed", "autodeploy.quantized_checkpoint")),
    ("entry points", ("autodeploy.serve", "autodeploy.cli", "autodeploy.bench", "autodeploy.__main__", PACKAGE)),
]

# What outside transforms/ may import of it; every other module there is a pass's own.
TRANSFORMS_SURFACE = ("autodeploy.transforms", "autodeploy.transforms.registry",
                      "autodeploy.transforms.shape_propagation")  # the pipeline's upkeep after a pass
# (importer, imported) pairs allowed to break the rules: none. An entry here fails the test once it no longer
# breaks one, so the list only shrinks.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def package_modules() -> dict[str, Path]:
    """Every module of the distribution, by its import name, from pyproject's package-dir mapping."""
    mapping = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in mapping.items():
        for path in sorted((REPOSITORY / folder).rglob("*.py")):
            parts = path.relative_to(REPOSITORY / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "autodeploy" and parts and f"autodeploy.{parts[0]}" in mapping:
                continue  # a folder mapped as a package of its own
            modules[".".join((package, *parts))] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names if alias.name.split(".")[0] == "autodeploy")
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            if source.split(".")[0] != "autodeploy":
                continue
            for alias in node.names:  # `from package import module` imports the module
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else known(source))
    return found - {None, name}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or (prefix != PACKAGE and module.startswith(prefix + "."))]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = lowest[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = lowest[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    lowest[node] = min(lowest[node], index[successor])
                continue
            work.pop()
            if work:
                lowest[work[-1][0]] = min(lowest[work[-1][0]], lowest[node])
            if lowest[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def broken_rules(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """(importer, imported) → the rule it breaks: an upward import, or a pass's module imported from outside."""
    broken = {}
    for importer, imported_set in graph.items():
        for imported in imported_set:
            if layer_of(imported) > layer_of(importer):
                broken[importer, imported] = f"upward ({LAYERS[layer_of(importer)][0]} → {LAYERS[layer_of(imported)][0]})"
            elif _is_pass_internal(imported) and not _same_pass_family(importer, imported):
                broken[importer, imported] = "a pass's own module, imported from outside transforms/"
    return broken


def _is_pass_internal(module: str) -> bool:
    return module.startswith("autodeploy.transforms.") and module not in TRANSFORMS_SURFACE


def _same_pass_family(importer: str, imported: str) -> bool:
    return (importer.startswith("autodeploy.transforms.") or importer == "autodeploy.transforms") and imported.startswith("autodeploy.transforms.")


def test_no_import_circle_and_every_import_points_downward():
    graph = import_graph()
    broken = broken_rules(graph)
    kept = {importer: {imported for imported in imported_set if (importer, imported) not in KNOWN_EXCEPTIONS}
            for importer, imported_set in graph.items()}
    found_circles = circles(kept)
    print(f"import check: {len(graph)} modules, {sum(map(len, graph.values()))} import edges, {len(LAYERS)} layers; "
          f"{len(found_circles)} circles; {len(set(broken) - KNOWN_EXCEPTIONS)} imports against the layers; "
          f"{len(KNOWN_EXCEPTIONS & set(broken))} known exceptions left")
    for edge in sorted(KNOWN_EXCEPTIONS & set(broken)):
        print(f"  known exception: {edge[0]} → {edge[1]} ({broken[edge]})")
    assert found_circles == []
    assert {edge: why for edge, why in broken.items() if edge not in KNOWN_EXCEPTIONS} == {}
    assert KNOWN_EXCEPTIONS - set(broken) == set(), "fixed: remove these from KNOWN_EXCEPTIONS"


def test_the_check_sees_circles_upward_imports_and_reaching_into_a_pass():
    graph = {"autodeploy.runtime.engine": {"autodeploy.frontend.llm"}, "autodeploy.frontend.llm": {"autodeploy.runtime.engine"},
             "autodeploy.verification": {"autodeploy.transforms.fuse_gemms", "autodeploy.transforms.registry"},
             "autodeploy.transforms.fuse_gemms": set(), "autodeploy.transforms.registry": set()}
    assert circles(graph) == [["autodeploy.frontend.llm", "autodeploy.runtime.engine"]]
    assert broken_rules(graph) == {
        ("autodeploy.runtime.engine", "autodeploy.frontend.llm"): "upward (runtime → frontend)",
        ("autodeploy.verification", "autodeploy.transforms.fuse_gemms"): "a pass's own module, imported from outside transforms/",
    }


def test_function_level_relative_and_type_checking_imports_count(tmp_path):
    package = tmp_path / "runtime"
    package.mkdir()
    (package / "engine.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autodeploy.frontend import llm\n"
        "def f():\n    from ..serve.app import build_app\n    from . import sampler\n"
    )
    modules = {"autodeploy.runtime.engine": package / "engine.py", "autodeploy.runtime.sampler": package / "sampler.py",
               "autodeploy.frontend.llm": Path("llm.py"), "autodeploy.serve.app": Path("app.py")}
    assert imported_modules("autodeploy.runtime.engine", package / "engine.py", modules) == {
        "autodeploy.frontend.llm", "autodeploy.serve.app", "autodeploy.runtime.sampler"}


def test_every_package_folder_is_in_the_distribution():
    """A non-editable install (`pip install .`, a wheel) ships only the packages pyproject lists: a folder with an
    ``__init__.py`` missing from that list imports in the checkout and fails once installed."""
    listed = set(tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in package_modules().items() if path.name == "__init__.py"}
    missing = sorted(packages - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
