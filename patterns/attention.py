"""Attention family: HF self-attention (SDPA or eager) → ``torch.ops.autodeploy.attention``.

What Hugging Face (5.17) exports after the cleanup stage. q, k, v are ``[B, H, S, D]``; ``repeat(x)``
is ``repeat_kv`` (``reshape(expand(unsqueeze(x, 2), [B, Hkv, n, S, D]), [B, Hkv·n, S, D])``), present
for grouped-query attention unless SDPA gets ``enable_gqa=True``; ``?`` marks optional steps::

    SDPA (every model built with attn_implementation="sdpa"):
        scaled_dot_product_attention(q, repeat(k)?, repeat(v)?, mask | None, 0.0, is_causal, scale?, enable_gqa?)
    eager (Llama, Mistral, Qwen2/3, Mixtral, Phi-3, GPT-NeoX, Cohere, StableLM, Gemma-2/3, GPT-OSS):
        logits = matmul(q, transpose(repeat(k), 2, 3)) * scale               (or kᵀ = permute(k_bshd, [0, 2, 3, 1]))
        logits = tanh(logits / cap) * cap                                    ? Gemma-2 soft-capping
        logits = logits + alibi                                              ? MPT: an ALiBi bias (slope_h · j + c)
        logits = logits + mask       or   masked_fill(logits, hidden, min)   (MPT)
        probs  = softmax(logits, -1, f32)                                    (to(dtype)? in half models)
          or, with sinks (GPT-OSS):
        both   = cat([logits, expand(reshape(sinks[H], [1, -1, 1, 1]))], -1)
        probs  = slice(softmax(both - max(both, -1).values, -1), -1, 0, -1)
        out    = matmul(dropout(probs, p, train=False), repeat(v))
    Bloom (eager only), on [B·H, S, D] views of q, k, v:
        probs  = softmax(view(baddbmm(alibi, q, transpose(k, 1, 2), beta=1, alpha=scale)) + mask, -1, f32)
        out    = bmm(view(dropout(probs)), v)

An SDPA with neither a mask nor ``is_causal`` (an encoder's: a vision tower's), or with a mask that hides
nothing for every length (a text encoder's over its unpadded input: evaluated as below), becomes
``bidirectional_attention(q, k, v, scale)`` likewise, which the cache stage leaves alone. One whose mask is a
symmetric band, query ``i`` seeing key ``j`` iff ``|i - j| ≤ W`` (ModernBERT's local layers: HF's
``create_bidirectional_sliding_window_mask``), becomes ``bidirectional_attention(q, k, v, scale, window=W)``.

**T5's relative position bias.** HF's SDPA path folds it into the mask: ``where(visible, bias, finfo.min)``. Once
the ``relative_position_bias`` rewrite (registered first in this family) has made ``bias`` its canonical op, such a
mask is read as ``visible`` (evaluated as below) and ``bias`` becomes the op's ``bias`` argument: of
``bidirectional_attention`` in T5's encoder, of the causal ``attention`` in its decoder (scale 1.0, as given).
Another bias folded into a mask is left as exported.

Each becomes ``transpose(attention(transpose(q, 1, 2), transpose(k, 1, 2), transpose(v, 1, 2), scale,
sliding_window, logit_cap, sinks), 1, 2)``: the op takes and returns ``[B, S, H, D]`` and does GQA
itself, so ``repeat_kv`` goes; ``cleanup_transposes`` later folds the transposes into HF's own.

**The causal assumption.** The canonical op is causal over the sequence index (query ``i`` sees keys
``j ≤ i``, and ``i - W < j`` with a sliding window ``W``). HF builds its mask from ``position_ids``;
the runtime feeds ``arange`` positions per row, for which that mask is exactly causal or causal plus a
sliding window. The mask is therefore not matched op by op (its spelling changes with HF releases and
models): its subgraph is *evaluated* for one row of arange positions, and the attention is replaced only
when the result is a causal mask, optionally windowed; the window is read off the result. The mask's
value depends on the sequence length only through comparisons with the integer literals of its
subgraph, so one probe longer than every such literal (and at most the graph's maximum sequence length,
since a window no sequence reaches changes nothing) decides it for every length. A mask that is
anything else (padding, bidirectional or per-document blocks) leaves its attention unmatched, and so does
one that cannot be evaluated: HF's eager (additive) masks read a ``torch.tensor(0.0)`` constant, which a
graph exported on the meta device holds without a value (SDPA's boolean masks have no such constant).
Once every attention reading a mask is replaced, the mask-building nodes are dead and the match stage's
dead-code elimination removes them.

**ALiBi.** A bias added to the logits is evaluated the same way; it must be ``slope_h · j`` plus a constant
per query row (which softmax does not see), and its slopes become the op's ``alibi_slopes``, biasing by
``slope_h · (j - i)`` on the absolute positions the cached op knows.

Written as graph walks (``register_rewrite``) rather than traced search functions: the mask analysis
decides the op's ``sliding_window`` argument, which a traced replacement cannot receive; and the optional
steps above would need one traced pattern per combination. The walks read ops, arguments and shapes
only, never node, parameter or module names. Dropout must be inactive (``train=False`` or ``p=0``).

```python
from autodeploy.patterns.attention import replace_sdpa_attention, replace_eager_attention

replaced = replace_sdpa_attention(gm) + replace_eager_attention(gm)   # gm: exported + cleaned up
```
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.attention)
# Registers its rewrite in this family before the attention walks below, which read the op it leaves.
from autodeploy.patterns import relative_position_bias  # noqa: F401
from autodeploy.patterns.graph_walk import (DTYPE_CASTS, VIEWS, NoMatch, Walk, is_call, node_value, require,
                                           same_size)
from autodeploy.patterns.registry import register_rewrite

logger = logging.getLogger(__name__)

aten = torch.ops.aten

_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_POSITION_BIASES = {torch.ops.autodeploy.relative_position_bias.default}
_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack")
_HIDING_FILL = -1e4
# Longest mask probe evaluated: a [1, 1, N, N] mask and its intermediates, ~10 × N² bytes.
_MASK_PROBE_LIMIT = 8192




# ---------------------------------------------------------------------------------------- the mask


def _cone(node: Node) -> list[Node]:
    """``node`` and every node it depends on, in graph order."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _max_size(size) -> int | None:
    """The largest value a (possibly symbolic) size can take; None when unbounded."""
    if isinstance(size, int):
        return size
    upper = size.node.shape_env.bound_sympy(size.node.expr).upper
    return int(upper) if upper.is_finite else None


