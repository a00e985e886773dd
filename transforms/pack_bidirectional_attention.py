"""``pack_bidirectional_attention`` (stage ``cache``): an encoder-only model's attention keeps packed texts apart.

The ``"embed"`` graph (``export/encoder_only.py``) takes many texts in one row ``[1, T]``, no padding, and where
each starts (``seq_start``, ``[N + 1]``). Everything in an encoder but attention works token by token; attention,
matched to the canonical ``bidirectional_attention``, would let every token see every other text. This pass hands
``seq_start`` to each of them, so each query sees the keys of its own text only (the op's packed form: one SDPA a
text in the reference, one varlen flash call on a GPU).

A decoder embedding model's graph (Qwen3-Embedding: a causal LM's last hidden state) has the causal canonical
``attention`` instead, in its un-cached form; it takes ``seq_start`` the same way (each text causal within itself; flash
attention's varlen kernel on a GPU, ``custom_ops/attention_varlen.py``).

Every attention of the encoder must have been matched (ModernBERT's local layers are, as ``bidirectional_attention``
with a ``window``): one left as aten ops (a mask the match stage could not read, eager attention without SDPA) would mix
the texts, so that is an ``UnsupportedModelError``
naming the layers. The graph's ``meta[PACKED_TEXTS]`` records that the pass ran; the runtime serves no other.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.fx import GraphModule

from autodeploy.deployment import EMBED, PACKED_TEXTS
from autodeploy.errors import UnsupportedModelError
from autodeploy.export.encoder_only import SEQ_START
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

# An encoder's attention, and a decoder embedding model's causal one (the un-cached form: this graph has no cache)
_PACKABLE = {torch.ops.autodeploy.bidirectional_attention.default: 4, torch.ops.autodeploy.attention.default: 8}  # → bias's place
_UNPACKABLE = ("aten._softmax", "aten.softmax", "aten.scaled_dot_product_attention", "aten._scaled_dot_product")


@register_transform("pack_bidirectional_attention", stage="cache", roles=(EMBED,))
class PackBidirectionalAttention(Transform):
    """``bidirectional_attention(q, k, v, scale)`` → ``bidirectional_attention(q, k, v, scale, seq_start=seq_start)``; a
    decoder embedding model's causal ``attention`` likewise."""

    def apply(self, gm: GraphModule, context: TransformContext) -> TransformResult:
        graph = gm.graph
        seq_start = next((n for n in graph.nodes if n.op == "placeholder" and n.target == SEQ_START), None)
        if seq_start is None:
            raise UnsupportedModelError(f"pack_bidirectional_attention: the embed graph has no {SEQ_START!r} input")
        attentions = [n for n in graph.nodes if n.target in _PACKABLE]
        leftover = Counter(str(n.target).split(".default")[0] for n in graph.nodes if n.op == "call_function"
                           and str(n.target).startswith(_UNPACKABLE))
        if leftover or not attentions:
            layers = Counter(_attention_class(n) for n in graph.nodes if n.op == "call_function" and str(n.target).startswith(_UNPACKABLE))
            raise UnsupportedModelError(
                f"the model's attention is not all canonical bidirectional_attention or attention ({len(attentions)} matched; left as "
                f"aten ops: {dict(leftover) or 'none, and no attention at all'}"
                f"{' in ' + ', '.join(f'{name} ×{count}' for name, count in layers.items()) if layers else ''}): packed texts "
                f"would attend to one another. autodeploy packs encoders whose attention is unmasked softmax attention "
                f"(BERT, RoBERTa, XLM-R) and decoders whose attention is causal; register a pattern for this one "
                f"(autodeploy.register_pattern)")
        for node in attentions:
            place = _PACKABLE[node.target]
            bias = node.args[place] if len(node.args) > place else node.kwargs.get("bias")
            if bias is not None:
                raise UnsupportedModelError("an attention with an additive bias (relative positions) cannot be packed yet: "
                                            "its bias spans the whole row, not each text")
            node.kwargs = {**node.kwargs, "seq_start": seq_start}  # its other options (a window) stay as matched
        gm.meta[PACKED_TEXTS] = True
        return TransformResult(changed=True, matches=len(attentions),
                               notes=f"{len(attentions)} attentions read {SEQ_START}")


def _attention_class(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "?"
    name = next(reversed(stack.values()))[1]
    return name.rsplit(".", 1)[-1] if isinstance(name, str) else name.__name__
