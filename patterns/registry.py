"""The pattern registry: rewrites that turn aten subgraphs of an exported model into canonical ops.

A pattern is a *search* function and a *replacement* function, plain PyTorch over tensors, built on
``torch._inductor.pattern_matcher`` (``register_replacement`` with a pre-traced search pattern):

* the search function is traced once per dtype in ``dtypes`` to the aten IR ``torch.export`` produces,
  with casts to the dtype a tensor already has dropped, as the cleanup stage drops them from the model
  (so a float32 model has no casts where a bfloat16 one keeps them), and turned into a pattern;
* a subgraph matches when it has the same ops wired the same way with the same literal arguments, its
  intermediate values are used nowhere else, and ``extra_check`` agrees. Scalar parameters of the search
  function (``eps``, a hidden size that appears as a literal) match any value: ``scalar_workaround``
  gives each a distinctive example value so the traced literal is recognised as that parameter;
* the replacement is traced on the matched values (symbolic batch/seq sizes, real dtypes) and spliced in,
  so its nodes carry correct ``meta["val"]``. One trace serves every match with the same signature.

Matching reads only ops, arguments and how values flow, never node, parameter or module names.
Patterns belong to a family; the ``match_patterns`` transform applies families in ``FAMILIES`` order
and, within a family, patterns in registration order (register the more specific spelling first).
A rewrite that cannot be written as one search function (optional steps, in-place ops) registers as
a graph pass with :func:`register_rewrite` and is selected the same way.

```python
import torch
from autodeploy.patterns import register_pattern

def search(x, weight):
    return torch.nn.functional.linear(torch.relu(x), weight)

def replace(x, weight):
    return torch.ops.autodeploy.linear(torch.relu(x), weight, None)

register_pattern("relu_linear", search, replace, [torch.empty(2, 8), torch.empty(4, 8)], family="mlp")
```
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._inductor.pattern_matcher import (
    CallFunction,
    Match,
    PatternMatcherPass,
    fx_to_pattern,
    is_match,
    register_replacement,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.operator_schemas import normalize_function
from torch.utils import _pytree as pytree

from autodeploy.errors import AutoDeployError, ConfigError
from autodeploy.patterns.graph_walk import TO_CASTS

# Application order. MoE before MLP: an expert's feed-forward must not be taken for a dense MLP.
FAMILIES: tuple[str, ...] = ("rope", "attention", "norm", "moe", "mlp")


class PatternRegistrationError(AutoDeployError):
    """A pattern cannot be registered: unknown family, taken name, or a replacement that disagrees with its search."""


@dataclass(frozen=True)
class Pattern:
    """A registered pattern. ``rewrite(gm)`` rewrites ``gm.graph`` in place and returns the number of matches."""

    name: str
    family: str
    rewrite: Callable[[GraphModule], int]


_REGISTRY: dict[str, Pattern] = {}


def trace_export_ir(fn: Callable, args: Sequence[Any]) -> GraphModule:
    """Trace ``fn`` to the pre-dispatch aten IR of ``torch.export``, minus casts that change nothing.

    Export traces with cuDNN off (so ``layer_norm`` records ``cudnn_enable=False``); so does this.
    Print ``trace_export_ir(search, example_args).graph`` to see what a search function has to match.
    """
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=False):
        gm = make_fx(fn, pre_dispatch=True)(*args)
    _drop_identity_casts(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _drop_identity_casts(graph: Graph) -> None:
    """Casts to the dtype and device a tensor already has, as ``cleanup_noop`` removes them from models."""
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in TO_CASTS]:
        source, result = node.args[0].meta.get("val"), node.meta.get("val")
        normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if normalized is None or normalized.kwargs.get("copy") or source is None or result is None:
            continue
        if source.dtype == result.dtype and source.device == result.device:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def register_pattern(
    name: str,
    search: Callable[..., Any],
    replace: Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    family: str,
    scalar_workaround: dict[str, float | int] | None = None,
    extra_check: Callable[[Match], bool] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16),
) -> Pattern:
    """Register ``search`` → ``replace`` under ``name`` in ``family``; returns the registered pattern.

    ``replace`` takes the same parameters as ``search``, in the same order. ``example_inputs`` are the
    tensor arguments (floating ones are cast to each of ``dtypes``); scalar parameters take their value
    from ``scalar_workaround``. A size that the traced graph holds as a literal (``layer_norm``'s
    normalized shape) must be such a scalar parameter, or the pattern only matches the example's size.
    ``extra_check(match)`` may reject a match; ``match.kwargs`` maps each parameter name to the matched
    node (or scalar).

    Both functions run here on fake copies of the example inputs, in every dtype; the search function
    is traced when the pattern is first applied. Raises :class:`PatternRegistrationError` when the
    family is unknown, the name is taken, either function fails on the examples, or ``replace``
    returns other shapes or dtypes than ``search``.
    """
    _check_new(name, family)
    scalars = dict(scalar_workaround or {})
    params = list(inspect.signature(search).parameters)
    if len(inspect.signature(replace).parameters) != len(params):
        raise PatternRegistrationError(f"pattern {name!r}: replace must take search's parameters ({', '.join(params)})")
    variants = []
    for dtype in dtypes:
        tensors = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in example_inputs]
        _check_same_outputs(name, search, replace, _call_arguments(params, tensors, scalars), dtype)
        variants.append(tensors)
    pattern = Pattern(name, family, _TracedPattern(name, search, replace, variants, scalars, extra_check))
    _REGISTRY[name] = pattern
    return pattern


class _TracedPattern:
    """A search/replacement pair as a rewrite: ``self(gm)`` replaces every match and returns the count.

    The search function is traced once per dtype variant on first use (tracing costs ~20 ms, and most
    processes that import the patterns never match). ``_trace_replacement`` is the trace function handed
    to inductor for replacements: every layer of a model matches with the same signature, so one trace
    serves them all; traces hold the graph's fake tensors, so they are kept for one graph only.
    """

    def __init__(self, name, search, replace, variants, scalars, extra_check):
        self.name, self.search, self.replace = name, search, replace
        self.variants, self.scalars, self.extra_check = variants, scalars, extra_check
        self.params = list(inspect.signature(search).parameters)
        arguments = _call_arguments(self.params, variants[0], scalars)
        self.tensor_params = [p for p, value in zip(self.params, arguments) if isinstance(value, torch.Tensor)]
        self.matcher: PatternMatcherPass | None = None
        self.replacements: dict[tuple, GraphModule] = {}

    def _trace_replacement(self, fn: Callable, args: Sequence[Any], **_get_decomp_fn: Any) -> GraphModule:
        key = (fn, tuple(_signature(arg) for arg in args))
        if key not in self.replacements:
            self.replacements[key] = trace_export_ir(fn, args)
        return self.replacements[key]

    def _check(self, match: Match) -> bool:
        return _keywords_agree(match) and (self.extra_check is None or self.extra_check(match))

    def _build_matcher(self) -> PatternMatcherPass:
        matcher = PatternMatcherPass(pass_name=self.name)
        for tensors in self.variants:
            try:
                search_graph = trace_export_ir(self.search, _call_arguments(self.params, tensors, self.scalars))
            except Exception as error:  # tracing raises whatever the traced code raises
                raise PatternRegistrationError(f"pattern {self.name!r}: cannot trace the search function: {error}") from error
            register_replacement(
                self.search,
                self.replace,
                tensors,
                self._trace_replacement,
                matcher,
                extra_check=self._check,
                scalar_workaround=self.scalars,
                search_fn_pattern=fx_to_pattern(search_graph, argnames=self.params, scalar_workaround=self.scalars),
                skip_duplicates=True,  # a search without casts traces the same in every dtype
            )
        return matcher

    def __call__(self, gm: GraphModule) -> int:
        """``PatternMatcherPass.apply`` without inductor's code-generation filters (they skip CPU and meta tensors).

        Candidates are visited last to first, as inductor does, so a pattern anchored at its output claims
        the largest match before its inner nodes are tried as anchors of their own. A tensor parameter
        must bind a graph value: inductor would also bind it to a constant such as ``bias=None``.
        """
        if self.matcher is None:
            self.matcher = self._build_matcher()
        matches = 0
        self.replacements.clear()
        try:
            for (op, target), entries in self.matcher.patterns.items():
                for node in reversed(gm.graph.find_nodes(op=op, target=target)):
                    for entry in entries:
                        if node._erased:  # an earlier match consumed it
                            break
                        match = entry.pattern.match(node)
                        binds_values = is_match(match) and all(isinstance(match.kwargs.get(p), Node) for p in self.tensor_params)
                        if binds_values and entry.extra_check(match):
                            entry.apply(match, gm.graph, node)
                            matches += 1
        finally:
            self.replacements.clear()
        return matches


def _signature(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return (str(tuple(value.shape)), str(value.stride()), value.dtype, value.device)
    return (type(value).__name__, repr(value))


def register_rewrite(name: str, rewrite: Callable[[GraphModule], int], *, family: str) -> Pattern:
    """Register a rewrite written as code (it walks ``gm.graph`` itself and returns its match count)."""
    _check_new(name, family)
    pattern = Pattern(name, family, rewrite)
    _REGISTRY[name] = pattern
    return pattern


def unregister_pattern(name: str) -> None:
    """Remove a pattern (e.g. a test's); unknown names are an error."""
    if name not in _REGISTRY:
        raise PatternRegistrationError(f"no pattern named {name!r} is registered")
    del _REGISTRY[name]


def registered_patterns() -> dict[str, Pattern]:
    """Every registered pattern by name, in registration order."""
    return dict(_REGISTRY)


def select_patterns(names: Sequence[str], skip: Sequence[str] = ()) -> list[Pattern]:
    """The patterns ``names`` select (family or pattern names) minus those ``skip`` selects, in application order.

    Raises ``ConfigError`` for a name that is neither a family nor a registered pattern.
    """

    def expand(selection: Sequence[str], option: str) -> set[str]:
        chosen = set()
        for item in selection:
            if item in FAMILIES:
                chosen |= {p.name for p in _REGISTRY.values() if p.family == item}
            elif item in _REGISTRY:
                chosen.add(item)
            else:
                raise ConfigError(
                    f"transforms.match_patterns.{option}: {item!r} is neither a pattern family "
                    f"({', '.join(FAMILIES)}) nor a registered pattern ({', '.join(_REGISTRY) or 'none'}); "
                    "register your pattern (autodeploy.patterns.register_pattern) before loading the config"
                )
        return chosen

    chosen = expand(names, "patterns") - expand(skip, "skip")
    # sorted() is stable, so registration order holds within a family.
    return sorted((p for p in _REGISTRY.values() if p.name in chosen), key=lambda p: FAMILIES.index(p.family))


def apply_patterns(gm: GraphModule, patterns: Sequence[Pattern]) -> dict[str, int]:
    """Run each pattern's rewrite on ``gm`` in the given order; returns matches per pattern name."""
    return {pattern.name: pattern.rewrite(gm) for pattern in patterns}


def _check_new(name: str, family: str) -> None:
    if family not in FAMILIES:
        raise PatternRegistrationError(f"pattern {name!r}: unknown family {family!r}; families are {', '.join(FAMILIES)}")
    if name in _REGISTRY or name in FAMILIES:
        raise PatternRegistrationError(f"a pattern or family named {name!r} already exists; choose another name")


def _call_arguments(params: list[str], tensors: list[Any], scalars: dict[str, Any]) -> list[Any]:
    """The search function's arguments: scalars by parameter name, the example inputs in order for the rest."""
    remaining = iter(tensors)
    return [scalars[p] if p in scalars else next(remaining) for p in params]


def _describe(value: Any) -> str:
    leaves = [f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t) for t in pytree.tree_leaves(value)]
    return ", ".join(leaves)