def _int_literals(nodes: list[Node]) -> list[int]:
    found: list[int] = []

    def visit(argument) -> None:
        if isinstance(argument, bool):
            return
        if isinstance(argument, int):
            found.append(abs(argument))
        elif isinstance(argument, (list, tuple)):
            for item in argument:
                visit(item)
        elif isinstance(argument, dict):
            for item in argument.values():
                visit(item)

    for node in nodes:
        visit(node.args)
        visit(node.kwargs)
    return found


def _on_cpu(argument):
    return torch.device("cpu") if isinstance(argument, torch.device) else argument


def _probe_length(cone: list[Node], seq) -> int:
    """A sequence length whose mask decides the mask of every length the graph accepts.

    HF masks compare query and key indices with each other and with integer literals (the window), so
    the pattern of one length is the top-left block of any longer one's, and a probe longer than every
    literal shows each comparison flip. Literals no sequence reaches (a window of 262144 when at most
    8192 tokens fit) change nothing and do not lengthen the probe. A static length is its own probe.
    """
    if isinstance(seq, int):
        return seq
    max_seq = _max_size(seq)
    require(max_seq is not None, "the sequence length is unbounded")
    literals = [literal for literal in _int_literals(cone) if literal < max_seq]
    return min(max_seq, max(16, max(literals, default=0) + 2))


def _evaluate_mask(gm: GraphModule, mask: Node) -> tuple[torch.Tensor, int]:
    """The mask's value for one row of ``arange`` inputs, at a probe length that decides every length."""
    cone = _cone(mask)
    require(all(n.op in ("placeholder", "get_attr", "call_function") for n in cone), f"mask {mask} calls a module")
    placeholders = [n for n in cone if n.op == "placeholder"]
    require(bool(placeholders), f"mask {mask} does not depend on the inputs")
    for node in placeholders:
        value = node.meta.get("val")
        require(
            isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point(),
            f"mask input {node} is not a [batch, seq] integer tensor",
        )
    probe = _probe_length(cone, placeholders[0].meta["val"].shape[1])
    require(probe <= _MASK_PROBE_LIMIT, f"mask {mask} needs a {probe}-token probe (limit {_MASK_PROBE_LIMIT})")

    graph, copies = Graph(), {}
    for node in cone:
        copy = graph.node_copy(node, lambda n: copies[n])
        copy.args = torch.fx.node.map_aggregate(copy.args, _on_cpu)  # a graph exported on meta says device=meta
        copy.kwargs = torch.fx.node.map_aggregate(copy.kwargs, _on_cpu)
        copies[node] = copy
    graph.output(copies[mask])
    # Positions 0..N-1 are what the assumption is about; token ids get the same values, so the
    # result does not depend on which input is which (a mask reading token ids is not causal here).
    inputs = [torch.arange(probe, dtype=n.meta["val"].dtype)[None] for n in placeholders]
    try:
        with torch.no_grad():
            value = GraphModule(gm, graph)(*inputs)
    except (RuntimeError, NotImplementedError) as error:  # torch raises these for ops with no value on meta: unmatched, not a crash
        raise NoMatch(f"cannot evaluate mask {mask}: {str(error).splitlines()[0][:160]}") from error
    require(isinstance(value, torch.Tensor) and not value.is_meta, f"mask {mask} has no value on the CPU")
    return value, probe


