"""``insert_cached_attention`` (stage ``cache``): canonical attention → paged-KV ``cached_attention``.

After this pass the graph runs one *flattened* mixed batch per forward: ``input_ids``/``position_ids``
are ``[1, T]`` (the new tokens of every scheduled sequence, prompt chunks first, then decodes), and
every attention reads and writes a paged KV cache through the sequence metadata documented in
``custom_ops/cached_attention.py``. Everything else in a decoder (linears, norms, RoPE from the position
ids, MLPs) works token by token, so it runs unchanged on the flattened row.

The graph's inputs become the serving signature (``custom_ops/serving_signature.py``): token ids,
positions, the sequence metadata and one ``KVCacheSpec`` cache pair per attention layer
(``TransformContext.graph_inputs`` / ``kv_caches``), from which the runtime sizes its block pool.
``logit_index[N]`` picks the token rows whose logits are wanted (each sequence's last token while
generating); the gather sits before the LM head so the vocabulary projection runs for those rows only.
The output is ``logits[1, N, vocab]``. A deployment that drafts trees (``speculative.tree_width`` > 1) gets one
more input, ``tree_mask[T]`` (``TREE_MASK``), which every ``cached_attention`` reads; others never carry it. So
does a model whose image tokens attend to one another both ways in the prompt (Gemma 3: ``attend_until[T]``,
``ATTEND_UNTIL``; ``VisionLanguageSpec.bidirectional_images``). A pipeline stage (``shard_pipeline_parallel``)
holds some of the layers: it gets caches for those only (named by the model's layer index), and a stage before the
last, which receives its logits from the last stage, receives them for the ``N`` picked rows.

An encoder–decoder's decoder graph (``export/encoder_decoder.py``) takes every layer's cross-attention keys and values
as the dense inputs ``cross_keys`` / ``cross_values``; each layer's ``bidirectional_attention`` over its slice of them
becomes ``cached_cross_attention`` over a cross cache pair of its own (``cross_k_cache_i``, ``cross_v_cache_i``:
``TransformContext.cross_kv_caches``), which the runtime fills once a request from the encoder graph's output, read
through ``cross_lens`` and ``cross_block_tables``. Any other ``bidirectional_attention`` is an encoder's: refused here.

An attention with a ``bias`` (T5's decoder: a ``relative_position_bias`` over the graph's own positions, ``0 … T - 1``
for queries and keys alike) depends only on how far back each key is: its ``cached_attention`` reads the bias by
distance, ``relative_position_bias_by_distance(table, max_seq_len, …)`` (``[H, max_seq_len]``), computed once a forward
for every layer that shares the bias. Any other bias cannot be paged: refused.

Every attention of the model must have been matched: a layer left as aten ops would attend only
within the tokens of the current step, which is wrong, so that is an ``UnsupportedModelError``.

This pass inserts only the canonical ``cached_attention``; the ``select`` stage picks its kernel
(``backends: {cached_attention: [triton]}`` in YAML to choose one).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import fx
from torch.fx import GraphModule

from autodeploy.custom_ops.cached_attention import CachedAttentionArgs
from autodeploy.custom_ops.registry import positional
from autodeploy.custom_ops.serving_signature import (ATTEND_UNTIL, ATTENTION_METADATA, CROSS_METADATA, SEQUENCE_METADATA, TREE_MASK,
                                                     KVCacheSpec)
from autodeploy.errors import ConfigError, UnsupportedModelError
from autodeploy.deployment import MODEL
from autodeploy.export.causal_lm import GRAPH_PREFIX
from autodeploy.export.encoder_decoder import CROSS_KEYS, CROSS_VALUES
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

# gm.meta key: ``(first, total)``, the graph holds layers first … first + (its attentions) − 1 of the model's
# total (a pipeline stage, transforms/shard_pipeline_parallel.py); absent: all of them.
LAYERS = "autodeploy_layers"

logger = logging.getLogger(__name__)

# Shapes the new inputs' meta values carry, so backends' supports() and the autotuner can read them: a step of 2
# sequences and the traced token count (the sizes are placeholders; dtypes and the block size are real).
_EXAMPLE_SEQUENCES, _EXAMPLE_BLOCKS = 2, 4


def _metadata_values(queries: torch.Tensor) -> dict[str, torch.Tensor]:
    """Example values of the metadata inputs. The per-token ones (``slot_mapping``, ``tree_mask``) have the traced
    queries' token count, symbolic where it is, as every backend's ``supports`` expects of a real step."""
    n, meta = _EXAMPLE_SEQUENCES, dict(device="meta")

    def per_token() -> torch.Tensor:
        return queries.new_empty((queries.shape[1],), dtype=torch.long)

    return {
        "seq_start": torch.empty(n + 1, dtype=torch.int32, **meta),
        "kv_lens": torch.empty(n, dtype=torch.int32, **meta),
        "block_tables": torch.empty(n, _EXAMPLE_BLOCKS, dtype=torch.int32, **meta),
        "slot_mapping": per_token(),
        "batch_info": torch.empty(4, dtype=torch.int32, **meta),  # lives on the CPU at run time
        "logit_index": torch.empty(n, dtype=torch.long, **meta),
        TREE_MASK: per_token(),
        ATTEND_UNTIL: per_token(),
    }


def _arguments(node) -> dict:
    """An ``attention`` node's arguments by name."""
    return {**dict(zip((a.name for a in node.target._schema.arguments), node.args)), **node.kwargs}