def _check_same_outputs(name: str, search: Callable, replace: Callable, args: list[Any], dtype: torch.dtype) -> None:
    """Run both functions on fake copies of ``args``; their outputs must agree in structure, shape and dtype."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        try:
            expected, got = search(*args), replace(*args)
        except Exception as error:
            raise PatternRegistrationError(
                f"pattern {name!r}: search or replace failed on the {dtype} example inputs: {type(error).__name__}: {error}"
            ) from error
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    got_leaves, got_spec = pytree.tree_flatten(got)
    same = expected_spec == got_spec and all(
        (a.shape, a.dtype) == (b.shape, b.dtype) if isinstance(a, torch.Tensor) else type(a) is type(b)
        for a, b in zip(expected_leaves, got_leaves)
    )
    if not same:
        raise PatternRegistrationError(
            f"pattern {name!r}: on the {dtype} example inputs the replacement returns [{_describe(got)}] but the "
            f"search returns [{_describe(expected)}]; a replacement must produce the shapes and dtypes it replaces"
        )


def _keywords_agree(match: Match) -> bool:
    """No matched node has a keyword argument the pattern lacks, unless it holds the schema default.

    Inductor's matcher ignores such keywords: ``gelu(x)`` would match ``gelu(x, approximate="tanh")``.
    """
    for pattern, node in match.ctx.pattern_to_node.items():
        if not isinstance(pattern, CallFunction) or not isinstance(getattr(node, "target", None), torch._ops.OpOverload):
            continue
        defaults = {a.name: a.default_value for a in node.target._schema.arguments if a.has_default_value()}
        for key, value in node.kwargs.items():
            if key not in pattern.kwargs and (key not in defaults or defaults[key] != value):
                return False
    return True