def _visible_keys(gm: GraphModule, mask: Node, hides: bool = False) -> tuple[torch.Tensor, int]:
    """``[probe, probe]`` booleans, True where query ``i`` sees key ``j``, and the probe length (``_evaluate_mask``).

    The mask is boolean (True: attend; with ``hides``, True: hidden, as ``masked_fill`` takes it) or additive (0: attend; -inf or at most half the dtype's lowest
    value, HF's ``finfo.min``: masked, which softmax turns into exact zeros), broadcast to ``[B, H, S, S]``;
    it must be the same for every batch row and head.
    """
    value, probe = _evaluate_mask(gm, mask)
    require(value.dim() >= 2 and tuple(value.shape[-2:]) == (probe, probe), f"mask {mask} is not [.., S, S]")
    rows = value.reshape(-1, probe, probe)
    require(bool((rows == rows[:1]).all()), f"mask {mask} differs between batch rows or heads")
    rows = rows[0]
    if rows.dtype == torch.bool:
        visible = ~rows if hides else rows
    else:
        visible = rows == 0
        lowest = torch.finfo(rows.dtype).min / 2
        require(bool((rows[~visible] <= lowest).all()), f"additive mask {mask} has values other than 0 and -inf")
    return visible, probe


def causal_sliding_window(gm: GraphModule, mask: Node, hides: bool = False) -> int | None:
    """The sliding window of a causal mask (None when it has none); raises ``NoMatch`` when not causal. The mask is
    read as ``_visible_keys`` says."""
    visible, probe = _visible_keys(gm, mask, hides)
    window = int(visible[-1].sum())
    require(window >= 1, f"mask {mask} hides every key from the last query")
    query, key = torch.arange(probe)[:, None], torch.arange(probe)[None, :]
    expected = (key <= query) & (key > query - window)
    require(bool((visible == expected).all()), f"mask {mask} is not causal (with or without a sliding window)")
    return window if window < probe else None


def bidirectional_sliding_window(gm: GraphModule, mask: Node) -> int:
    """The half-width ``W`` of a bidirectional sliding-window mask, where query ``i`` sees key ``j`` iff ``|i - j| ≤ W``
    (ModernBERT's local layers); raises ``NoMatch`` when ``mask`` (read as ``_visible_keys`` says) is not one.

    ``W`` is at least 1: the diagonal alone is also the causal window of 1, which ``causal_sliding_window`` reads. A
    band as wide as the probe is wider than every literal, so it hides nothing at any length (``hides_nothing``).
    """
    visible, probe = _visible_keys(gm, mask)
    window = int(visible[0].sum()) - 1
    require(1 <= window < probe - 1, f"mask {mask} shows its first query {window + 1} keys: no band 1 ≤ W < {probe - 1}")
    query, key = torch.arange(probe)[:, None], torch.arange(probe)[None, :]
    require(bool((visible == ((query - key).abs() <= window)).all()), f"mask {mask} is not a bidirectional sliding window")
    return window


def hides_nothing(gm: GraphModule, mask: Node, hides: bool = False) -> bool:
    """Whether ``mask`` (as ``causal_sliding_window`` reads it) lets every query see every key, for every length:
    what Hugging Face builds for an encoder's unpadded sequence, and what ``bidirectional_attention`` computes."""
    try:
        value, probe = _evaluate_mask(gm, mask)
    except NoMatch:
        return False
    if value.dim() < 2 or tuple(value.shape[-2:]) not in ((probe, probe), (1, probe)):
        return False
    return bool((value != hides).all()) if value.dtype == torch.bool else bool((value == 0).all())


def alibi_slopes(gm: GraphModule, bias: Node, heads: int) -> list[float]:
    """The per-head slopes of an ALiBi bias added to the attention logits; ``NoMatch`` when it is not one.

    Evaluated like a mask, the bias must broadcast to ``[heads, S, S]`` and be ``slope_h · j + c_{h,i}``
    for key ``j`` of query ``i``: Bloom's ``slope · j`` and MPT's ``slope · (j - S + 1)`` are, and the
    per-query constant ``c`` is invisible to softmax, so it becomes the op's ``slope · (j - i)``."""
    value, probe = _evaluate_mask(gm, bias)
    require(value.is_floating_point() and probe >= 2, f"bias {bias} is not a float bias over at least 2 keys")
    leading = value.numel() // (value.shape[-2] * value.shape[-1])
    require(value.dim() >= 2 and leading in (1, heads) and value.shape[-1] == probe and value.shape[-2] in (1, probe),
            f"bias {bias} does not broadcast to [heads, S, S]")
    rows = value.reshape(leading, value.shape[-2], probe).expand(heads, probe, probe).double()
    # A least-squares slope per head: a half-precision bias is slope · j rounded to its dtype.
    keys = torch.arange(probe, dtype=torch.float64) - (probe - 1) / 2
    slopes = ((rows[:, 0, :] - rows[:, 0, :].mean(-1, keepdim=True)) * keys).sum(-1) / (keys**2).sum()
    linear = rows.mean(-1, keepdim=True) + slopes[:, None, None] * keys
    tolerance = max(1e-5, 4 * torch.finfo(value.dtype).eps) * max(1.0, float(rows.abs().max()))
    require(bool(torch.allclose(rows, linear, rtol=0, atol=tolerance)), f"bias {bias} is not linear in the key position")
    return [float(slope) for slope in slopes]


# --------------------------------------------------------------------------------------- the walks