def drafts_trees(settings) -> bool:
    """Whether the deployment verifies tree drafts (its graphs then take a ``tree_mask``)."""
    speculative = getattr(settings, "speculative", None)
    return speculative is not None and bool(speculative.method) and speculative.tree_width > 1


def bidirectional_blocks(context: TransformContext) -> bool:
    """Whether the model graph's prompts hold blocks of tokens that see one another both ways (its graph then takes
    an ``attend_until``): a vision-language model whose image tokens do (Gemma 3)."""
    spec = getattr(context.model_factory, "vision_language", None)
    return context.role == MODEL and spec is not None and spec.bidirectional_images


def lm_head(logits: fx.Node) -> fx.Node | None:
    """The ``linear`` producing the logits, through token-wise ops after it (soft-capping, casts, a bias of the
    model's own added: BART's ``final_logits_bias``)."""
    node = logits
    while node.op == "call_function":
        if node.target == torch.ops.autodeploy.linear.default:
            return node
        inputs = [a for a in node.args if isinstance(a, fx.Node) and a.op != "get_attr"]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def _expected_attention_layers(context: TransformContext) -> int | None:
    factory = context.model_factory
    config = getattr(factory, "hf_config", None)
    config = getattr(config, "text_config", None) or config
    if getattr(config, "is_encoder_decoder", False):  # the model graph is the decoder (BART's layers, T5's)
        return getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None)
    return getattr(config, "num_hidden_layers", None)


def _by_distance(graph: fx.Graph, attention: fx.Node, bias: fx.Node, length: int | None, made: dict[fx.Node, fx.Node]) -> fx.Node:
    """The ``relative_position_bias_by_distance`` standing for ``attention``'s ``bias`` (one per bias, in ``made``);
    an ``UnsupportedModelError`` for a bias that is not a relative position bias over the graph's own positions."""
    if bias in made:
        return made[bias]
    relative = torch.ops.autodeploy.relative_position_bias.default
    if bias.target != relative or not _same_arange(*bias.args[1:3]):
        raise UnsupportedModelError(
            f"{attention.name} adds a bias to its logits ({bias.name}) other than a relative position bias over the "
            f"sequence's own positions (T5's); the paged KV cache cannot hold a [B, H, Sq, Sk] bias")
    if length is None:
        raise ConfigError("max_seq_len must be set to serve a relative position bias: its table has one column a position")
    table, _, _, bidirectional, max_distance = bias.args
    with graph.inserting_after(bias):
        made[bias] = graph.call_function(torch.ops.autodeploy.relative_position_bias_by_distance.default,
                                         (table, length, bidirectional, max_distance))
    made[bias].meta = {**bias.meta, "val": table.meta["val"].new_empty((table.meta["val"].shape[1], length))}
    return made[bias]


def _same_arange(query_positions, key_positions) -> bool:
    """Both are ``arange(n)`` of one ``n`` (the graph's tokens, counted from 0)."""
    aranges = [p for p in (query_positions, key_positions) if isinstance(p, fx.Node) and p.target == torch.ops.aten.arange.default]
    return len(aranges) == 2 and len(aranges[0].args) == len(aranges[1].args) == 1 and aranges[0].args[0] == aranges[1].args[0]


