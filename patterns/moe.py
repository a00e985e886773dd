"""MoE family: router scoring + top-k + experts → one ``torch.ops.autodeploy.moe``.

What a Hugging Face (5.17) MoE block exports to through the ``batched_mm`` experts path (the
``hf_moe_batched_experts`` export patch), after the cleanup passes; ``?`` marks nodes that depend on
the config or the dtype::

    router_logits = linear(x, router_weight)              # kept: it is the op's router_logits input
    scores  = softmax(to(router_logits, f32)?, -1[, f32])  # or sigmoid(router_logits)
    top     = topk(scores, k)
    weights = top[0]; div_(weights, sum(weights, [-1], True))?; to(weights, dtype)?   # norm_topk_prob
    ids     = clamp(reshape(top[1], [-1]), 0, E - 1)
    h       = squeeze(bmm(index(gate_up[E, 2I, H], [ids]), unsqueeze(repeat_interleave(x, k, 0), -1)), -1)
    gate, up = chunk(h, 2, -1)
    h       = squeeze(bmm(index(down[E, H, I], [ids]), unsqueeze(act(gate) * up, -1)), -1)
    out     = sum(view(h * unsqueeze(reshape(weights, [-1]), -1), [T, k, H]), [1])
    out     = to(out, x.dtype)?

This is matched by walking the graph backwards from each ``sum`` over the top-k dim, not by a traced
search/replacement pair: the routing half has optional casts (by dtype), an optional renormalisation,
and that renormalisation is an in-place ``div_`` on the ``topk`` output — a mutation, which traced
patterns (``torch._inductor.pattern_matcher``, ``torch.fx.subgraph_rewriter``) neither match reliably
nor remove (dead-code elimination keeps mutating nodes). One declarative pattern per combination would
be 2 renormalisations × 3 softmax spellings × 2 weight casts × 2 output casts × 4 activations. The walk
reads only ops, arguments and shapes, never parameter or module names, and proves each step (same
``topk`` for weights and ids, ``k`` equal at every use, chunk halves in gate/up order, weight shapes
``[E, 2I, H]``/``[E, H, I]``) before anything is rewritten; a block whose intermediates are read
elsewhere is left alone.

The op's semantics absorb the casts: it scores and weights in float32 and returns ``x``'s dtype.
Blocks outside the op's contract are not matched and stay as exported: GPT-OSS (expert biases,
interleaved gate/up, clamped SwiGLU, transposed weights), routers with score-correction biases or
group-limited top-k (DeepSeek-V3 style). Qwen2-MoE's shared expert and its sigmoid gate are not part
of the block and stay as separate ops.

Registered with ``register_rewrite`` as pattern ``moe_batched_experts`` in family ``moe``, so the
``match_patterns`` transform selects it like any traced pattern::

    from autodeploy.patterns.registry import apply_patterns, select_patterns

    apply_patterns(gm, select_patterns(["moe"]))   # {"moe_batched_experts": number of blocks replaced}
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.moe)
from autodeploy.custom_ops.activations import ATEN_ACTIVATIONS
from autodeploy.patterns.graph_walk import DTYPE_CASTS, VIEWS, NoMatch, Walk, is_call, node_value, require
from autodeploy.patterns.registry import register_rewrite

logger = logging.getLogger(__name__)

aten = torch.ops.aten

_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_DIVIDE = {aten.div_.Tensor, aten.div.Tensor}


@dataclass
class MoeBlock:
    """One matched block: the op's inputs and options, the node whose value the op replaces, and the
    nodes computing it (removed once the op is in place)."""

    x: Node
    router_logits: Node
    gate_up_weight: Node
    down_weight: Node
    top_k: int
    scoring: str
    renormalize: bool
    activation: str
    output: Node
    nodes: set[Node] = field(default_factory=set)




class _BlockWalk(Walk):
    """Walks one candidate block backwards from its final ``sum``, recording every node it steps over."""

    def __init__(self):
        super().__init__()
        self.clamp_max: int | None = None  # the upper bound HF clamps expert ids to, if it does

    def skip_casts(self, node: Node) -> Node:
        """Step over casts between floating dtypes: the op fixes its own compute and output dtypes."""
        while is_call(node, DTYPE_CASTS):
            source, result = node_value(node.args[0]), node_value(node)
            require(source.is_floating_point() and result.is_floating_point(), f"{node} is not a float cast")
            require(source.device == result.device, f"{node} moves between devices")
            self.nodes.add(node)
            node = node.args[0]
        return node

    def getitem(self, node, index: int) -> Node:
        """``node`` is ``source[index]`` of a multi-output op; returns the source."""
        self.step(node, {operator.getitem}, f"element {index} of a tuple")
        require(node.args[1] == index, f"{node} takes element {node.args[1]}, not {index}")
        return node.args[0]

    def flattened(self, node, rank: int) -> Node:
        """``node`` is a view or reshape of ``source`` with ``rank`` dims; returns the source."""
        arguments = self.step(node, VIEWS, "a view")
        require(node_value(node).dim() == rank, f"{node} has rank {node_value(node).dim()}, not {rank}")
        return arguments["input"]

    def unclamped(self, node: Node) -> Node:
        """Step over HF's clamp of expert ids into [0, E - 1] (for expert-parallel sentinels): on ids
        that come from ``topk`` it is the identity, provided it keeps every expert (checked later)."""
        if not (isinstance(node, Node) and node.target is aten.clamp.default):
            return node
        arguments = self.step(node, {aten.clamp.default}, "a clamp")
        is_id_range = arguments["min"] in (None, 0) and isinstance(arguments["max"], int)
        require(is_id_range, f"{node} is not a clamp to [0, E - 1]")
        self.clamp_max = arguments["max"]
        return arguments["input"]

    def last_dim_unsqueezed(self, node) -> Node:
        arguments = self.step(node, {aten.unsqueeze.default}, "an unsqueeze")
        require(arguments["dim"] % node_value(node).dim() == node_value(node).dim() - 1, f"{node} does not add a last dim")
        return arguments["input"]

    def batched_linear(self, node) -> tuple[Node, Node, Node]:
        """``squeeze(bmm(index(weight, [ids]), unsqueeze(rows, -1)), -1)`` → (weight, ids, rows)."""
        arguments = self.step(node, {aten.squeeze.dim}, "a squeeze")
        require(arguments["dim"] % 3 == 2, f"{node} does not drop the last dim")
        bmm = self.step(arguments["input"], {aten.bmm.default}, "a bmm")
        gathered = self.step(bmm["input"], {aten.index.Tensor}, "a gather of expert weights")
        indices = gathered["indices"]
        require(len(indices) == 1 and isinstance(indices[0], Node), f"{bmm['input']} is not indexed by one id tensor")
        require(node_value(gathered["input"]).dim() == 3, f"{gathered['input']} is not a stacked [E, out, in] weight")
        rows = self.last_dim_unsqueezed(bmm["mat2"])
        return gathered["input"], indices[0], rows


def _activation_name(node: Node, walk: _BlockWalk) -> tuple[str, Node]:
    """The canonical name of an activation node and its input."""
    require(isinstance(node, Node) and node.op == "call_function", f"{node} is not an activation")
    arguments = walk.step(node, {op for op, _ in ATEN_ACTIVATIONS.values()}, "an activation")
    approximate = arguments.get("approximate", "none")  # tells GELU's two kinds apart
    names = [name for name, (op, options) in ATEN_ACTIVATIONS.items()
             if op is node.target and options.get("approximate", "none") == approximate]
    require(bool(names), f"{node} is an unknown GELU approximation")
    return names[0], arguments["input"]


def _gated_activation(node: Node, walk: _BlockWalk) -> tuple[str, Node]:
    """``act(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]`` → (activation, h)."""
    arguments = walk.step(node, {aten.mul.Tensor}, "the gated product")
    for activated, up in ((arguments["input"], arguments["other"]), (arguments["other"], arguments["input"])):
        try:
            probe = _BlockWalk()
            activation, gate = _activation_name(activated, probe)
            chunk = probe.getitem(gate, 0)
            require(probe.getitem(up, 1) is chunk, "gate and up halves come from different chunks")
            chunk_arguments = probe.step(chunk, {aten.chunk.default}, "a chunk")
            require(chunk_arguments["chunks"] == 2, f"{chunk} does not split in two")
            require(chunk_arguments["dim"] % 2 == 1, f"{chunk} does not split the feature dim")
        except NoMatch:
            continue
        walk.nodes |= probe.nodes
        return activation, chunk_arguments["input"]
    raise NoMatch(f"{node} is not act(gate) * up over the halves of one projection")


def _routing(weights: Node, ids: Node, walk: _BlockWalk) -> tuple[Node, int, str, bool]:
    """From the flattened routing weights and expert ids back to the router → (logits, k, scoring, renormalize)."""
    topk = walk.getitem(walk.flattened(walk.unclamped(ids), rank=1), 1)
    top_values = walk.skip_casts(walk.flattened(weights, rank=1))
    renormalize = isinstance(top_values, Node) and top_values.target in _DIVIDE
    if renormalize:
        divide = walk.step(top_values, _DIVIDE, "a division")
        total = walk.step(divide["other"], {aten.sum.dim_IntList}, "a sum of the top-k weights")
        is_row_sum = total["input"] is divide["input"] and total["keepdim"] and total["dtype"] is None
        require(is_row_sum, "not a top-k renormalisation")
        require([dim % 2 for dim in total["dim"]] == [1], "the renormalisation does not sum over the top-k dim")
        top_values = walk.skip_casts(divide["input"])
    require(walk.getitem(top_values, 0) is topk, "routing weights and expert ids come from different top-k")
    arguments = walk.step(topk, {aten.topk.default}, "a top-k")
    require(arguments["largest"] and arguments["dim"] % 2 == 1, f"{topk} does not pick the largest scores per token")
    scores = arguments["input"]
    if isinstance(scores, Node) and scores.target in _SOFTMAX:
        softmax = walk.step(scores, _SOFTMAX, "a softmax")
        require(softmax["dim"] % 2 == 1, f"{scores} does not normalise over the experts")
        scoring, logits = "softmax", softmax["input"]
    else:
        scoring, logits = "sigmoid", walk.step(scores, {aten.sigmoid.default}, "a softmax or sigmoid")["input"]
    return walk.skip_casts(logits), arguments["k"], scoring, renormalize


def _expert_output_and_weights(product: dict) -> tuple[_BlockWalk, Node, Node, Node, Node]:
    """``expert_out * unsqueeze(weights, -1)``, either operand order → (walk, down weight, ids, gated, weights)."""
    for expert_out, weight_column in ((product["input"], product["other"]), (product["other"], product["input"])):
        walk = _BlockWalk()
        try:
            down_weight, ids, gated = walk.batched_linear(expert_out)
            return walk, down_weight, ids, gated, walk.last_dim_unsqueezed(weight_column)
        except NoMatch:
            continue
    raise NoMatch("not expert output × routing weight")


def _walk_block(anchor: Node) -> MoeBlock:
    """Prove that ``anchor`` ends an MoE block the op expresses and collect it; raises ``NoMatch`` otherwise."""
    walk = _BlockWalk()
    arguments = walk.step(anchor, {aten.sum.dim_IntList}, "a sum")
    require(not arguments["keepdim"] and arguments["dtype"] is None, f"{anchor} keeps dims or casts")
    per_token = arguments["input"]  # [T, k, H]
    is_over_top_k = node_value(per_token).dim() == 3 and [dim % 3 for dim in arguments["dim"]] == [1]
    require(is_over_top_k, f"{anchor} is not over dim 1 of 3")
    product = walk.step(walk.flattened(per_token, rank=3), {aten.mul.Tensor}, "the routing-weight product")
    probe, down_weight, ids, gated, weights = _expert_output_and_weights(product)
    walk.nodes |= probe.nodes
    activation, projected = _gated_activation(gated, walk)
    gate_up_weight, up_ids, repeated = walk.batched_linear(projected)
    require(up_ids is ids, "the two expert projections gather with different ids")
    repeat = walk.step(repeated, {aten.repeat_interleave.self_int}, "a repeat_interleave of the tokens")
    require(repeat["dim"] == 0, f"{repeated} does not repeat tokens")
    x = repeat["input"]
    router_logits, top_k, scoring, renormalize = _routing(weights, ids, walk)

    num_experts, double_intermediate, hidden = node_value(gate_up_weight).shape
    require(top_k == repeat["repeats"] == node_value(per_token).shape[1], "top-k, token repeats and summed dim differ")
    require(node_value(x).dim() == 2 and node_value(x).shape[-1] == hidden, "tokens are not [T, H], H of gate_up [E, 2I, H]")
    require(double_intermediate % 2 == 0, "gate_up weight rows do not split into gate and up halves")
    down_shape = (num_experts, hidden, double_intermediate // 2)
    require(tuple(node_value(down_weight).shape) == down_shape, "down weight is not [E, H, I]")
    logits = node_value(router_logits)
    require(logits.dim() == 2 and logits.shape[-1] == num_experts, "router logits are not [T, E]")
    require(walk.clamp_max is None or walk.clamp_max >= num_experts - 1, "the id clamp drops experts")

    # The op returns x's dtype; HF sums float32-weighted rows in float32 and casts back (Mixtral in bf16).
    output = anchor
    if node_value(anchor).dtype != node_value(x).dtype:
        users = list(anchor.users)
        require(len(users) == 1, f"{anchor} is read by more than its cast back to the tokens' dtype")
        output = users[0]
        walk.step(output, DTYPE_CASTS, "a cast of the sum back to the tokens' dtype")
        require(node_value(output).dtype == node_value(x).dtype, f"{output} does not cast back to the tokens' dtype")
    inner = walk.nodes - {x, router_logits, gate_up_weight, down_weight}
    escaping = [node for node in inner - {output} if any(user not in inner for user in node.users)]
    require(not escaping, f"{escaping} also feed nodes outside the block")
    return MoeBlock(
        x, router_logits, gate_up_weight, down_weight, top_k, scoring, renormalize, activation, output, inner
    )


def match_moe_block(anchor: Node) -> MoeBlock | None:
    """The MoE block whose final ``sum`` over the top-k dim is ``anchor``, or None if it is not one."""
    try:
        return _walk_block(anchor)
    except NoMatch as reason:
        logger.debug("no MoE block at %s: %s", anchor, reason)
        return None


def find_moe_blocks(gm: GraphModule) -> list[MoeBlock]:
    """Every MoE block in ``gm``, in graph order; blocks never overlap."""
    anchors = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is aten.sum.dim_IntList]
    return [block for block in map(match_moe_block, anchors) if block is not None]


def _replace(graph: Graph, block: MoeBlock, order: dict[Node, int]) -> Node:
    with graph.inserting_before(block.output):
        moe = graph.call_function(
            torch.ops.autodeploy.moe.default,
            (block.x, block.router_logits, block.gate_up_weight, block.down_weight, block.top_k),
            {"scoring": block.scoring, "renormalize": block.renormalize, "activation": block.activation},
        )
    moe.meta.update(block.output.meta)
    block.output.replace_all_uses_with(moe)
    # Erased explicitly, users first: dead-code elimination would keep the in-place div_ and all it reads.
    for node in sorted(block.nodes, key=order.__getitem__, reverse=True):
        graph.erase_node(node)
    return moe


def replace_moe_blocks(gm: GraphModule) -> int:
    """Replace every MoE block of ``gm`` by ``torch.ops.autodeploy.moe``; returns how many were replaced.

    The graph needs ``node.meta["val"]`` (as ``torch.export`` and ``propagate_shapes`` leave it); each
    new node takes the value of the node it replaces, which has the op's shape and dtype.
    """
    blocks = find_moe_blocks(gm)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    for block in blocks:
        moe = _replace(gm.graph, block, order)
        logger.debug(
            "%s: top_k=%d %s renormalize=%s %s", moe, block.top_k, block.scoring, block.renormalize, block.activation
        )
    if blocks:
        gm.graph.lint()
        gm.recompile()
    return len(blocks)


register_rewrite("moe_batched_experts", replace_moe_blocks, family="moe")