@dataclass
class AttentionMatch:
    """One matched attention: q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]`` (before ``repeat_kv``), the op's
    options, the node whose value the op replaces, and the nodes computing it."""

    q: Node
    k: Node
    v: Node
    scale: float
    sliding_window: int | None  # causal: keys i - W < j ≤ i; bidirectional: keys |i - j| ≤ W (the ops' own meanings)
    logit_cap: float | None
    sinks: Node | None
    output: Node
    nodes: set[Node] = field(default_factory=set)
    alibi_slopes: list[float] | None = None
    k_layout: str = "bhsd"  # "bshd": ``k`` is already [B, S, Hkv, D] (its kᵀ was one permute)
    bidirectional: bool = False  # no causal mask: an encoder's attention (``bidirectional_attention``), windowed or not
    output_layout: str = "bhsd"  # "bh_sd": the replaced value is [B·H, S, D] (Bloom's bmm)
    bias: Node | None = None  # a relative_position_bias added to the logits (T5)


class _Walk(Walk):
    """Steps backwards through one candidate attention, recording every node it steps over."""

    def __init__(self, gm: GraphModule, windows: dict[Node, int | None | NoMatch]):
        super().__init__()
        self.gm = gm
        self.windows = windows  # mask → its sliding window (or why it is not causal), shared by all layers

    def skip_casts(self, node):
        """Step over floating-point casts: the op fixes its own compute (float32) and output dtypes."""
        while is_call(node, DTYPE_CASTS):
            require(node_value(node).is_floating_point(), f"{node} is not a float cast")
            self.nodes.add(node)
            node = node.args[0]
        return node

    def kv_source(self, node: Node) -> Node:
        """``repeat_kv(x)`` (unsqueeze + expand + reshape, or ``repeat_interleave`` on the head dim) → x.

        Anything else is returned as is: k and v already have the kv heads (MHA, or SDPA's enable_gqa).
        """
        if is_call(node, {aten.repeat_interleave.self_int}):
            arguments = self.step(node, {aten.repeat_interleave.self_int}, "repeat_interleave")
            require(node_value(node).dim() == 4 and arguments["dim"] in (1, -3), f"{node} does not repeat heads")
            require(isinstance(arguments["repeats"], int), f"{node} repeats by a tensor")
            return arguments["input"]
        if not (is_call(node, VIEWS) and is_call(node.args[0], {aten.expand.default})):
            return node
        expanded = self.step(node, VIEWS, "a view")["input"]
        unsqueezed = self.step(expanded, {aten.expand.default}, "an expand")["input"]
        unsqueeze = self.step(unsqueezed, {aten.unsqueeze.default}, "an unsqueeze")
        source = unsqueeze["input"]
        src, wide, out = node_value(source).shape, node_value(expanded).shape, node_value(node).shape
        require(len(src) == 4 and len(wide) == 5 and len(out) == 4 and unsqueeze["dim"] in (2, -3),
                 f"{node} is not repeat_kv")
        kept = (wide[0], wide[1], wide[3], wide[4])
        require(all(same_size(a, b) for a, b in zip(kept, src)), f"{expanded} does not only widen the new dim 2")
        require(all(same_size(a, b) for a, b in zip(out, (src[0], src[1] * wide[2], src[2], src[3]))),
                 f"{node} does not merge the repeated heads")
        return source

    def window_of(self, mask: Node, hides: bool = False) -> int | None:
        if mask not in self.windows:
            try:
                self.windows[mask] = causal_sliding_window(self.gm, mask, hides)
            except NoMatch as reason:
                self.windows[mask] = reason
        window = self.windows[mask]
        if isinstance(window, NoMatch):
            raise window
        return window

    def hides_nothing(self, mask: Node) -> bool:
        key = ("hides nothing", mask)
        if key not in self.windows:
            self.windows[key] = hides_nothing(self.gm, mask)
        return self.windows[key]

    def band_of(self, mask: Node) -> int | None:
        """The half-width of ``mask`` as a bidirectional sliding window; None when it is not one."""
        key = ("band", mask)
        if key not in self.windows:
            try:
                self.windows[key] = bidirectional_sliding_window(self.gm, mask)
            except NoMatch:
                self.windows[key] = None
        return self.windows[key]

    def finish(self, q: Node, k: Node, v: Node, output: Node, k_layout: str = "bhsd", **options) -> AttentionMatch:
        query, key, value = node_value(q).shape, node_value(k).shape, node_value(v).shape
        if k_layout == "bshd":
            key = (key[0], key[2], key[1], key[3])
        require(len(query) == len(key) == len(value) == 4, "q, k and v are not [B, H, S, D]")
        require(all(same_size(a, b) for a, b in zip(key[:3], value[:3])), "k and v differ in batch, heads or length")
        require(same_size(query[0], key[0]) and same_size(query[2], key[2]), "q and k differ in batch or length")
        require(isinstance(query[1], int) and isinstance(key[1], int) and query[1] % key[1] == 0,
                 "query heads are not a multiple of kv heads")
        require(same_size(query[3], key[3]), "q and k have different head dims")
        # Every recorded step but the output must feed only other steps, or removing it changes another value.
        require(all(set(n.users) <= self.nodes for n in self.nodes - {output}),
                 "an intermediate value is also used outside the attention")
        return AttentionMatch(q, k, v, output=output, nodes=self.nodes, k_layout=k_layout, **options)


