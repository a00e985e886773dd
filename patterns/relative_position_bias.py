"""Relative position bias: Hugging Face T5's ``T5Attention.compute_bias`` → ``torch.ops.autodeploy.relative_position_bias``.

The first layer of each T5 stack looks a ``table[num_buckets, H]`` up at the bucket of every key − query
distance; every later layer reuses the result. What transformers (5.17) exports, after the cleanup stage
(``h`` = the buckets of one direction, ``num_buckets // 2`` bidirectional or ``num_buckets`` one-sided;
``e = h // 2`` exact buckets; ``?`` marks steps that cleanup keeps or drops; ``add_`` is HF's ``+=``)::

    rel      = sub(unsqueeze(key_positions, 0), add(unsqueeze(query_positions, 1), past)?)
    distance = abs(rel)                                        bidirectional (the encoder's)
             = neg(min(rel, zeros_like(rel)))                  one-sided (the decoder's self-attention)
    far      = add(to(mul(div(log(div(to(distance, f32), e)), log(max_distance / e)), h - e), i64), e)
    bucket   = where(lt(distance, e), distance, min(far, full_like(far, h - 1)))
    bucket   = add_(add(mul(to(gt(rel, 0), i64), h), 0)?, bucket)      bidirectional: keys after the query
    bias     = unsqueeze(permute(embedding(table, add(bucket, 0)?), [2, 0, 1]), 0)       [1, H, Sq, Sk]

becomes ``relative_position_bias(table, query_positions + past, key_positions, bidirectional, max_distance)``.

Every parameter is read from the graph and proven, never assumed: ``num_buckets`` is the table's rows; the
distance's form says ``bidirectional``; the direction's multiplier must be ``num_buckets // 2`` (bidirectional),
the literals of the exact buckets ``e``, of the logarithmic ones ``h - e`` and of the last bucket ``h - 1`` must
agree with it; the divisor must be exactly ``math.log(max_distance / e)`` of an integer ``max_distance > e``;
the log must run in float32 and truncate to an integer, as the op's does; the distance must be key − query.
Anything else (another formula, another precision, a bias from other positions) is left as exported. The
nodes of the subgraph must feed only each other, since they are erased (``add_`` writes in place, so
dead-code elimination would keep it). Cross-attention has no bias and nothing to match.

It belongs to the attention family: the bias is an input of the attentions that add it, and the cache stage
is to fold it into them (notes/encoder_decoder.md, section 3).

Written as a graph walk (``register_rewrite``): the literals decide the op's arguments, which a traced
replacement cannot receive, and steps are optional. It reads ops, arguments and shapes, never names.

```python
from autodeploy.patterns.relative_position_bias import replace_relative_position_bias

replaced = replace_relative_position_bias(gm)   # gm: exported + cleaned up; one per T5 stack
```
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.relative_position_bias)
from autodeploy.patterns.graph_walk import DTYPE_CASTS, NoMatch, Walk, is_call, node_value, require, same_size
from autodeploy.patterns.registry import register_rewrite

logger = logging.getLogger(__name__)

aten = torch.ops.aten

_MINIMUM = {aten.min.other, aten.minimum.default}
_ADD = {aten.add.Tensor, aten.add_.Tensor}
_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack")


@dataclass
class RelativePositionBiasMatch:
    """One matched ``compute_bias``: the op's arguments, the ``[1, H, Sq, Sk]`` node it replaces, the nodes computing it.

    ``query_offset`` is what HF adds to the query positions (``past_seen_tokens``): 0, a SymInt node or a 0-dim tensor.
    """

    table: Node
    query_positions: Node
    key_positions: Node
    query_offset: Node | int
    bidirectional: bool
    max_distance: int
    output: Node
    nodes: set[Node] = field(default_factory=set)


class _Walk(Walk):
    """Steps backwards through one candidate bias, recording every node it steps over."""

    def cast(self, node, dtypes: tuple[torch.dtype, ...], what: str) -> Node:
        """Step over a cast to one of ``dtypes``; returns its input."""
        require(is_call(node, DTYPE_CASTS) and node_value(node).dtype in dtypes, f"{node} is not {what}")
        self.nodes.add(node)
        return node.args[0]

    def plus_zero(self, node) -> Node:
        """Step over ``x + 0`` (HF's ``relative_buckets = 0; relative_buckets += x``), when cleanup kept it."""
        while is_call(node, {aten.add.Tensor}) and _literal(node.args[1], 0) and node.kwargs.get("alpha", 1) == 1:
            self.nodes.add(node)
            node = node.args[0]
        return node

    def sole_user(self, node: Node, targets, what: str) -> Node:
        require(len(node.users) == 1, f"{node} has other users than {what}")
        (user,) = node.users
        require(is_call(user, targets), f"{user} is not {what}")
        self.nodes.add(user)
        return user


def _literal(value, expected) -> bool:
    """``value`` is a number (not a bool) equal to ``expected``."""
    return type(value) in (int, float) and value == expected


def _integer(node: Node) -> bool:
    dtype = node_value(node).dtype
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


@dataclass
class _Buckets:
    """The literals of ``where(lt(d, e), d, min(far, full_like(far, last)))``, for checking against each other."""

    distance: Node
    max_exact: int
    log_buckets: int
    last_bucket: int
    divisor: float


def _buckets_of_one_direction(walk: _Walk, node) -> _Buckets:
    choice = walk.step(node, {aten.where.self}, "where(distance < e, distance, far)")
    distance = choice["input"]
    small = walk.step(choice["condition"], {aten.lt.Scalar}, "distance < e")
    require(small["input"] is distance, f"{choice['condition']} does not compare the distance")
    capped = walk.step(choice["other"], _MINIMUM, "min(far, last bucket)")
    far = capped["input"]
    last = walk.step(capped["other"], {aten.full_like.default}, "full_like(far, last bucket)")
    require(last["input"] is far and node_value(capped["other"]).dtype == node_value(far).dtype,
            f"{capped['other']} is not the last bucket like {far}")
    shifted = walk.step(far, {aten.add.Tensor}, "e + logarithmic bucket")
    require(shifted["alpha"] == 1 and _integer(far), f"{far} is not an integer e + bucket")
    scaled = walk.step(walk.cast(shifted["input"], (torch.int64,), "a truncation to int64"), {aten.mul.Tensor},
                       "log ratio × (h - e)")
    ratio = walk.step(scaled["input"], {aten.div.Tensor}, "log / log(max_distance / e)")
    logarithm = walk.step(ratio["input"], {aten.log.default}, "log")
    fraction = walk.step(logarithm["input"], {aten.div.Tensor}, "distance / e")
    # The op's log runs in float32: a float64 one can round differently at a bucket boundary.
    require(walk.cast(fraction["input"], (torch.float32,), "a cast to float32") is distance,
            f"{fraction['input']} is not the distance as float32")
    max_exact = small["other"]
    require(type(max_exact) is int and _literal(fraction["other"], max_exact) and _literal(shifted["other"], max_exact),
            f"{node} does not use one integer number of exact buckets")
    return _Buckets(distance, max_exact, scaled["other"], last["fill_value"], ratio["other"])


def _relative_position(walk: _Walk, distance: Node) -> tuple[Node, bool]:
    """``abs(rel)`` → (rel, bidirectional); ``neg(min(rel, zeros_like(rel)))`` → (rel, one-sided)."""
    if is_call(distance, {aten.abs.default}):
        return walk.step(distance, {aten.abs.default}, "abs")["input"], True
    negated = walk.step(distance, {aten.neg.default}, "abs(rel) or -min(rel, 0)")
    smaller = walk.step(negated["input"], _MINIMUM, "min(rel, 0)")
    rel = smaller["input"]
    zeros = walk.step(smaller["other"], {aten.zeros_like.default}, "zeros_like(rel)")
    require(zeros["input"] is rel and node_value(smaller["other"]).dtype == node_value(rel).dtype,
            f"{smaller['other']} is not zeros like {rel}")
    return rel, False


def _check_direction(walk: _Walk, node, rel: Node, half: int) -> None:
    """``(rel > 0).to(int) * half`` (+ 0): the buckets of keys after the query start at ``half``."""
    product = walk.step(walk.plus_zero(node), {aten.mul.Tensor}, "(rel > 0) × half")
    require(type(product["other"]) is int and product["other"] == half,
            f"{node} does not offset keys after the query by num_buckets // 2 = {half}")
    flag = product["input"]
    require(_integer(flag), f"{flag} is not an integer")
    comparison = walk.cast(flag, (node_value(flag).dtype,), "an integer cast of rel > 0")
    after = walk.step(comparison, {aten.gt.Scalar}, "rel > 0")
    require(after["input"] is rel and _literal(after["other"], 0), f"{flag} is not (rel > 0)")


def _max_distance(divisor: float, max_exact: int) -> int:
    """The integer ``max_distance`` whose ``math.log(max_distance / max_exact)`` is ``divisor``, to the bit."""
    require(type(divisor) is float and 0 < divisor < 64, f"the log divisor {divisor} is no log(max_distance / e)")
    max_distance = round(max_exact * math.exp(divisor))
    require(max_distance > max_exact and math.log(max_distance / max_exact) == divisor,
            f"the log divisor {divisor} is not log(max_distance / {max_exact}) of an integer max_distance > {max_exact}")
    return max_distance


def _integer_scalar(offset) -> bool:
    """An int, a SymInt node or a 0-dim integer tensor: what HF's ``past_seen_tokens`` can be."""
    if not isinstance(offset, Node):
        return type(offset) is int
    value = offset.meta.get("val")
    return isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and value.dim() == 0 and _integer(offset))


