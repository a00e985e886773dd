"""``shard_tensor_parallel`` (stage ``shard``): each rank of a tensor-parallel world keeps a slice of every
attention and MLP, found from the canonical graph, not from module names.

With ``distributed.tensor_parallel = N`` (one process per rank, ``torch.distributed`` initialised), rank ``r``
keeps:

- **attention**: the query, key and value projections feeding each canonical ``attention`` (walked back
  through views, transposes, ``rope`` and per-head norms) keep rows ``r/N … (r+1)/N`` of their weight and
  bias: whole heads, since HF's views give the head count as ``-1`` and ``attention`` reads heads and KV
  heads from its inputs. With fewer KV heads than ranks (``N`` a multiple of them), rank ``r`` keeps the
  rows of KV head ``r · kv_heads // N``, the one its query heads read, replicated on the ``N / kv_heads``
  ranks that share it (per-head norms, e.g. Qwen3's on q and k, have one head's width: not sliced). The
  output projection reading attention (walked forward through views) keeps the matching columns, and an
  ``all_reduce`` sums the ranks' partial products (its bias added after);
- **MLPs**: ``gated_mlp`` keeps rows of its gate and up weights and columns of its down weight, ``mlp`` rows
  of its up weight and bias and columns of its down weight; an ``all_reduce`` follows each (``mlp``'s down
  bias added after);
- **the vocabulary**: the token embedding keeps rows ``r/N … (r+1)/N`` (``embedding_rows`` looks up the ids
  that fall in them, zeros for the others, and an ``all_reduce`` sums the ranks'), and so does the LM head,
  the linear behind the logits through soft-capping, casts and a bias (an ``all_gather`` puts the ranks' logits
  side by side); a tied table is sliced once for both. Tables of another length (learned positions) stay whole;
- **an encoder–decoder** (``export/encoder_decoder.py``; this pass runs on its ``"encoder"`` graph too): the
  encoder's ``bidirectional_attention`` is sliced as ``attention`` is; the encoder graph's outputs, every decoder
  layer's cross keys and values, keep the rows of rank ``r``'s key-value heads (no gather), and the decoder
  graph's ``cross_keys`` / ``cross_values`` inputs are declared with those heads, so its cross-attention (a
  ``bidirectional_attention`` reading them) slices only its query and output projections, and the cache stage
  sizes each rank's cross-KV pool for its heads;
- **T5's relative position bias**: an attention's ``bias`` computed by ``relative_position_bias`` (one a stack, shared
  by its layers) comes from a ``table[num_buckets, heads]``; rank ``r`` keeps the table's columns of its query heads,
  so the bias it adds is its heads' (and the cache stage's ``relative_position_bias_by_distance`` is ``[its heads, L]``).

Norms stay replicated. ``distributed.rules`` (globs over the linears' module paths, as the checkpoint names
them: ``model.layers.*.self_attn.o_proj``, ``lm_head``; the first matching glob wins) override the detection
for the canonical ``linear`` nodes they match: ``colwise`` keeps rows of the weight and bias (the output
stays sliced: a ``rowwise`` linear must read it), ``rowwise`` keeps columns with an ``all_reduce`` after (the
bias added after it), ``replicate`` keeps the linear whole (for the LM head: no ``all_gather``, and a table
tied to it stays whole for the embedding too). A ``gated_mlp`` / ``mlp`` op whose weight a ``replicate`` rule
names (``model.layers.3.mlp.down_proj``) stays whole with no ``all_reduce``; its weights are sliced together,
so another kind there is a ``ConfigError``. Rules whose slices do not fit together are a ``ConfigError``
naming them (the shapes after the pass do not fit); a glob that matches nothing is logged as a warning.

The parameters change shape on the meta graph; ``SHARDS`` records graph parameter → ``(dim, start, stop)``,
and ``load_weights`` reads only that slice of a checkpoint tensor that fills the parameter as it is stored
(safetensors' ``get_slice``), the whole tensor then narrowed for one that transformers converts (fused or
split projections, stacked experts). MoE experts are ``shard_expert_parallel``'s. Refused with a
``ConfigError`` naming the constraint, before any weight is read: query heads, an MLP width or the vocabulary
that ``N`` does not divide, KV heads that ``N`` neither divides nor is a multiple of, attention with per-head
tensors besides q/k/v (sinks), a projection feeding attention that is not found, and quantization
(calibration and its statistics are not sliced yet).

```python
from autodeploy import autodeploy
llm = autodeploy("Qwen/Qwen2.5-0.5B", tensor_parallel=2, distributed={"rules": {"lm_head": "replicate"}})
```
"""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import fx, nn
from torch.fx import GraphModule

