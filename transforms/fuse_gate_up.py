"""``fuse_gate_up`` (stage ``fuse``): each ``gated_mlp`` becomes a ``fused_gated_mlp`` over one gate/up weight.

A gated MLP's gate and up projections read the same activations: over ``cat([gate, up])`` they are one
GEMM of width ``2I`` (the activations read once, one launch instead of two, the same bytes of weights),
and the op's ``triton`` backend then computes ``act(gate) * up`` from the two halves of that GEMM's
output in one kernel. (What it gains on a GPU has not been measured yet; ``fuse_gemms``'s q/k/v fusion
is the same idea.)

Two forms are rewritten, after ``load_weights``:

- separate gate and up parameters (Llama, Qwen, Mistral, Gemma, …): concatenated once into
  ``<mlp>.gate_proj_up_proj_weight``; the originals are deleted, so no second copy is kept;
- the two halves of one parameter (Phi-3's ``gate_up_proj``, which the match stage hands ``gated_mlp``
  as ``chunk(gate_up_proj, 2)``): the op reads that parameter itself and nothing is copied.

A weight read by any other node, or under a second name (tied, shared), keeps its ``gated_mlp``.

Order with ``fuse_gemms`` (listed before it in ``configs/default.yaml``): the two passes rewrite disjoint
nodes, ``fuse_gemms`` only ``linear`` nodes and this one only ``gated_mlp`` nodes, so neither undoes the
other and either order gives the same graph. An MLP that the match stage left as separate gate and up
``linear``s over one input is fused by ``fuse_gemms`` (one GEMM and a split) and never reaches this
pass; a matched one is not a ``linear``, so ``fuse_gemms`` never groups it with the q/k/v projections
that may read the same input (parallel attention/MLP blocks such as Cohere's).

    # YAML: transforms: {fuse_gate_up: {enabled: false}} keeps gated_mlp with separate gate/up weights
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx import GraphModule

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.*)
from autodeploy.transforms.parameter_concatenation import concatenate_parameters
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

GATED_MLP = torch.ops.autodeploy.gated_mlp.default
FUSED_GATED_MLP = torch.ops.autodeploy.fused_gated_mlp.default
CHUNK = torch.ops.aten.chunk.default


def _sole_reader_parameters(gm: GraphModule) -> dict[fx.Node, torch.Tensor]:
    """``get_attr`` nodes of the parameters that one node reads, through one name and one ``get_attr``:
    those that may be concatenated and deleted (or handed to a fused op) without a second copy."""
    parameters = dict(gm.named_parameters(remove_duplicate=False))
    names = Counter(id(tensor) for tensor in parameters.values())
    reads: Counter[int] = Counter()
    found: dict[fx.Node, torch.Tensor] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        tensor = parameters.get(node.target)
        if tensor is not None:
            reads[id(tensor)] += len(node.users)
            found[node] = tensor
    return {node: tensor for node, tensor in found.items() if names[id(tensor)] == 1 and reads[id(tensor)] == 1}


def _separate_weights(node: fx.Node, sole: dict[fx.Node, torch.Tensor]) -> tuple[fx.Node, fx.Node] | None:
    """The gate and up ``get_attr`` nodes when they are two parameters of one shape, dtype and device,
    each read by this ``gated_mlp`` alone."""
    gate, up = node.args[1], node.args[2]
    if gate is up or gate not in sole or up not in sole:
        return None
    gate_tensor, up_tensor = sole[gate], sole[up]
    if gate_tensor.dim() != 2 or (gate_tensor.shape, gate_tensor.dtype, gate_tensor.device) != (
        up_tensor.shape, up_tensor.dtype, up_tensor.device
    ):
        return None
    return gate, up


def _halves_of_one_weight(node: fx.Node, sole: dict[fx.Node, torch.Tensor]) -> fx.Node | None:
    """The ``get_attr`` node of ``W`` when gate and up are ``chunk(W, 2)[0]`` and ``[1]`` (gate rows first,
    as ``fused_gated_mlp`` reads them) and nothing but this ``gated_mlp`` reads ``W`` or its halves."""
    gate, up = node.args[1], node.args[2]
    halves = (gate, up)
    if not all(isinstance(h, fx.Node) and h.target is operator.getitem and len(h.users) == 1 for h in halves):
        return None
    chunk = gate.args[0]
    if up.args[0] is not chunk or (gate.args[1], up.args[1]) != (0, 1):
        return None
    if chunk.target is not CHUNK or len(chunk.users) != 2:
        return None
    weight, chunks = chunk.args[:2]
    dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    tensor = sole.get(weight)
    if chunks != 2 or tensor is None or tensor.dim() != 2 or dim not in (0, -2) or tensor.shape[0] % 2:
        return None
    return weight


def _replace(gm: GraphModule, node: fx.Node, weight: fx.Node, obsolete: list[fx.Node]) -> None:
    """Put ``fused_gated_mlp(x, weight, down, activation)`` in ``node``'s place; erase ``obsolete`` (in order)."""
    graph = gm.graph
    x, _, _, down, activation = node.args
    with graph.inserting_before(node):
        fused = graph.call_function(FUSED_GATED_MLP, (x, weight, down, activation))
    # The module stack (what match_report and verification name the MLP by) and the value: the same shape.
    fused.meta.update(node.meta)
    value = node.meta.get("val")
    fake_mode = detect_fake_mode([value]) if value is not None else None
    if fake_mode is not None and "val" not in weight.meta:
        weight.meta["val"] = fake_mode.from_tensor(gm.get_parameter(weight.target))
    node.replace_all_uses_with(fused)
    graph.erase_node(node)
    for old in obsolete:
        graph.erase_node(old)


@register_transform("fuse_gate_up", stage="fuse")
class FuseGateUp(Transform):
    """Rewrite every ``gated_mlp`` whose gate/up weights are its own into ``fused_gated_mlp`` (one gate/up GEMM)."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        graph = module.graph
        sole = _sole_reader_parameters(module)
        nodes = list(graph.find_nodes(op="call_function", target=GATED_MLP))
        concatenated = halves = 0
        for node in nodes:
            separate = _separate_weights(node, sole)
            if separate is not None:
                target, _ = concatenate_parameters(module, [n.target for n in separate])
                with graph.inserting_before(node):
                    weight = graph.get_attr(target)
                _replace(module, node, weight, obsolete=list(separate))
                concatenated += 1
                continue
            weight = _halves_of_one_weight(node, sole)
            if weight is not None:
                gate, up = node.args[1], node.args[2]
                _replace(module, node, weight, obsolete=[gate, up, gate.args[0]])
                halves += 1
        fused = concatenated + halves
        left = len(nodes) - fused
        notes = f"{fused} gated MLPs → one gate/up GEMM each" if fused else "no gated MLP has gate/up weights of its own"
        if left:
            notes += f"; {left} left as gated_mlp (gate/up weights shared, or not one pair)"
        details = [f"{concatenated} gate/up weight pairs concatenated, {halves} already one parameter"] if fused else []
        return TransformResult(matches=fused, changed=bool(fused), notes=notes, details=details)
