"""``fuse_rope_into_cached_attention`` (stage ``cache``): ``cached_attention(rope(q), rope(k), v, …)`` →
``cached_attention_rope(q, k, v, cos, sin, interleaved, …)``.

The fused op's kernel rotates k on its way into the paged cache and q in the same pass: per layer and
step, two rope launches and a second read of the rotated keys fewer. The pass runs after
``insert_cached_attention`` (the cached op exists only from then on) and before ``select``, which picks
the fused op's kernel like any other's.

A layer fuses when its q and k are each a ``rope``'s output (through transposes that cancel: the rope
pattern leaves ``transpose(transpose(rope(x), 1, 2), 1, 2)`` between them), both ropes read the same
cos/sin (the same nodes, or the same pure ops over the same inputs) with the same interleaving, and
each rope (and transpose) feeds only this attention. Partial rotary and interleaved pairs fuse too: the
fused op takes rope's whole contract. Layers that do not qualify keep their ropes; the report says why.

A ``backends`` preference for ``cached_attention`` chooses the unfused op's kernels: fusing would escape
it, so while there is one and none for ``cached_attention_rope``, the pass leaves the graph alone and
says so.

    # YAML: transforms: {fuse_rope_into_cached_attention: {enabled: false}} keeps rope and cached_attention apart
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx import GraphModule

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops.cached_attention import CachedAttentionArgs
from autodeploy.custom_ops.cached_attention_rope import CachedAttentionRopeArgs
from autodeploy.custom_ops.registry import positional
from autodeploy.transforms.cleanup_transposes import permutation
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)

CACHED_ATTENTION = torch.ops.autodeploy.cached_attention.default
CACHED_ATTENTION_ROPE = torch.ops.autodeploy.cached_attention_rope.default
ROPE = torch.ops.autodeploy.rope.default


@dataclass
class _Rotated:
    """An attention input that is a rope's output: the rope, its arguments and the views in between."""

    rope: fx.Node
    x: fx.Node
    cos: fx.Node
    sin: fx.Node
    interleaved: bool
    views: list[fx.Node]  # outermost (the attention's argument) first


def _rotated(node: fx.Node, name: str) -> _Rotated | str:
    """The rope whose output ``node`` is, through transposes/permutes that cancel; else why not."""
    views: list[fx.Node] = []
    dims = None
    while (step := permutation(node)) is not None:
        if len(node.users) != 1:
            return f"{name} is a view that other nodes read too"
        dims = step if dims is None else [step[d] for d in dims]  # what the chain so far picks of this input
        views.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is ROPE):
        return f"{name} is not a rope's output"
    if dims is not None and dims != list(range(len(dims))):
        return f"the views between {name}'s rope and the attention do not cancel"
    if len(node.users) != 1:
        return f"{name}'s rope feeds other nodes too"
    x, cos, sin = node.args[:3]
    interleaved = node.args[3] if len(node.args) > 3 else node.kwargs.get("interleaved", False)
    return _Rotated(node, x, cos, sin, bool(interleaved), views)


def _same_value(a, b) -> bool:
    """Whether two arguments hold one value: the same node, or the same pure op over the same inputs
    (GPT-OSS's rope pattern duplicates cos/sin once for q and once for k)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return isinstance(a, fx.Node) and isinstance(b, fx.Node) and (a is b or _same_pure_call(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[key], b[key]) for key in a)
    return type(a) is type(b) and a == b


def _same_pure_call(a: fx.Node, b: fx.Node) -> bool:
    target = a.target
    pure = (
        a.op == b.op == "call_function" and target is b.target and isinstance(target, torch._ops.OpOverload)
        and not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
    )
    return pure and _same_value(a.args, b.args) and _same_value(a.kwargs, b.kwargs)


def _erase_unused(node) -> None:
    """Erase ``node`` if nothing reads it any more (and it has no side effect), then its inputs that this
    leaves unread."""
    if isinstance(node, fx.Node) and node.op == "call_function" and not node.users and not node.is_impure():
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        for source in inputs:
            _erase_unused(source)


def _fusable(attention: fx.Node) -> tuple[_Rotated, _Rotated] | str:
    q, k = (_rotated(arg, name) for arg, name in zip(attention.args[:2], ("q", "k")))
    for found in (q, k):
        if isinstance(found, str):
            return found
    inputs = [arg for arg in attention.args if isinstance(arg, fx.Node)]
    if q.rope is k.rope or any(inputs.count(arg) > 1 for arg in attention.args[:2]):
        return "q and k are not two ropes' outputs that only they read"
    if not (_same_value(q.cos, k.cos) and _same_value(q.sin, k.sin)) or q.interleaved != k.interleaved:
        return "q and k are rotated by different angles or layouts"
    return q, k


def _fuse(graph: fx.Graph, attention: fx.Node, q: _Rotated, k: _Rotated) -> None:
    call = CachedAttentionArgs(*attention.args)  # its kwargs (an fp8 cache's scales) stay kwargs
    fused_call = CachedAttentionRopeArgs(**{**call._asdict(), "q": q.x, "k": k.x, "cos": q.cos, "sin": q.sin,
                                            "interleaved": q.interleaved})
    with graph.inserting_before(attention):
        fused = graph.call_function(CACHED_ATTENTION_ROPE, positional(fused_call), attention.kwargs)
    fused.meta = dict(attention.meta)  # the same output (value included) and module stack
    attention.replace_all_uses_with(fused)
    graph.erase_node(attention)
    for rotated in (q, k):
        for node in (*rotated.views, rotated.rope):  # each node's one user is gone by now
            graph.erase_node(node)
    for angles in (k.cos, k.sin):  # k's own copy of the angles, if it had one
        _erase_unused(angles)


@register_transform("fuse_rope_into_cached_attention", stage="cache")
class FuseRopeIntoCachedAttention(Transform):
    """Fold each layer's ``rope(q)``, ``rope(k)`` into its ``cached_attention``."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        backends = context.settings.get("backends") or {}
        if "cached_attention" in backends and "cached_attention_rope" not in backends:
            message = ("left alone: backends.cached_attention chooses the unfused op's kernels; add a "
                       "backends.cached_attention_rope preference to fuse as well")
            return TransformResult(notes=message)
        graph = module.graph
        fused = 0
        left_alone: Counter[str] = Counter()
        for attention in list(graph.find_nodes(op="call_function", target=CACHED_ATTENTION)):
            found = _fusable(attention)
            if isinstance(found, str):
                left_alone[found] += 1
                logger.debug("fuse_rope_into_cached_attention: %s left alone: %s", attention.name, found)
                continue
            _fuse(graph, attention, *found)
            fused += 1
        notes = (f"{fused} attention layers rotate q and k in their cache write ({2 * fused} ropes folded in)"
                 if fused else "no cached_attention reads rope(q) and rope(k)")
        details = [f"{count} attention layers left unfused: {reason}" for reason, count in sorted(left_alone.items())]
        return TransformResult(matches=fused, changed=bool(fused), notes=notes, details=details)