from autodeploy.custom_ops import parallel_state
from autodeploy.deployment import ENCODER, MODEL
from autodeploy.errors import ConfigError, error_summary
from autodeploy.transforms.insert_cached_attention import cross_attentions, lm_head
from autodeploy.transforms.quantize_linear import ATTENTION, LINEAR, attention_heads, module_path, quantizes_dense_layers, through_views
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform
from autodeploy.transforms.shape_propagation import propagate_shapes

logger = logging.getLogger(__name__)
ops = torch.ops.autodeploy
SHARDS = "autodeploy_shards"  # gm.meta key: graph parameter → (dim, start, stop) this rank keeps; load_weights reads it
_PASS_THROUGH = {ops.rope.default, ops.rms_norm.default}  # per-head ops between a projection and attention
# An encoder's self-attention and an encoder–decoder's cross-attention are bidirectional: sliced by heads alike.
_ATTENTIONS = (ATTENTION, ops.bidirectional_attention.default)
_POSITION_BIAS = ops.relative_position_bias.default  # T5's: a [num_buckets, heads] table looked up by distance


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
        self.whole: set[str] = set()  # parameters a ``replicate`` rule keeps whole

    def slice(self, weight, dim: int, what: str, span: tuple[int, int] | None = None) -> None:
        """Give the parameter behind ``weight`` (a get_attr) the indices ``span = (start, stop)`` of ``dim``;
        by default this rank's ``1/parts`` of them."""
        if weight is None:
            return
        target = weight.target
        if target in self.whole:
            raise ConfigError(f"distributed.rules keep {target.removeprefix('model.')} whole, but another reader "
                              f"slices it ({what}); name that reader in distributed.rules too, or drop the rule")
        if target in self.shards:  # a parameter two nodes read (a tied table): sliced once, alike for both
            if self.shards[target][0] != dim:
                raise ConfigError(f"tensor parallelism would slice {target.removeprefix('model.')} along dims "
                                  f"{self.shards[target][0]} and {dim} for two readers; deploy with tensor_parallel=1")
            return
        param = self.gm.get_parameter(target)
        size = param.shape[dim]
        if span is None:
            if size % self.parts:
                raise ConfigError(f"tensor_parallel={self.parts} does not divide {what} ({target.removeprefix('model.')}: "
                                  f"{size} along dim {dim}); choose a tensor_parallel that divides it")
            span = (self.rank * size // self.parts, (self.rank + 1) * size // self.parts)
        start, stop = span
        if not 0 <= start < stop <= size:
            raise ConfigError(f"tensor parallelism would keep {start} … {stop} of {target.removeprefix('model.')}'s "
                              f"{size} along dim {dim} ({what}); deploy this model with tensor_parallel=1")
        shape = list(param.shape)
        shape[dim] = stop - start
        owner, _, leaf = target.rpartition(".")
        module = self.gm.get_submodule(owner) if owner else self.gm
        module._parameters[leaf] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device), requires_grad=False)
        self.shards[target] = (dim, start, stop)

    def keep_whole(self, weight, what: str) -> None:
        """Leave the parameter behind ``weight`` whole on every rank (a ``replicate`` rule)."""
        if weight is None:
            return
        if weight.target in self.shards:
            raise ConfigError(f"distributed.rules keep {weight.target.removeprefix('model.')} whole ({what}), but "
                              f"another reader slices it; name that reader in distributed.rules too, or drop the rule")
        self.whole.add(weight.target)

    def row_parallel(self, linear: fx.Node, what: str) -> None:
        """Columns of ``linear``'s weight; an ``all_reduce`` sums the ranks' partial products, its bias added after."""
        self.slice(linear.args[1], 1, what)
        bias = linear.args[2]
        linear.args = (*linear.args[:2], None)
        self.reduce_after(linear, bias)

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