def _match_sdpa(gm: GraphModule, node: Node, windows: dict) -> AttentionMatch:
    walk = _Walk(gm, windows)
    arguments = walk.step(node, {aten.scaled_dot_product_attention.default}, "scaled_dot_product_attention")
    require(arguments["dropout_p"] == 0.0, f"{node} has dropout")
    mask, is_causal = arguments["attn_mask"], arguments["is_causal"]
    mask, bias = _position_bias(walk, mask)
    bidirectional = mask is None and is_causal is False  # an encoder's (a vision tower's): every key
    if mask is None:
        window = None
    else:
        require(is_causal is False, f"{node} combines a mask with is_causal")
        # A mask that hides nothing (a text encoder's over its unpadded input) is no mask at all; a band around the
        # diagonal (ModernBERT's local layers) is a bidirectional window; anything else must be causal.
        band = None if walk.hides_nothing(mask) else walk.band_of(mask)
        bidirectional = walk.hides_nothing(mask) or band is not None
        window = band if bidirectional else walk.window_of(mask)
    q = arguments["query"]
    k, v = walk.kv_source(arguments["key"]), walk.kv_source(arguments["value"])
    scale = arguments["scale"]
    if scale is None:
        scale = node_value(q).shape[-1] ** -0.5
    return walk.finish(q, k, v, node, scale=float(scale), sliding_window=window, logit_cap=None, sinks=None,
                       bidirectional=bidirectional, bias=bias)


def _position_bias(walk: _Walk, mask) -> tuple:
    """``where(visible, bias, min)`` of a boolean mask and a ``relative_position_bias`` (HF's SDPA path for T5) →
    ``(visible, bias)``; any other mask → ``(mask, None)``."""
    if not (is_call(mask, {aten.where.ScalarOther}) and is_call(mask.args[1], _POSITION_BIASES)):
        return mask, None
    chosen = walk.step(mask, {aten.where.ScalarOther}, "where(visible, bias, min)")
    fill, visible, bias = _number(chosen["other"]), chosen["condition"], chosen["input"]
    require(fill is not None and fill <= _HIDING_FILL, f"{mask} fills hidden logits with {chosen['other']}")
    require(node_value(visible).dtype == torch.bool and node_value(bias).dim() == 4,
            f"{mask} is not a boolean mask choosing a [1, H, Sq, Sk] bias")
    return visible, bias


def _number(argument) -> float | None:
    return float(argument) if type(argument) in (int, float) else None


def _match_logits(walk: _Walk, node) -> tuple[Node, Node, float, float | None, str]:
    """``tanh(l / cap) * cap``? of ``l = matmul(q, kᵀ) (* s | / d)?`` → (q, k, scale, cap, k's layout).

    ``kᵀ`` is ``transpose(k, 2, 3)`` of ``k [B, H, S, D]``, or ``permute(x, [0, 2, 3, 1])`` of ``x [B, S, H, D]``
    (what ``cleanup_transposes`` makes of ``transpose(transpose(x, 1, 2), -1, -2)``)."""
    cap = None
    if is_call(node, {aten.mul.Tensor}) and is_call(node.args[0], {aten.tanh.default}):
        cap = _number(walk.step(node, {aten.mul.Tensor}, "a multiply")["other"])
        divided = walk.step(node.args[0], {aten.tanh.default}, "tanh")["input"]
        division = walk.step(divided, {aten.div.Tensor}, "a divide")
        require(cap is not None and cap > 0 and _number(division["other"]) == cap, f"{node} is not a soft-cap")
        node = division["input"]
    scale = 1.0
    if is_call(node, {aten.mul.Tensor, aten.div.Tensor}):
        factor = _number(walk.step(node, {aten.mul.Tensor, aten.div.Tensor}, "a scale")["other"])
        require(factor is not None and factor != 0, f"{node} does not scale by a number")
        scale = factor if node.target is aten.mul.Tensor else 1.0 / factor
        node = node.args[0]
    product = walk.step(node, {aten.matmul.default}, "q @ kᵀ")
    key_t = product["other"]
    require(node_value(key_t).dim() == 4, f"{key_t} is not kᵀ")
    # Upcasts of q and k (CodeGen, GPT-Neo) go: the op computes its logits in float32 itself.
    query = walk.skip_casts(product["input"])
    if is_call(key_t, {aten.permute.default}):
        permute = walk.step(key_t, {aten.permute.default}, "kᵀ")
        require([d % 4 for d in permute["dims"]] == [0, 2, 3, 1], f"{key_t} is not kᵀ")
        return query, walk.skip_casts(permute["input"]), scale, cap, "bshd"
    transpose = walk.step(key_t, {aten.transpose.int}, "kᵀ")
    require({transpose["dim0"] % 4, transpose["dim1"] % 4} == {2, 3}, f"{key_t} is not kᵀ")
    return query, walk.kv_source(walk.skip_casts(transpose["input"])), scale, cap, "bhsd"