def _positions(walk: _Walk, rel: Node) -> tuple[Node, Node, Node | int]:
    """``sub(unsqueeze(k, 0), add(unsqueeze(q, 1), past)?)`` → (q, k, past): the distance is key − query."""
    difference = walk.step(rel, {aten.sub.Tensor}, "key - query")
    require(difference["alpha"] == 1, f"{rel} scales the query positions")
    keys = walk.step(difference["input"], {aten.unsqueeze.default}, "key_positions[None, :]")
    require(keys["dim"] in (0, -2), f"{difference['input']} is not a row of key positions")
    queries, offset = difference["other"], 0
    if is_call(queries, {aten.add.Tensor}):
        shifted = walk.step(queries, {aten.add.Tensor}, "query_positions + past")
        queries, offset = shifted["input"], shifted["other"]
        require(shifted["alpha"] == 1 and _integer_scalar(offset),
                f"{rel} shifts the query positions by something else than one integer")
    column = walk.step(queries, {aten.unsqueeze.default}, "query_positions[:, None]")
    require(column["dim"] in (1, -1), f"{queries} is not a column of query positions")
    query_positions, key_positions = column["input"], keys["input"]
    for positions in (query_positions, key_positions):
        value = node_value(positions)
        require(value.dim() == 1 and value.dtype in (torch.int32, torch.int64), f"{positions} is not 1-D integer positions")
    sizes = node_value(rel).shape
    require(len(sizes) == 2 and same_size(sizes[0], node_value(query_positions).shape[0])
            and same_size(sizes[1], node_value(key_positions).shape[0]), f"{rel} is not [queries, keys]")
    return query_positions, key_positions, offset