def _head_rows(attention: fx.Node, rank: int, parts: int) -> dict[str, tuple[int, int]]:
    """The query heads (``"heads"``) and the rows of the q, k and v projections rank ``rank`` keeps: its ``1/parts``
    of the query heads and of the key-value heads, or, with fewer key-value heads than ranks, the one key-value head
    its query heads read (head ``rank · kv_heads // parts``, replicated on the ``parts / kv_heads`` ranks that share
    it)."""
    q, k, v = (a.meta.get("val") for a in attention.args[:3])
    heads, kv_heads = q.shape[-2], v.shape[-2]
    if heads % parts or (kv_heads % parts and parts % kv_heads):
        raise ConfigError(
            f"tensor_parallel={parts} must divide the attention heads ({heads}) and key-value heads ({kv_heads}) "
            f"of {attention.name}, or, for the key-value heads, be a multiple of them (each then replicated); "
            f"choose a tensor_parallel that divides {heads} and divides or is a multiple of {kv_heads}")
    if attention.target is torch.ops.autodeploy.attention.default and len(attention.args) > 7 and attention.args[7]:
        raise ConfigError(f"tensor parallelism does not yet slice ALiBi's per-head slopes ({attention.name}: "
                          f"{len(attention.args[7])} slopes); deploy this model with tensor_parallel=1")
    extra = [a for a in attention.args[3:] if isinstance(a, fx.Node) and a.target is not _POSITION_BIAS]
    if extra:
        raise ConfigError(f"tensor parallelism does not yet slice attention's per-head tensors besides q/k/v and T5's "
                          f"relative position bias ({', '.join(a.name for a in extra)} of {attention.name}); deploy "
                          f"with tensor_parallel=1")
    first, count = kv_head_span(rank, parts, kv_heads)
    per_rank = heads // parts
    return {"heads": (rank * per_rank, (rank + 1) * per_rank),
            "q": (rank * per_rank * q.shape[-1], (rank + 1) * per_rank * q.shape[-1]),
            "k": (first * k.shape[-1], (first + count) * k.shape[-1]),
            "v": (first * v.shape[-1], (first + count) * v.shape[-1])}


def kv_head_span(rank: int, parts: int, kv_heads: int) -> tuple[int, int]:
    """``(first, count)``: the key-value heads rank ``rank`` of ``parts`` keeps (one, shared, when they are fewer)."""
    return rank * kv_heads // parts, max(kv_heads // parts, 1)


def _cross_inputs(graph: fx.Graph) -> list[fx.Node]:
    """An encoder–decoder's decoder graph: the ``cross_keys`` / ``cross_values`` inputs its cross-attentions read."""
    return list(dict.fromkeys(node.args[i].args[0] for node in cross_attentions(graph).values() for i in (1, 2)))


def _narrow_heads(placeholder: fx.Node, rank: int, parts: int) -> None:
    """The decoder graph's cross keys (values) input ``[layers, B, S, heads, head_dim]`` holds this rank's key-value
    heads: the encoder graph, sliced alike, gives those only (the cache stage sizes the cross-KV pool from it)."""
    value = placeholder.meta["val"]
    _, count = kv_head_span(rank, parts, value.shape[3])
    with value.fake_mode:
        placeholder.meta["val"] = value.new_empty((*value.shape[:3], count, *value.shape[4:]))