def cross_attentions(graph: fx.Graph) -> dict[int, fx.Node]:
    """An encoder–decoder's decoder graph (``export/encoder_decoder.py``): layer → its cross-attention, the
    ``bidirectional_attention`` whose keys and values are that layer's slice of the ``cross_keys`` /
    ``cross_values`` inputs."""
    found = {}
    for node in graph.find_nodes(op="call_function", target=torch.ops.autodeploy.bidirectional_attention.default):
        k, v = node.args[1], node.args[2]
        slices = [(a.args[0], a.args[1:]) if a.op == "call_function" and a.target == torch.ops.aten.select.int else (None, None)
                  for a in (k, v)]
        (keys, where_k), (values, where_v) = slices
        if (getattr(keys, "target", None), getattr(values, "target", None)) == (CROSS_KEYS, CROSS_VALUES) and \
                where_k == where_v and where_k[0] == 0:
            found[where_k[1]] = node
    return found


def _cross_spec(node: fx.Node, layer: int) -> KVCacheSpec:
    key, value = node.args[1].meta["val"], node.args[2].meta["val"]  # [B, S, heads, head_dim]
    return KVCacheSpec.cross_for_layer(layer, key.shape[2], key.shape[3], value.shape[3], key.dtype)


def _insert_cross_caches(graph: fx.Graph, cross: dict[int, fx.Node], metadata: dict[str, fx.Node], last_input: fx.Node,
                         block_size: int) -> set[fx.Node]:
    """Each layer's cross-attention → ``cached_cross_attention`` over its cross cache pair (inputs after
    ``last_input``, with ``cross_lens`` and ``cross_block_tables``); returns the dense ``cross_keys`` /
    ``cross_values`` inputs, unused now. The caches keep the model's dtype (an fp8 cross cache would need scales
    of its own)."""
    n, meta = _EXAMPLE_SEQUENCES, dict(device="meta")
    examples = {"cross_lens": torch.empty(n, dtype=torch.int32, **meta),
                "cross_block_tables": torch.empty(n, _EXAMPLE_BLOCKS, dtype=torch.int32, **meta)}
    for name in CROSS_METADATA:
        with graph.inserting_after(last_input):
            metadata[name] = last_input = graph.placeholder(name)
        last_input.meta["val"] = examples[name]
    dense = {node.args[i].args[0] for node in cross.values() for i in (1, 2)}
    for layer, node in sorted(cross.items()):
        spec = _cross_spec(node, layer)
        caches = []
        for name, width in ((spec.key_input, spec.head_dim), (spec.value_input, spec.value_head_dim)):
            with graph.inserting_after(last_input):
                last_input = graph.placeholder(name)
            last_input.meta["val"] = torch.empty(_EXAMPLE_BLOCKS, block_size, spec.kv_heads, width, dtype=spec.dtype, **meta)
            caches.append(last_input)
        q, _, _, scale = node.args
        arguments = (q, *caches, metadata["seq_start"], metadata["cross_lens"], metadata["cross_block_tables"],
                     metadata["batch_info"], scale)
        with graph.inserting_before(node):
            cached = graph.call_function(torch.ops.autodeploy.cached_cross_attention.default, arguments)
        cached.meta = dict(node.meta)
        node.replace_all_uses_with(cached)
        graph.erase_node(node)
    return dense


def _module_classes(gm: GraphModule) -> dict[str, str]:
    """Module path → class name, for every module that produced a node of the graph."""
    classes = {}
    for node in gm.graph.nodes:
        for path, class_name in node.meta.get("nn_module_stack", {}).values():
            classes[path] = class_name.rsplit(".", 1)[-1] if isinstance(class_name, str) else class_name.__name__
    return classes


def _missing_attention_message(gm: GraphModule, found: int, expected: int | None) -> str:
    """Why the cache stage cannot serve this graph: which layers are not canonical attention, and what would help."""
    classes = _module_classes(gm)
    with_attention = {path for node in gm.graph.nodes if node.target == torch.ops.autodeploy.attention.default
                      for path, _ in node.meta.get("nn_module_stack", {}).values()}
    unmatched = Counter(name for path, name in classes.items() if name.endswith("Attention") and path not in with_attention)
    counted = f"the graph has {found} canonical attention ops for {expected if expected is not None else '?'} layers"
    if expected is not None and found > expected:
        return (f"{counted}: more than one attention per layer (differential or cross-attention), which the paged KV "
                f"cache does not support yet")
    if unmatched:
        layers = ", ".join(f"{name} ×{count}" for name, count in unmatched.items())
        return (f"{counted}: the attention of {layers} does not match a known attention form (causal softmax attention, "
                f"optionally windowed, soft-capped or with sinks). Register a pattern for it (autodeploy.register_pattern "
                f"or autodeploy.patterns.register_rewrite); `autodeploy inspect` shows what the match stage left")
    return (f"{counted}; the KV cache needs every attention layer as the canonical attention op. `autodeploy inspect` "
            f"shows what the match stage left as exported")


