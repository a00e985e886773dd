"""``fold_smoothing`` (stage ``fuse``): SmoothQuant's smoothing moved into the norm or linear before it.

A ``smoothquant`` projection (``int8_w8a8_linear``) multiplies its input by ``smooth`` (``1 / s``, one
factor per input channel) before it rounds the input to int8. Where the input comes out of an op that
is linear per channel, the factors can be applied there once, at build, and the projections take the
input as it is (``smooth`` None): one multiply less per projection at run time, and projections over one
input then share every tensor row-wise, so ``fuse_gemms`` can concatenate them (q/k/v, gate/up).

Folded, when every reader of the input is a ``smoothquant`` projection with equal factors
(``load_weights`` gives the projections over one input one smoothing: ``share_smoothing``):

- into an ``rms_norm`` (Gemma's ``weight_offset``: ``(offset + w) · smooth − offset``), the normed output of
  an ``add_rms_norm``, or a ``layer_norm`` (weight and bias): the norm's own weight, in its dtype;
- into the up projection before a ``gated_activation`` (the down projection's input is
  ``act(gate) · up``, linear in ``up``): the rows of a ``linear``'s weight and bias, or the per-row scales of
  an ``int8_w8a8_linear``, ``int8_wo_linear`` or per-channel ``fp8_linear`` (exact: the scale absorbs the factor).

- into the value projection before attention (o_proj's input is attention's output, heads × value dims,
  linear in the values channel by channel), when the factors are equal over the query heads that share a
  key-value head (``load_weights`` shares them: ``share_head_smoothing``), and not with an fp8 KV cache
  (its value scales were calibrated on the unscaled values): the value projection's rows, as for up.

Factors that are all one (a W8A8 checkpoint's: its smoothing is in its norms already) are dropped
wherever they are. Anything else keeps its smoothing in the op.
The factors folded, and the row scales of a quantized up projection as they were before, are kept in
``context.folded_smoothing`` (parameter name → tensor): verification builds its Hugging Face reference from
the quantize stage's tensors (the unfolded model, whose norms are the checkpoint's) and rounds each
projection's input as the op would have, the same function up to rounding.

    # YAML: transforms: {fold_smoothing: {enabled: false}} leaves the smoothing in the ops
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx import GraphModule

from autodeploy.custom_ops.quantized_linear import row_scaled_ops
from autodeploy.transforms.cleanup_transposes import permutation
from autodeploy.transforms.quantize_linear import (
    GATED_ACTIVATION,
    LINEAR,
    RESHAPES,
    SMOOTHQUANT,
    attention_heads,
    through_views,
)
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

RMS_NORM = torch.ops.autodeploy.rms_norm.default
ADD_RMS_NORM = torch.ops.autodeploy.add_rms_norm.default
LAYER_NORM = torch.ops.autodeploy.layer_norm.default


def _own(gm: GraphModule, node) -> torch.Tensor | None:
    """The parameter a get_attr node reads, when that node is its only reader in the graph."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or len(node.users) != 1:
        return None
    if sum(n.op == "get_attr" and n.target == node.target for n in gm.graph.nodes) != 1:
        return None
    try:
        return gm.get_parameter(node.target)
    except AttributeError:
        return None


def _scale_rows(tensor: torch.Tensor, factors: torch.Tensor, offset: float = 0.0) -> None:
    """``tensor ← (offset + tensor) · factors − offset`` over its first dim, computed in float32, in place."""
    shape = (-1,) + (1,) * (tensor.dim() - 1)
    scaled = (offset + tensor.to(torch.float32)) * factors.to(tensor.device, torch.float32).reshape(shape) - offset
    with torch.no_grad():
        tensor.copy_(scaled.to(tensor.dtype))


def _scale_own(gm: GraphModule, rows: fx.Node, bias, factors: torch.Tensor, offset: float = 0.0) -> bool:
    """Scale the parameter ``rows`` reads (a factor per row) and ``bias``'s, when each is its reader's own and
    has a row per factor; False (nothing changed) otherwise."""
    tensors = [_own(gm, rows)] + ([] if bias is None else [_own(gm, bias)])
    if any(t is None or t.shape[0] != factors.shape[0] for t in tensors):
        return False
    _scale_rows(tensors[0], factors, offset)
    for tensor in tensors[1:]:
        _scale_rows(tensor, factors)
    return True


def _scale_projection_rows(gm: GraphModule, projection, factors: torch.Tensor, originals: dict) -> str | None:
    """Scale a ``linear``'s weight and bias rows, or a row-scaled quantized projection's scales and bias, by
    ``factors`` (one a row), when ``projection`` is the only reader of its parameters and has one reader."""
    if not isinstance(projection, fx.Node) or projection.op != "call_function" or len(projection.users) != 1:
        return None
    if projection.target is LINEAR:
        rows = projection.args[1]
    elif projection.target in (row_scaled := row_scaled_ops()):  # the scale argument of each scheme's row-scaled ops
        # A per-tensor fp8 scale cannot take a factor per row: _scale_own refuses it.
        rows = projection.args[row_scaled[projection.target]]
        if _own(gm, rows) is not None:
            originals.setdefault(rows.target, gm.get_parameter(rows.target).detach().clone())
    else:
        return None
    return f"{projection.name} rows" if _scale_own(gm, rows, projection.args[-1], factors) else None


