"""``shard_tensor_parallel`` (stage ``shard``): each rank of a tensor-parallel world keeps a slice of every
attention and MLP, found from the canonical graph, not from module names.

With ``distributed.tensor_parallel = N`` (one process per rank, ``torch.distributed`` initialised), rank ``r``
keeps:

- **attention**: the query, key and value projections feeding each canonical ``attention`` (walked back
  through views, transposes, ``rope`` and per-head norms) keep rows ``r/N … (r+1)/N`` of their weight and
  bias: whole heads, since HF's views give the head count as ``-1`` and ``attention`` reads heads and KV
  heads from its inputs; the output projection reading attention (walked forward through views) keeps the
  matching columns, and an ``all_reduce`` sums the ranks' partial products (its bias added after);
- **MLPs**: ``gated_mlp`` keeps rows of its gate and up weights and columns of its down weight, ``mlp`` rows
  of its up weight and bias and columns of its down weight; an ``all_reduce`` follows each (``mlp``'s down
  bias added after);
- **the vocabulary**: the token embedding keeps rows ``r/N … (r+1)/N`` (``embedding_rows`` looks up the ids
  that fall in them, zeros for the others, and an ``all_reduce`` sums the ranks'), and so does the LM head,
  the linear behind the logits through soft-capping and casts (an ``all_gather`` puts the ranks' logits
  side by side); a tied table is sliced once for both.

Norms stay replicated. The parameters change shape on the meta graph; ``load_weights`` keeps each rank's
slice (``SHARDS``: graph parameter → ``(dim, rank, parts)``). Refused with a ``ConfigError`` naming the
constraint, before any weight is read: heads, KV heads, an MLP width or the vocabulary that ``N`` does not
divide (fewer KV heads than ranks included), attention with per-head tensors besides q/k/v (sinks), a
projection feeding attention that is not found, MoE layers, and quantization (calibration and its
statistics are not sliced yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.fx import GraphModule

from autodeploy.errors import ConfigError
from autodeploy.transforms.insert_cached_attention import lm_head
from autodeploy.transforms.quantize_linear import ATTENTION, LINEAR, attention_heads, through_views
from autodeploy.transforms.registry import Transform, TransformConfig, TransformContext, TransformResult, register_transform
from autodeploy.transforms.shape_propagation import propagate_shapes

ops = torch.ops.autodeploy
SHARDS = "autodeploy_shards"  # gm.meta key: graph parameter name → (dim, rank, parts), read by load_weights
_PASS_THROUGH = {ops.rope.default, ops.rms_norm.default}  # per-head ops between a projection and attention


@dataclass
class ShardTensorParallelConfig(TransformConfig):
    stage: str = "shard"


def _producer(node):
    """The ``linear`` behind one of attention's q/k/v inputs, through views, transposes and per-head ops."""
    while True:
        node = through_views(node, single_reader=False)
        if isinstance(node, fx.Node) and node.op == "call_function" and node.target in _PASS_THROUGH:
            node = node.args[0]
            continue
        return node if isinstance(node, fx.Node) and node.op == "call_function" and node.target is LINEAR else None


class _Sharder:
    def __init__(self, gm: GraphModule, rank: int, parts: int):
        self.gm, self.rank, self.parts = gm, rank, parts
        self.shards: dict[str, tuple[int, int, int]] = gm.meta.setdefault(SHARDS, {})

    def slice(self, weight, dim: int, what: str) -> None:
        """Give the parameter behind ``weight`` (a get_attr) this rank's share of ``dim``."""
        if weight is None:
            return
        target = weight.target
        if target in self.shards:  # a parameter two nodes read (a tied table): sliced once, alike for both
            if self.shards[target][0] != dim:
                raise ConfigError(f"tensor parallelism would slice {target.removeprefix('model.')} along dims "
                                  f"{self.shards[target][0]} and {dim} for two readers; deploy with tensor_parallel=1")
            return
        param = self.gm.get_parameter(target)
        if param.shape[dim] % self.parts:
            raise ConfigError(f"tensor_parallel={self.parts} does not divide {what} ({target.removeprefix('model.')}: "
                              f"{param.shape[dim]} along dim {dim}); choose a tensor_parallel that divides it")
        shape = list(param.shape)
        shape[dim] //= self.parts
        owner, _, leaf = target.rpartition(".")
        module = self.gm.get_submodule(owner) if owner else self.gm
        module._parameters[leaf] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device), requires_grad=False)
        self.shards[target] = (dim, self.rank, self.parts)

    def reduce_after(self, node: fx.Node, bias=None) -> None:
        """``all_reduce(node)`` (+ ``bias``) in place of ``node`` for all its readers."""
        graph = self.gm.graph
        with graph.inserting_after(node):
            total = graph.call_function(ops.all_reduce.default, (node,))
        result = total
        if bias is not None:
            with graph.inserting_after(total):
                result = graph.call_function(torch.ops.aten.add.Tensor, (total, bias))
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user is not total)
        for new in (total, result):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})