def _cross_kv_projections(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """An encoder–decoder's encoder graph (``export/encoder_decoder.py``): its outputs stack every decoder layer's
    cross keys and values ``[B, S, heads, head_dim]``; each one's ``(projection, its view as heads)``."""
    found = []
    for output in graph.output_node().args[0]:
        for heads in output.args[0] if output.target is torch.ops.aten.stack.default else [output]:
            projection = _producer(heads)
            if projection is None:
                raise ConfigError(f"tensor parallelism found no projection behind the encoder graph's output {heads.name} "
                                  f"(an encoder-decoder's cross keys and values); deploy this model with tensor_parallel=1")
            found.append((projection, heads))
    return found


_MLPS = (ops.gated_mlp.default, ops.mlp.default)


def _ruled_nodes(module: GraphModule, rules: dict[str, str]) -> tuple[dict[fx.Node, str], set[fx.Node]]:
    """The canonical ``linear`` nodes whose module path (``model.layers.0.self_attn.o_proj``, ``lm_head``) a glob
    of ``distributed.rules`` matches → that rule's kind (the first matching glob wins), and the MLP ops
    (``gated_mlp`` / ``mlp``) a ``replicate`` rule names one of the weights of (``model.layers.0.mlp.down_proj``):
    their weights are sliced together, so ``replicate`` (all of them whole) is the one rule they take."""
    def first_glob(weight) -> str | None:
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
            return None
        return next((glob for glob in rules if fnmatch.fnmatchcase(module_path(weight.target), glob)), None)

    linears, mlps, used = {}, set(), set()
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is LINEAR:
            glob = first_glob(node.args[1])
            if glob is not None:
                linears[node] = rules[glob]
                used.add(glob)
        elif node.target in _MLPS:
            for weight in node.args[1:]:
                glob = first_glob(weight)
                if glob is None:
                    continue
                if rules[glob] != "replicate":
                    raise ConfigError(f"distributed.rules[{glob!r}] = {rules[glob]} names {module_path(weight.target)}, a "
                                      f"weight of the MLP op {node.name}, whose weights tensor parallelism slices together "
                                      f"(gate / up rows, down columns); an MLP takes only replicate")
                mlps.add(node)
                used.add(glob)
    for glob in rules:
        if glob not in used:
            logger.warning("distributed.rules[%r] matches no linear layer or MLP of this model; check the module paths "
                           "(e.g. 'model.layers.*.self_attn.o_proj', 'lm_head')", glob)
    return linears, mlps


def _width_mismatch(module: GraphModule) -> str | None:
    """The first ``linear`` whose input is not as wide as its weight (``linear``'s fake op does not check)."""
    for linear in module.graph.find_nodes(op="call_function", target=LINEAR):
        x, weight = linear.args[:2]
        value = x.meta.get("val") if isinstance(x, fx.Node) else None
        if value is None or not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
            continue
        columns = module.get_parameter(weight.target).shape[-1]
        if value.shape[-1] != columns:
            return f"{module_path(weight.target)} reads {value.shape[-1]} features but its weight has {columns} columns"
    return None


def _apply_rules(sharder: _Sharder, ruled: dict[fx.Node, str]) -> None:
    for linear, kind in ruled.items():
        weight, bias = linear.args[1:3]
        what = f"distributed.rules: {module_path(weight.target)} {kind}"
        if kind == "replicate":
            sharder.keep_whole(weight, what)
            sharder.keep_whole(bias, what)
        elif kind == "colwise":
            sharder.slice(weight, 0, what)
            sharder.slice(bias, 0, what)
        else:
            sharder.row_parallel(linear, what)


@register_transform("shard_tensor_parallel", stage="shard", roles=(MODEL, ENCODER))
class ShardTensorParallel(Transform):
    """Slice attention and MLP weights over the tensor-parallel ranks, with an all-reduce after each block."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        settings = context.settings
        parts = int(settings.distributed.tensor_parallel)
        if parts == 1:
            return TransformResult(notes="tensor_parallel=1: nothing to shard")
        # MoE experts are shard_expert_parallel's (next in this stage): sliced by intermediate size, or placed.
        if quantizes_dense_layers(settings):
            raise ConfigError("tensor_parallel > 1 with quantization is not available yet (calibration and scales "
                              "are not sliced per rank); set quantize.default=none or tensor_parallel=1")
        sharder = _Sharder(module, parallel_state.layout().stage_rank, parts)
        graph = module.graph
        rules = {str(glob): str(kind) for glob, kind in dict(settings.distributed.rules).items()}
        ruled, whole_mlps = _ruled_nodes(module, rules)  # rules first: a table they keep whole stays whole for its other readers
        _apply_rules(sharder, ruled)
        attentions = [node for node in graph.nodes if node.op == "call_function" and node.target in _ATTENTIONS]
        cross = set(cross_attentions(graph).values())
        replicated = 0  # attentions whose key-value heads are fewer than the ranks
        biased = False  # attentions adding a relative position bias (T5)
        for attention in attentions:
            # A cross-attention's keys and values are inputs, from the encoder graph sliced alike: its query is projected here.
            projections = [_producer(arg) for arg in attention.args[:1 if attention in cross else 3]]
            for role, projection in zip("qkv", projections):
                if projection is None:
                    raise ConfigError(f"tensor parallelism found no projection behind {attention.name}'s {role} input; "
                                      f"deploy this model with tensor_parallel=1")
            if attention in cross and projections[0] in ruled:
                raise _cross_rule(projections[0])
            if all(projection in ruled for projection in projections):
                continue
            rows = _head_rows(attention, sharder.rank, parts)
            replicated += attention.args[2].meta["val"].shape[-2] < parts
            for role, projection in zip("qkv", projections):
                if projection not in ruled:
                    sharder.slice(projection.args[1], 0, f"the {role} projection's rows", rows[role])
                    sharder.slice(projection.args[2], 0, f"the {role} projection's bias", rows[role])
            for bias in attention.args[3:]:  # a stack's layers share the table: sliced once, the same heads
                if isinstance(bias, fx.Node) and bias.target is _POSITION_BIAS:
                    sharder.slice(bias.args[0], 1, "the relative position bias's heads", rows["heads"])
                    biased = True
        for placeholder in _cross_inputs(graph):
            _narrow_heads(placeholder, sharder.rank, parts)
        cross_outputs = _cross_kv_projections(graph) if context.role == ENCODER else []
        for projection, heads in cross_outputs:  # column-parallel, no gather: each rank's cross-KV pool holds its heads
            if projection in ruled:
                raise _cross_rule(projection)
            first, count = kv_head_span(sharder.rank, parts, heads.meta["val"].shape[-2])
            width = heads.meta["val"].shape[-1]
            for tensor in projection.args[1:3]:
                sharder.slice(tensor, 0, "the cross keys' and values' rows", (first * width, (first + count) * width))
        row_parallel = 0
        for linear in list(graph.find_nodes(op="call_function", target=LINEAR)):
            heads = attention_heads(linear.args[0], _ATTENTIONS)
            if heads is None or heads[0] not in attentions or linear in ruled:
                continue
            sharder.row_parallel(linear, "the output projection's columns")
            row_parallel += 1
        mlps = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node in whole_mlps:
                for weight in node.args[1:]:
                    if isinstance(weight, fx.Node) and weight.op == "get_attr":
                        sharder.keep_whole(weight, f"distributed.rules: the MLP {node.name} replicated")
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
        vocabulary = self._shard_vocabulary(module, sharder, ruled, _vocabulary_size(context), has_head=context.role == MODEL)
        try:
            propagate_shapes(module)
            problem = _width_mismatch(module) if ruled or whole_mlps else None
        except Exception as error:  # a fake op's shape check: what the rules slice does not fit together
            if not (ruled or whole_mlps):
                raise
            problem = error_summary(error)
        if problem:
            raise ConfigError(f"distributed.rules {rules} leave the graph's shapes inconsistent on rank {sharder.rank} "
                              f"of {parts} ({problem}); pair each colwise linear with the rowwise one reading it, and "
                              f"replicate both or neither")
        notes = (f"rank {sharder.rank} of {parts}: {len(attentions)} attentions ({row_parallel} output projections "
                 f"all-reduced), {mlps} MLPs, {vocabulary}; {len(sharder.shards)} parameters sliced")
        if replicated:
            notes += f"; key-value heads replicated in {replicated} attentions"
        if cross or cross_outputs:  # the decoder's cross-attentions read them, the encoder's outputs are them
            notes += f"; {len(cross) or len(cross_outputs) // 2} layers' cross keys and values: this rank's heads"
        if biased:
            notes += "; the relative position bias: this rank's heads"
        if ruled or whole_mlps:
            notes += f"; {len(ruled)} linears and {len(whole_mlps)} MLPs as distributed.rules say"
        return TransformResult(matches=len(attentions) + mlps, changed=True, notes=notes)

    @staticmethod
    def _shard_vocabulary(module: GraphModule, sharder: _Sharder, ruled: dict[fx.Node, str], vocabulary: int | None,
                          has_head: bool = True) -> str:
        """Rows of the token embedding (looked up where an id falls in this rank's rows, then summed over
        ranks) and of the LM head (its logits gathered along the vocabulary); a tied table is sliced once, and
        kept whole for the embedding too when a ``replicate`` rule keeps the LM head whole. Other tables (learned
        positions: rows other than ``vocabulary``, when it is known) stay whole. ``has_head``: the graph has an LM head."""
        graph = module.graph
        embeddings = kept = 0
        for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default)):
            weight, ids = node.args[:2]
            if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
                continue
            if vocabulary is not None and module.get_parameter(weight.target).shape[0] != vocabulary:
                continue
            if weight.target in sharder.whole:
                kept += 1
                continue
            sharder.slice(weight, 0, "the vocabulary (embedding rows)")
            first = sharder.shards[weight.target][1]
            with graph.inserting_before(node):
                lookup = graph.call_function(ops.embedding_rows.default, (weight, ids, first))
            lookup.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            node.replace_all_uses_with(lookup)
            graph.erase_node(node)
            sharder.reduce_after(lookup)
            embeddings += 1
        tables = f"{embeddings} embeddings" + (f" ({kept} kept whole with the LM head)" if kept else "")
        if not has_head:
            return f"{tables} vocabulary-parallel"
        output = graph.output_node().args[0]
        head = lm_head(output[0] if isinstance(output, (tuple, list)) else output)
        if head is None:
            return f"{tables} vocabulary-parallel, the LM head replicated (no linear behind the logits)"
        if head in ruled:
            return f"{tables} vocabulary-parallel, the LM head {ruled[head]} (distributed.rules)"
        sharder.slice(head.args[1], 0, "the vocabulary (LM head rows)")
        sharder.slice(head.args[2], 0, "the LM head's bias")
        with graph.inserting_after(head):
            gathered = graph.call_function(ops.all_gather.default, (head,))
        gathered.meta.update({k: v for k, v in head.meta.items() if k != "val"})
        head.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
        return f"{tables} and the LM head vocabulary-parallel"


def _vocabulary_size(context: TransformContext) -> int | None:
    """The model's vocabulary (how many rows a token embedding has), when the context has the model's config."""
    config = getattr(context.model_factory, "hf_config", None)
    return getattr(config.get_text_config(), "vocab_size", None) if config is not None else None


def _cross_rule(projection: fx.Node) -> ConfigError:
    return ConfigError(f"distributed.rules name {module_path(projection.args[1].target)}, an encoder-decoder's cross-attention "
                       f"projection: its keys and values are sliced by heads between the encoder and decoder graphs, which "
                       f"rules do not change; drop that rule")