def _cache_scales(node: fx.Node, spec: KVCacheSpec, scales: dict[str, tuple[float, float]]) -> dict[str, float]:
    """An fp8 cache's ``k_scale`` / ``v_scale`` for the attention at ``node``: calibrated by ``load_weights``
    for its attention module (``TransformContext.kv_cache_scales``), 1 where there are none (random weights,
    no k_proj)."""
    if spec.dtype != torch.float8_e4m3fn:
        return {}
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0].removeprefix(GRAPH_PREFIX) if stack else ""
    k_scale, v_scale = scales.get(path, (1.0, 1.0))
    return {"k_scale": k_scale, "v_scale": v_scale} if (k_scale, v_scale) != (1.0, 1.0) else {}


def kv_cache_dtype(settings) -> torch.dtype | None:
    """The caches' dtype that ``quantize.kv_cache`` asks for (None: the model's): ``fp8`` stores float8_e4m3fn
    (each layer's values over its scales, saturated at ±448), half the bytes of bf16: twice the blocks in
    the same memory."""
    choice = settings.quantize.kv_cache
    if choice == "none":
        return None
    if choice != "fp8":
        raise ConfigError(f"quantize.kv_cache must be 'fp8' or 'none'; got {choice!r}")
    device = torch.device(settings.device)
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"quantize.kv_cache: fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); this one "
                          f"is {major}.{minor}. Keep the KV cache in the model's dtype (quantize.kv_cache: none)")
    return torch.float8_e4m3fn