def match_relative_position_bias(embedding: Node) -> RelativePositionBiasMatch:
    """The ``compute_bias`` subgraph whose table lookup is ``embedding``; ``NoMatch`` says why it is not one."""
    walk = _Walk()
    lookup = walk.step(embedding, {aten.embedding.default}, "a table lookup")
    table = lookup["weight"]
    require(node_value(table).dim() == 2 and isinstance(node_value(table).shape[0], int),
            f"{table} is not a [num_buckets, H] table")
    permute = walk.sole_user(embedding, {aten.permute.default}, "permute")
    require([d % 3 for d in permute.args[1]] == [2, 0, 1], f"{permute} does not put heads first")
    output = walk.sole_user(permute, {aten.unsqueeze.default}, "unsqueeze")
    require(output.args[1] in (0, -4), f"{output} does not add the leading 1")

    bucket = walk.plus_zero(lookup["indices"])
    direction = None
    if is_call(bucket, _ADD):
        total = walk.step(bucket, _ADD, "direction + bucket")
        require(total["alpha"] == 1, f"{bucket} scales its bucket")
        direction, bucket = total["input"], total["other"]
    buckets = _buckets_of_one_direction(walk, bucket)
    rel, bidirectional = _relative_position(walk, buckets.distance)
    require(bidirectional == (direction is not None), f"{lookup['indices']} mixes one-sided and bidirectional buckets")
    num_buckets = node_value(table).shape[0]
    half = num_buckets // 2 if bidirectional else num_buckets
    if bidirectional:
        _check_direction(walk, direction, rel, half)
    max_exact = half // 2
    require(buckets.max_exact == max_exact >= 1 and _literal(buckets.log_buckets, half - max_exact)
            and _literal(buckets.last_bucket, half - 1),
            f"{lookup['indices']} does not bucket a {num_buckets}-row table as T5 does (exact {buckets.max_exact}, "
            f"logarithmic {buckets.log_buckets}, last {buckets.last_bucket}; expected {max_exact}, "
            f"{half - max_exact}, {half - 1})")
    max_distance = _max_distance(buckets.divisor, max_exact)
    query_positions, key_positions, offset = _positions(walk, rel)
    # Every recorded step but the output must feed only other steps: they are erased.
    require(all(set(n.users) <= walk.nodes for n in walk.nodes - {output}),
            "an intermediate value is also used outside the bias")
    return RelativePositionBiasMatch(table, query_positions, key_positions, offset, bidirectional, max_distance, output,
                                     walk.nodes)