def _fold_into_values(gm: GraphModule, source: fx.Node, factors: torch.Tensor, originals: dict) -> str | None:
    """``source`` is attention's output flattened (heads × value dims, o_proj's input): the factors, equal over
    the query heads that share a key-value head, scale the value projection's rows (attention is linear in
    the values, channel by channel)."""
    heads = attention_heads(source)
    if heads is None:
        return None
    attention, kv_heads, group, head_dim = heads
    if through_views(source) is not attention or len(attention.users) != 1:
        return None  # another op reads attention's output on the way
    grouped = factors.reshape(kv_heads, group, head_dim)
    if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
        return None
    return _scale_projection_rows(gm, through_views(attention.args[2]), grouped[:, 0].reshape(-1), originals)


def _fold_into_producer(gm: GraphModule, source: fx.Node, factors: torch.Tensor, originals: dict,
                        values: bool) -> str | None:
    """Apply ``factors`` per channel to what ``source`` computes by changing its parameters; returns what was
    changed, or None when ``source`` is not an op this transform can fold into (its parameters untouched).
    A quantized projection's scales keep their values before the fold in ``originals`` (by parameter name).
    ``values``: attention's output may take the factors through its value projection."""
    if values and source.op == "call_function" and (source.target in RESHAPES or permutation(source) is not None):
        return _fold_into_values(gm, source, factors, originals)
    producer, index = source, None
    if source.op == "call_function" and source.target is operator.getitem:
        producer, index = source.args[0], source.args[1]
    if producer.op != "call_function":
        return None
    if producer.target is RMS_NORM or (producer.target is ADD_RMS_NORM and index == 0):
        # The other output of add_rms_norm (the residual sum) does not pass through the weight.
        weight_argument, offset_index = (1, 3) if producer.target is RMS_NORM else (2, 4)
        offset = producer.args[offset_index] if len(producer.args) > offset_index else producer.kwargs.get("weight_offset", 0.0)
        return f"{producer.name} weight" if _scale_own(gm, producer.args[weight_argument], None, factors, float(offset)) else None
    if producer.target is LAYER_NORM and index is None:
        changed = f"{producer.name} weight{'' if producer.args[2] is None else ' and bias'}"
        return changed if _scale_own(gm, producer.args[1], producer.args[2], factors) else None
    if producer.target is GATED_ACTIVATION and index is None:
        return _scale_projection_rows(gm, producer.args[1], factors, originals)
    return None


@register_transform("fold_smoothing", stage="fuse")
class FoldSmoothing(Transform):
    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        readers: dict[fx.Node, list[fx.Node]] = {}
        for node in module.graph.find_nodes(op="call_function", target=SMOOTHQUANT):
            if node.args[3] is not None:
                readers.setdefault(node.args[0], []).append(node)
        if any(module.get_parameter(p.args[3].target).is_meta for nodes in readers.values() for p in nodes):
            return TransformResult(notes="weights not loaded (meta device): the smoothing stays in the ops")
        folded = context.folded_smoothing
        # An fp8 KV cache's value scales were calibrated on the values as the checkpoint makes them.
        settings = getattr(context, "settings", None)
        values = settings is None or settings.quantize.kv_cache != "fp8"
        details, kept, moved = [], [], 0
        for source, projections in readers.items():
            smooths = [module.get_parameter(p.args[3].target) for p in projections]
            if any(not torch.equal(smooths[0], other) for other in smooths[1:]):
                kept.append(f"{source.name}: its projections' smoothing differs")
                continue
            # All ones (a W8A8 checkpoint's, whose smoothing is in its norms already): nothing to move.
            ones = bool((smooths[0] == 1).all())
            if set(source.users) != set(projections) and not ones:
                kept.append(f"{source.name}: read by other ops too")
                continue
            changed = "nothing (all ones)" if ones else _fold_into_producer(module, source, smooths[0], folded, values)
            if changed is None:
                kept.append(f"{source.name}: not a norm, an up projection or attention over a value projection"
                            f"{'' if values else ' (values: not with an fp8 KV cache)'} that can take it")
                continue
            for projection in projections:
                smooth_node = projection.args[3]
                folded[smooth_node.target] = module.get_parameter(smooth_node.target).detach().clone()
                projection.update_arg(3, None)
                if not smooth_node.users:
                    module.graph.erase_node(smooth_node)
                    owner, _, leaf = smooth_node.target.rpartition(".")
                    delattr(module.get_submodule(owner), leaf)
            details.append(f"{', '.join(p.name for p in projections)}: smoothing folded into {changed}")
            moved += len(projections)
        total = sum(len(p) for p in readers.values())
        notes = (f"smoothing folded into {len(details)} norms or linears ({moved} of {total} smoothquant projections)"
                 if readers else "no smoothquant projection with its own smoothing")
        return TransformResult(matches=len(details), changed=bool(details), notes=notes,
                               details=details + [f"kept in the op: {k}" for k in kept])