@register_transform("insert_cached_attention", stage="cache")
class InsertCachedAttention(Transform):
    """Swap every ``attention`` for ``cached_attention`` and declare the paged-KV graph inputs."""

    def validate(self, context: TransformContext) -> None:
        kv_cache_dtype(context.settings)

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        gm, graph = module, module.graph
        attention = [n for n in graph.nodes if n.target == torch.ops.autodeploy.attention.default]
        cross = cross_attentions(graph)
        bidirectional = [n for n in graph.nodes if n.target == torch.ops.autodeploy.bidirectional_attention.default
                         and n not in cross.values()]
        if bidirectional:  # over the step's tokens alone, uncached: not what a decoder computes
            raise UnsupportedModelError(f"the model graph attends bidirectionally ({len(bidirectional)} attention layer(s) "
                                        f"without a causal mask): it is an encoder, and autodeploy serves decoders")
        expected = _expected_attention_layers(context)
        first_layer, total = gm.meta.get(LAYERS, (0, len(attention)))  # a pipeline stage holds some of the layers
        if not attention or (expected is not None and total != expected):
            raise UnsupportedModelError(_missing_attention_message(gm, total, expected))
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        values = _metadata_values(_arguments(attention[0])["q"].meta["val"])
        with graph.inserting_after(placeholders[-1]):
            metadata = {}
            trees = drafts_trees(context.settings)
            masks = (TREE_MASK,) * trees + (ATTEND_UNTIL,) * bidirectional_blocks(context)
            for name in reversed((*SEQUENCE_METADATA, *masks)):  # each new node goes first
                metadata[name] = graph.placeholder(name)
                metadata[name].meta["val"] = values[name]
        block_size = context.settings.kv_cache.block_size
        specs = []
        last_input = metadata[(*SEQUENCE_METADATA, *masks)[-1]]
        by_distance: dict[fx.Node, fx.Node] = {}  # a bias → its table by distance, shared by the layers adding it
        for layer, node in enumerate(attention):
            given = _arguments(node)
            bias = given.pop("bias", None)
            key, value = given["k"].meta["val"], given["v"].meta["val"]
            if trees and (given.get("sliding_window") is not None or given.get("alibi_slopes") is not None or bias is not None):
                raise ConfigError(f"speculative.tree_width > 1: {node.name} attends with a sliding window, ALiBi or a position "
                                  f"bias, whose distances a tree's layout would change; draft chains here (speculative.tree_width=1)")
            spec = KVCacheSpec.for_layer(first_layer + layer, key.shape[2], key.shape[3], value.shape[3], kv_cache_dtype(context.settings) or key.dtype)
            with graph.inserting_after(last_input):
                k_cache = graph.placeholder(spec.key_input)
            with graph.inserting_after(k_cache):
                v_cache = graph.placeholder(spec.value_input)
            k_cache.meta["val"] = torch.empty(_EXAMPLE_BLOCKS, block_size, spec.kv_heads, spec.head_dim, dtype=spec.dtype, device="meta")
            v_cache.meta["val"] = torch.empty(_EXAMPLE_BLOCKS, block_size, spec.kv_heads, spec.value_head_dim, dtype=spec.dtype, device="meta")
            last_input = v_cache
            # attention's arguments (q, k, v, scale and its options) go to cached_attention by name.
            call = CachedAttentionArgs(**given, k_cache=k_cache, v_cache=v_cache,
                                       **{name: metadata[name] for name in ATTENTION_METADATA})
            options = {**_cache_scales(node, spec, context.kv_cache_scales), **{name: metadata[name] for name in masks}}
            if bias is not None:
                options["distance_bias"] = _by_distance(graph, node, bias, context.settings.max_seq_len, by_distance)
            with graph.inserting_before(node):
                cached = graph.call_function(torch.ops.autodeploy.cached_attention.default, positional(call), options)
            cached.meta = dict(node.meta)
            node.replace_all_uses_with(cached)
            graph.erase_node(node)
            specs.append(spec)

        dense = set()  # an encoder–decoder's dense cross inputs, replaced by its cross caches
        if cross:
            context.cross_kv_caches = tuple(_cross_spec(node, layer) for layer, node in sorted(cross.items()))
            dense = _insert_cross_caches(graph, cross, metadata, last_input, block_size)
        self._gather_logits(graph, metadata["logit_index"])
        # Export's input guards bound one sequence's length (e.g. ≤ max_position_embeddings); a flattened
        # batch of many sequences is longer, and the scheduler checks each sequence's length instead.
        for guard in [n for n in graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
            graph.erase_node(guard)
        graph.eliminate_dead_code()  # the slices of the dense cross inputs, before the inputs themselves go
        for placeholder in dense:
            graph.erase_node(placeholder)
        # Export's pytree calling convention and its input-spec check (a forward pre-hook) fix the
        # argument count; the new inputs need a plain signature.
        graph._codegen = fx.graph.CodeGen()
        gm._forward_pre_hooks.clear()
        graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        context.graph_inputs = tuple(n.name for n in graph.nodes if n.op == "placeholder")
        context.kv_caches = tuple(specs)
        return TransformResult(matches=len(attention), changed=True, notes=f"{len(attention)} attention layers → paged KV cache")

    @staticmethod
    def _gather_logits(graph: fx.Graph, logit_index: fx.Node) -> None:
        output = next(n for n in graph.nodes if n.op == "output")
        logits = output.args[0]
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        if logits.target == torch.ops.autodeploy.pipeline_recv.default:
            # A pipeline stage before the last receives the logits: the rows it receives are the picked tokens'.
            like = logits.args[0]
            with graph.inserting_before(logits):
                picked = graph.call_function(torch.ops.aten.index_select.default, (like, 1, logit_index))
            picked.meta["val"] = torch.empty(1, _EXAMPLE_SEQUENCES, dtype=like.meta["val"].dtype, device="meta")
            logits.replace_input_with(like, picked)
            value = logits.meta["val"]
            logits.meta["val"] = torch.empty(1, _EXAMPLE_SEQUENCES, value.shape[-1], dtype=value.dtype, device="meta")
            output.args = (logits,)
            return
        head = lm_head(logits)
        target = head if head is not None else logits
        # Gather the LM head's input when there is one (the vocabulary projection then runs for N rows, not T).
        source = target.args[0] if head is not None else target
        with graph.inserting_before(target if head is not None else output):
            picked = graph.call_function(torch.ops.aten.index_select.default, (source, 1, logit_index))
        value = source.meta.get("val")
        if isinstance(value, torch.Tensor):  # [1, N, …] for the sampled rows (N: the example sequence count)
            picked.meta["val"] = torch.empty(1, _EXAMPLE_SEQUENCES, *value.shape[2:], dtype=value.dtype, device="meta")
        if head is not None:
            head.replace_input_with(source, picked)
            output.args = (logits,)
        else:
            output.args = (picked,)