def _check_heads(attention: fx.Node, parts: int) -> None:
    q, v = attention.args[0].meta.get("val"), attention.args[2].meta.get("val")
    heads, kv_heads = q.shape[-2], v.shape[-2]
    if heads % parts or kv_heads % parts:
        raise ConfigError(
            f"tensor_parallel={parts} must divide the attention heads ({heads}) and key-value heads ({kv_heads}) "
            f"of {attention.name}; choose a tensor_parallel that divides both")
    extra = [a for a in attention.args[3:] if isinstance(a, fx.Node)]
    if extra:
        raise ConfigError(f"tensor parallelism does not yet slice attention's per-head tensors besides q/k/v "
                          f"({', '.join(a.name for a in extra)} of {attention.name}); deploy with tensor_parallel=1")


@register_transform("shard_tensor_parallel")
class ShardTensorParallel(Transform):
    """Slice attention and MLP weights over the tensor-parallel ranks, with an all-reduce after each block."""

    config_class = ShardTensorParallelConfig

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        settings = context.settings
        parts = int(settings.distributed.tensor_parallel)
        if parts == 1:
            return TransformResult(notes="tensor_parallel=1: nothing to shard")
        if any(n.target is ops.moe.default for n in module.graph.nodes if n.op == "call_function"):
            raise ConfigError("tensor parallelism of MoE layers (expert parallel) is not available yet; "
                              "deploy this model with tensor_parallel=1")
        if settings.quantize.default != "none" or any(v != "none" for v in dict(settings.quantize.layers).values()):
            raise ConfigError("tensor_parallel > 1 with quantization is not available yet (calibration and scales "
                              "are not sliced per rank); set quantize.default=none or tensor_parallel=1")
        sharder = _Sharder(module, dist.get_rank(), parts)
        graph = module.graph
        attentions = list(graph.find_nodes(op="call_function", target=ATTENTION))
        for attention in attentions:
            _check_heads(attention, parts)
            for role, arg in zip("qkv", attention.args[:3]):
                projection = _producer(arg)
                if projection is None:
                    raise ConfigError(f"tensor parallelism found no projection behind {attention.name}'s {role} input; "
                                      f"deploy this model with tensor_parallel=1")
                sharder.slice(projection.args[1], 0, f"the {role} projection's rows")
                sharder.slice(projection.args[2], 0, f"the {role} projection's bias")
        row_parallel = 0
        for linear in list(graph.find_nodes(op="call_function", target=LINEAR)):
            heads = attention_heads(linear.args[0])
            if heads is None or heads[0] not in attentions:
                continue
            sharder.slice(linear.args[1], 1, "the output projection's columns")
            bias = linear.args[2]
            linear.args = (*linear.args[:2], None)
            sharder.reduce_after(linear, bias)
            row_parallel += 1
        mlps = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is ops.gated_mlp.default:
                x, gate, up, down, *_ = node.args
                sharder.slice(gate, 0, "the MLP's gate rows")
                sharder.slice(up, 0, "the MLP's up rows")
                sharder.slice(down, 1, "the MLP's down columns")
                sharder.reduce_after(node)
            elif node.target is ops.mlp.default:
                x, up, up_bias, down, down_bias, *_ = node.args
                sharder.slice(up, 0, "the MLP's up rows")
                sharder.slice(up_bias, 0, "the MLP's up bias")
                sharder.slice(down, 1, "the MLP's down columns")
                node.args = (x, up, up_bias, down, None, *node.args[5:])
                sharder.reduce_after(node, down_bias)
            else:
                continue
            mlps += 1
        vocabulary = self._shard_vocabulary(module, sharder)
        graph.lint()
        module.recompile()
        propagate_shapes(module)
        notes = (f"rank {sharder.rank} of {parts}: {len(attentions)} attentions ({row_parallel} output projections "
                 f"all-reduced), {mlps} MLPs, {vocabulary}; {len(sharder.shards)} parameters sliced")
        return TransformResult(matches=len(attentions) + mlps, changed=True, notes=notes)

    @staticmethod
    def _shard_vocabulary(module: GraphModule, sharder: _Sharder) -> str:
        """Rows of the token embedding (looked up where an id falls in this rank's rows, then summed over
        ranks) and of the LM head (its logits gathered along the vocabulary); a tied table is sliced once."""
        graph = module.graph
        embeddings = 0
        for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default)):
            weight, ids = node.args[:2]
            if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
                continue
            sharder.slice(weight, 0, "the vocabulary (embedding rows)")
            rows = module.get_parameter(weight.target).shape[0]
            with graph.inserting_before(node):
                lookup = graph.call_function(ops.embedding_rows.default, (weight, ids, sharder.rank * rows))
            lookup.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            node.replace_all_uses_with(lookup)
            graph.erase_node(node)
            sharder.reduce_after(lookup)
            embeddings += 1
        output = graph.output_node().args[0]
        head = lm_head(output[0] if isinstance(output, (tuple, list)) else output)
        if head is None:
            return f"{embeddings} embeddings vocabulary-parallel, the LM head replicated (no linear behind the logits)"
        sharder.slice(head.args[1], 0, "the vocabulary (LM head rows)")
        sharder.slice(head.args[2], 0, "the LM head's bias")
        with graph.inserting_after(head):
            gathered = graph.call_function(ops.all_gather.default, (head,))
        gathered.meta.update({k: v for k, v in head.meta.items() if k != "val"})
        head.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
        return f"{embeddings} embeddings and the LM head vocabulary-parallel"