def _match_sinks(walk: _Walk, node, heads: int) -> Node:
    """``expand(reshape(sinks[H], [1, -1, 1, 1]), [B, -1, S, -1])`` → the sinks tensor."""
    viewed = walk.step(node, {aten.expand.default}, "an expand of the sinks")["input"]
    sinks = walk.step(viewed, VIEWS, "a view of the sinks")["input"]
    shape = node_value(viewed).shape
    require(node_value(sinks).dim() == 1 and len(shape) == 4 and same_size(shape[1], heads)
             and all(same_size(size, 1) for size in (shape[0], shape[2], shape[3])), f"{sinks} is not one sink per head")
    return sinks


def _match_eager(gm: GraphModule, node: Node, windows: dict, lse_sinks: tuple | None = None) -> AttentionMatch:
    """``lse_sinks`` = (walk, output, sinks, logsumexp input): the attention is the inner part of
    ``_match_lse_sinks``' match, which has recorded the sink scaling in ``walk`` already."""
    walk = _Walk(gm, windows) if lse_sinks is None else lse_sinks[0]
    product = walk.step(node, {aten.matmul.default}, "probs @ v")
    v = walk.kv_source(product["other"])
    probs = product["input"]
    if is_call(probs, {aten.dropout.default}):
        dropout = walk.step(probs, {aten.dropout.default}, "dropout")
        require(dropout["p"] == 0.0 or dropout["train"] is False, f"{probs} drops attention weights")
        probs = dropout["input"]
    probs = walk.skip_casts(probs)
    with_sinks = is_call(probs, {aten.slice.Tensor})
    if with_sinks:  # the softmax ran over one extra column, the sink's, which is dropped here
        cut = walk.step(probs, {aten.slice.Tensor}, "a slice")
        require(cut["dim"] % 4 == 3 and cut["start"] in (None, 0) and cut["end"] == -1 and cut["step"] == 1,
                 f"{probs} does not drop the last column")
        probs = cut["input"]
    softmax = walk.step(probs, _SOFTMAX, "softmax")
    require(node_value(probs).dim() == 4 and softmax["dim"] % 4 == 3, f"{probs} is not a softmax over keys")
    logits = walk.skip_casts(softmax["input"])
    if lse_sinks is not None:
        require(lse_sinks[3] is softmax["input"], f"{lse_sinks[3]} is not what {probs} normalises")
        require(not with_sinks, f"{probs} has sinks twice")

    if is_call(logits, {aten.sub.Tensor}):  # GPT-OSS, MiMo: the row maximum subtracted first, as softmax does
        both = walk.step(logits, {aten.sub.Tensor}, "a subtract")["input"]
        maximum = logits.args[1]
        walk.step(maximum, {operator.getitem}, "the max values")
        reduce = walk.step(maximum.args[0], {aten.max.dim}, "max")
        require(maximum.args[1] == 0 and reduce["input"] is both and reduce["dim"] % 4 == 3 and reduce["keepdim"],
                 f"{logits} does not subtract the row maximum")
        logits = both
    sinks = None
    if with_sinks:
        concat = walk.step(logits, {aten.cat.default}, "logits and sinks")
        require(len(concat["tensors"]) == 2 and concat["dim"] % 4 == 3, f"{logits} does not append one column")
        logits, sink_column = concat["tensors"]
        sinks = _match_sinks(walk, sink_column, heads=node_value(logits).shape[1])

    post_scale = 1.0
    if is_call(logits, {aten.mul.Tensor, aten.div.Tensor}) and is_call(logits.args[0], {aten.add.Tensor}):
        # CodeGen scales after adding the mask: (q·kᵀ + mask) / s. A masked logit stays hugely negative.
        division = walk.step(logits, {aten.mul.Tensor, aten.div.Tensor}, "a scale")
        factor = _number(division["other"])
        require(factor is not None and factor > 0, f"{logits} does not scale by a positive number")
        post_scale = factor if logits.target is aten.mul.Tensor else 1.0 / factor
        logits = division["input"]
    if is_call(logits, {aten.masked_fill.Scalar}):  # MPT: hide keys where the (boolean) mask is True
        filled = walk.step(logits, {aten.masked_fill.Scalar}, "a masked fill")
        value = _number(filled["value"])
        # Any fill ≤ -10⁴ leaves masked keys exactly zero weight (exp underflows): MPT fills float32 logits
        # with float16's minimum when the model runs in float16 and its bias promotes the logits.
        require(value is not None and value <= _HIDING_FILL, f"{logits} fills with {value}")
        scores, mask, hides = filled["input"], filled["mask"], True
    else:
        addition = walk.step(logits, {aten.add.Tensor}, "logits + mask")
        require(addition["alpha"] == 1, f"{logits} scales the mask")
        scores, mask, hides = addition["input"], addition["other"], False
        if _is_score(mask):
            scores, mask = mask, scores
    require(isinstance(mask, Node), f"{logits} adds no mask")
    slopes = None
    if is_call(scores, {aten.add.Tensor}) and not _is_score(scores):  # logits + an ALiBi bias (MPT)
        addition = walk.step(scores, {aten.add.Tensor}, "logits + bias")
        scores, bias = addition["input"], addition["other"]
        if _is_score(bias):
            scores, bias = bias, scores
        require(addition["alpha"] == 1 and isinstance(bias, Node), f"{addition} is not logits + a bias")
        slopes = alibi_slopes(walk.gm, bias, node_value(scores).shape[1])
    q, k, scale, cap, k_layout = _match_logits(walk, scores)
    require(post_scale == 1.0 or (cap is None and slopes is None), f"{logits} scales capped or biased logits")
    window = walk.window_of(mask, hides)
    if lse_sinks is not None:
        node, sinks = lse_sinks[1], lse_sinks[2]
    return walk.finish(q, k, v, node, k_layout, scale=scale * post_scale, sliding_window=window, logit_cap=cap,
                       sinks=sinks, alibi_slopes=slopes)