def _call(gm: GraphModule, target, args: tuple, like: Node) -> Node:
    """Add ``target(*args)`` with its ``meta["val"]`` and the provenance of ``like``, the node it replaces."""
    node = gm.graph.call_function(target, args)
    values = [a.meta["val"] if isinstance(a, Node) else a for a in args]
    with detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)]) or contextlib.nullcontext():
        node.meta["val"] = target(*values)
    node.meta.update({key: like.meta[key] for key in _PROVENANCE if key in like.meta})
    return node


def _replace(gm: GraphModule, match: RelativePositionBiasMatch) -> None:
    with gm.graph.inserting_before(match.output):
        queries = match.query_positions
        if not _literal(match.query_offset, 0):
            queries = _call(gm, aten.add.Tensor, (queries, match.query_offset), match.output)
        bias = _call(gm, torch.ops.autodeploy.relative_position_bias.default,
                     (match.table, queries, match.key_positions, match.bidirectional, match.max_distance), match.output)
    match.output.replace_all_uses_with(bias)
    for node in reversed([n for n in gm.graph.nodes if n in match.nodes]):
        gm.graph.erase_node(node)


def replace_relative_position_bias(gm: GraphModule) -> int:
    """Replace every T5 ``compute_bias`` subgraph by one ``relative_position_bias``; returns how many."""
    replaced = 0
    for embedding in gm.graph.find_nodes(op="call_function", target=aten.embedding.default):
        try:
            match = match_relative_position_bias(embedding)
        except NoMatch as reason:
            logger.debug("%s: not a relative position bias: %s", embedding, reason)
            continue
        _replace(gm, match)
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced


register_rewrite("relative_position_bias", replace_relative_position_bias, family="attention")