def _match_lse_sinks(gm: GraphModule, node: Node, windows: dict) -> AttentionMatch:
    """Granite-SWA's sinks: ``(softmax(l) @ v) · sigmoid(logsumexp(l) - sinks)``, which equals a softmax whose
    denominator has one more term, ``exp(sink)``: the op's ``sinks``."""
    walk = _Walk(gm, windows)
    product = walk.step(node, {aten.mul.Tensor}, "attention × sink scale")
    out, scale = product["input"], product["other"]
    if not is_call(out, {aten.matmul.default}):
        out, scale = scale, out
    unsqueeze = walk.step(walk.skip_casts(scale), {aten.unsqueeze.default}, "an unsqueeze")
    require(unsqueeze["dim"] in (-1, 3), f"{scale} does not scale each query's output")
    sigmoid = walk.step(walk.skip_casts(unsqueeze["input"]), {aten.sigmoid.default}, "sigmoid")
    difference = walk.step(walk.skip_casts(sigmoid["input"]), {aten.sub.Tensor}, "logsumexp - sinks")
    lse = walk.step(difference["input"], {aten.logsumexp.default}, "logsumexp")
    require(list(lse["dim"]) in ([-1], [3]) and not lse["keepdim"], f"{difference['input']} is not a logsumexp over keys")
    sinks = walk.step(difference["other"], VIEWS, "a view of the sinks")["input"]
    heads = node_value(lse["input"]).shape[1]
    require(isinstance(sinks, Node) and node_value(sinks).dim() == 1 and same_size(node_value(sinks).shape[0], heads),
            f"{sinks} is not one sink per head")
    return _match_eager(gm, out, windows, lse_sinks=(walk, node, sinks, lse["input"]))


def _is_score(node) -> bool:
    """Whether ``node`` computes attention logits (q·kᵀ, scaled or soft-capped) rather than a mask or bias."""
    return is_call(node, {aten.mul.Tensor, aten.div.Tensor, aten.matmul.default})


def _match_alibi_bmm(gm: GraphModule, node: Node, windows: dict) -> AttentionMatch:
    """Bloom: ``bmm(view(softmax(view(baddbmm(alibi, q, kᵀ, alpha=scale)) + mask)), v)`` on ``[B·H, S, D]``
    views of ``[B, H, S, D]`` q, k and v."""
    walk = _Walk(gm, windows)
    product = walk.step(node, {aten.bmm.default}, "probs @ v")
    v = _unflattened_heads(walk, product["mat2"])
    probs = walk.step(product["input"], VIEWS, "a view of the probabilities")["input"]
    if is_call(probs, {aten.dropout.default}):
        dropout = walk.step(probs, {aten.dropout.default}, "dropout")
        require(dropout["p"] == 0.0 or dropout["train"] is False, f"{probs} drops attention weights")
        probs = dropout["input"]
    probs = walk.skip_casts(probs)
    softmax = walk.step(probs, _SOFTMAX, "softmax")
    require(node_value(probs).dim() == 4 and softmax["dim"] % 4 == 3, f"{probs} is not a softmax over keys")
    addition = walk.step(walk.skip_casts(softmax["input"]), {aten.add.Tensor}, "logits + mask")
    require(addition["alpha"] == 1 and isinstance(addition["other"], Node), f"{addition} adds no mask")
    scores = walk.step(addition["input"], VIEWS, "a view of the logits")["input"]
    biased = walk.step(scores, {aten.baddbmm.default}, "alibi + scale · q @ kᵀ")
    require(biased["beta"] == 1 and _number(biased["alpha"]) is not None, f"{scores} scales its bias")
    q = _unflattened_heads(walk, biased["batch1"])
    transpose = walk.step(biased["batch2"], {aten.transpose.int}, "kᵀ")
    require({transpose["dim0"] % 3, transpose["dim1"] % 3} == {1, 2}, f"{biased['batch2']} is not kᵀ")
    k = _unflattened_heads(walk, transpose["input"])
    heads = node_value(q).shape[1]
    slopes = alibi_slopes(gm, biased["input"], heads)
    window = walk.window_of(addition["other"])
    match = walk.finish(q, k, v, node, scale=float(biased["alpha"]), sliding_window=window, logit_cap=None, sinks=None,
                        alibi_slopes=slopes)
    match.output_layout = "bh_sd"
    return match


def _unflattened_heads(walk: _Walk, node: Node) -> Node:
    """``reshape(x [B, H, S, D], [B·H, S, D])`` → x."""
    source = walk.step(node, VIEWS, "a [B·H, S, D] view")["input"]
    shape, flat = node_value(source).shape, node_value(node).shape
    require(len(shape) == 4 and len(flat) == 3 and same_size(flat[0], shape[0] * shape[1])
            and same_size(flat[1], shape[2]) and same_size(flat[2], shape[3]), f"{node} does not merge batch and heads")
    return source


# ------------------------------------------------------------------------------------ the rewrite


def _call(graph: Graph, target, args: tuple, kwargs: dict | None = None) -> Node:
    """Add ``target(*args, **kwargs)`` with its ``meta["val"]``, so later patterns can read shapes before propagation."""
    node = graph.call_function(target, args, kwargs)
    values = [a.meta["val"] if isinstance(a, Node) else a for a in args]
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    with fake_mode:
        node.meta["val"] = target(*values, **(kwargs or {}))
    return node


def _replace(graph: Graph, match: AttentionMatch) -> None:
    with graph.inserting_before(match.output):
        q, v = (_call(graph, aten.transpose.int, (x, 1, 2)) for x in (match.q, match.v))
        k = match.k if match.k_layout == "bshd" else _call(graph, aten.transpose.int, (match.k, 1, 2))
        if match.bidirectional:
            bias = () if match.bias is None else (match.bias,)
            # A keyword: the cache stage may add seq_start, which comes before it in the op's schema.
            window = {} if match.sliding_window is None else {"window": match.sliding_window}
            out = _call(graph, torch.ops.autodeploy.bidirectional_attention.default, (q, k, v, match.scale, *bias), window)
        else:
            options = (match.scale, match.sliding_window, match.logit_cap, match.sinks)
            if match.alibi_slopes is not None or match.bias is not None:
                options += (match.alibi_slopes,)
            if match.bias is not None:
                options += (match.bias,)
            out = _call(graph, torch.ops.autodeploy.attention.default, (q, k, v, *options))
        result = _call(graph, aten.transpose.int, (out, 1, 2))
        added = [n for n in (q, k, v) if n not in (match.q, match.k, match.v)] + [out, result]
        if match.output_layout == "bh_sd":
            result = _call(graph, aten.flatten.using_ints, (result, 0, 1))
            added.append(result)
    for node in added:  # the module stack and source line of what they replace
        node.meta.update({key: match.output.meta[key] for key in _PROVENANCE if key in match.output.meta})
    match.output.replace_all_uses_with(result)
    for node in reversed([n for n in graph.nodes if n in match.nodes]):
        if not node.users:
            graph.erase_node(node)


def _replace_all(gm: GraphModule, anchors: list[Node], match_at) -> int:
    windows: dict = {}
    replaced = 0
    for anchor in anchors:
        if anchor._erased:
            continue
        try:
            match = match_at(gm, anchor, windows)
        except NoMatch as reason:
            logger.debug("%s: not replaced: %s", anchor, reason)
            continue
        _replace(gm.graph, match)
        replaced += 1
    for mask, reason in windows.items():
        if isinstance(reason, NoMatch):
            logger.info("attention with mask %s left as exported: %s", mask, reason)
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced


def replace_sdpa_attention(gm: GraphModule) -> int:
    """Replace every causal ``scaled_dot_product_attention`` (with its ``repeat_kv``), and every one without a mask
    that is not causal, or with a bidirectional window, by ``bidirectional_attention``; returns how many."""
    sdpa = gm.graph.find_nodes(op="call_function", target=aten.scaled_dot_product_attention.default)
    return _replace_all(gm, sdpa, _match_sdpa)


def replace_eager_attention(gm: GraphModule) -> int:
    """Replace every causal matmul-softmax-matmul attention; returns how many."""
    matmuls = gm.graph.find_nodes(op="call_function", target=aten.matmul.default)
    return _replace_all(gm, list(reversed(matmuls)), _match_eager)


def replace_lse_sink_attention(gm: GraphModule) -> int:
    """Replace every attention whose sinks scale its output by ``sigmoid(logsumexp - sink)``; returns how many."""
    products = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    candidates = [n for n in products if any(is_call(a, {aten.matmul.default}) for a in n.args)]
    return _replace_all(gm, list(reversed(candidates)), _match_lse_sinks)


def replace_alibi_bmm_attention(gm: GraphModule) -> int:
    """Replace every Bloom-style ``baddbmm`` ALiBi attention on ``[B·H, S, D]`` views; returns how many."""
    bmms = gm.graph.find_nodes(op="call_function", target=aten.bmm.default)
    return _replace_all(gm, list(reversed(bmms)), _match_alibi_bmm)


register_rewrite("attention_sdpa", replace_sdpa_attention, family="attention")
register_rewrite("attention_eager", replace_eager_attention, family="attention")
register_rewrite("attention_alibi_bmm", replace_alibi_bmm_attention, family="attention")
register_rewrite("attention_lse_sinks", replace_lse_sink_attention, family="attention")
