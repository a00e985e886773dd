"""What the match stage turned into canonical ops, against what the model should have, and what it missed.

For norms, MLPs and MoE blocks: the *expected* count comes from the Hugging Face config (layers × per-layer
count, plus the final norm), the *found* count from the graph's canonical ops. *Unmatched* modules are
read from the graph too: ``torch.export`` records in each node's ``meta["nn_module_stack"]`` the modules
that produced it, so a norm, MLP or MoE module (recognised by Hugging Face's class-name suffixes:
``RMSNorm``/``LayerNorm``, ``MLP``, ``SparseMoeBlock``/``MoE``) whose nodes include no canonical op of
its kind was not matched. Replacement ops inherit the stack of the node they replace.

Expected counts know the architectures in ``_NORMS_PER_LAYER``; for any other the report assumes two
norms and one MLP per layer and says so. MoE configs (``num_local_experts``/``num_experts``) expect one
MoE block per sparse layer (Qwen-style ``decoder_sparse_step``/``mlp_only_layers`` honoured) and one MLP
per dense layer; shared experts are not counted.

```python
from autodeploy.transforms.match_report import match_report
print(match_report(gm, hf_config))   # norm 5/5, mlp 1/2 — unmatched: model.model.layers.1.mlp (LlamaMLP)
```
The ``match_report`` transform (stage ``match``, listed after the other match transforms) puts that
line in the pipeline report (``autodeploy inspect``) and logs a warning when something is unmatched.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule

from autodeploy.custom_ops import canonical_ops
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)

CANONICAL_OPS: dict[str, tuple[str, ...]] = {
    # bidirectional_attention in a model graph: an encoder–decoder's cross-attention (cached_cross_attention once cached)
    "attention": ("attention", "cached_attention", "cached_attention_rope", "bidirectional_attention", "cached_cross_attention"),
    "norm": ("rms_norm", "add_rms_norm", "layer_norm"),  # add_rms_norm: a norm fused with its residual add
    "mlp": ("gated_mlp", "fused_gated_mlp", "mlp"),  # fused_gated_mlp: a gated_mlp after fuse_gate_up
    "moe": ("moe",),
}


def _targets(op_names: tuple[str, ...]) -> set:
    """Node targets that count as these canonical ops: the ops and every backend kernel offered for them."""
    registry = canonical_ops()
    return {target for name in op_names for target in (registry[name].op, *(b.op for b in registry[name].backends))}
MODULE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "attention": ("Attention",),
    "norm": ("RMSNorm", "LayerNorm"),
    "mlp": ("MLP",),
    "moe": ("SparseMoeBlock", "MoE"),
}

# Norms per decoder layer, by HF model_type (one final norm comes on top).
_NORMS_PER_LAYER = {
    "llama": 2, "mistral": 2, "mixtral": 2, "qwen2": 2, "phi3": 2, "gemma": 2, "gpt_neox": 2,
    "qwen3": 4, "qwen3_moe": 4, "olmoe": 4,  # + q/k norms
    "stablelm": 2, "qwen2_moe": 2, "gpt_oss": 2,
    "gemma2": 4,  # + pre/post feed-forward norms
    "gemma3_text": 6,  # + pre/post feed-forward norms + per-head q/k norms
}
_SHOWN = 6  # unmatched modules named in the one-line report; MatchReport.unmatched_modules has all


@dataclass
class KindCount:
    kind: str
    expected: int | None  # None without a config
    found: int

    def __str__(self) -> str:
        return f"{self.kind} {self.found}" + (f"/{self.expected}" if self.expected is not None else "")


@dataclass
class MatchReport:
    counts: list[KindCount]
    unmatched_modules: list[str] = field(default_factory=list)  # "path (ClassName)"
    assumed: bool = False  # expected counts guessed for an architecture not in _NORMS_PER_LAYER

    @property
    def complete(self) -> bool:
        return not self.unmatched_modules and all(c.expected in (None, c.found) for c in self.counts)

    def __str__(self) -> str:
        line = ", ".join(str(c) for c in self.counts)
        if self.assumed:
            line += " (expected counts assume 2 norms + 1 MLP per layer)"
        if self.unmatched_modules:
            shown, more = self.unmatched_modules[:_SHOWN], len(self.unmatched_modules) - _SHOWN
            line += " — unmatched: " + ", ".join(shown) + (f", … {more} more" if more > 0 else "")
        return line


def expected_counts(hf_config: Any) -> tuple[dict[str, int], bool]:
    """Expected canonical ops per kind for a decoder-only model; and whether the architecture was unknown."""
    config = getattr(hf_config, "text_config", None) or hf_config
    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):  # the model graph is the decoder: self- and cross-attention a layer
        layers = getattr(config, "decoder_layers", None) or config.num_decoder_layers  # BART's count, T5's
        final = 2 if model_type == "mbart" else 1  # the embeddings' norm (T5: its final norm), and mBART's final one
        return {"attention": 2 * layers, "norm": 3 * layers + final, "mlp": layers}, False
    layers = config.num_hidden_layers
    norms_per_layer = _NORMS_PER_LAYER.get(model_type, 2)
    if getattr(config, "qk_layernorm", False):
        if model_type == "stablelm":  # one LayerNorm per query and per key head
            norms_per_layer += config.num_attention_heads + config.num_key_value_heads
        else:  # Persimmon and the like: one over the head dim for q and one for k
            norms_per_layer += 2
    counts = {"attention": layers, "norm": layers * norms_per_layer + 1}
    if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        shared = sparse if getattr(config, "shared_expert_intermediate_size", 0) else 0  # Qwen2-MoE's shared expert
        counts.update(mlp=layers - sparse + shared, moe=sparse)
    else:
        counts["mlp"] = layers
    return counts, model_type not in _NORMS_PER_LAYER


def _owning_module(node: torch.fx.Node, kind: str) -> str | None:
    """The innermost module of ``kind`` that produced ``node``, as "path (ClassName)"."""
    for path, class_name in reversed(list(node.meta.get("nn_module_stack", {}).values())):
        class_name = class_name.rsplit(".", 1)[-1] if isinstance(class_name, str) else class_name.__name__
        if class_name.endswith(MODULE_SUFFIXES[kind]):
            return f"{path} ({class_name})"
    return None


def _wraps(module: str, matched: set[str]) -> bool:
    """Whether ``module`` holds a matched module of its kind (T5's ``T5LayerSelfAttention`` around its ``T5Attention``:
    the residual add is the wrapper's own node)."""
    path = module.rsplit(" (", 1)[0]
    return any(inner.startswith(path + ".") for inner in matched)


def _layer_order(module: str) -> list:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", module)]


def match_report(gm: GraphModule, hf_config: Any | None = None) -> MatchReport:
    """Count canonical attentions/norms/MLPs/MoEs in ``gm`` (against ``hf_config`` when given) and list unmatched modules."""
    found = {kind: 0 for kind in CANONICAL_OPS}
    seen: dict[str, set[str]] = {kind: set() for kind in CANONICAL_OPS}
    matched: dict[str, set[str]] = {kind: set() for kind in CANONICAL_OPS}
    targets = {kind: _targets(names) for kind, names in CANONICAL_OPS.items()}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for kind in CANONICAL_OPS:
            module = _owning_module(node, kind)
            if module is not None:
                seen[kind].add(module)
            if node.target in targets[kind]:
                found[kind] += 1
                if module is not None:
                    matched[kind].add(module)
    expected, assumed = expected_counts(hf_config) if hf_config is not None else ({}, False)
    kinds = [kind for kind in CANONICAL_OPS if expected.get(kind) or found[kind]]
    counts = [KindCount(kind, expected.get(kind), found[kind]) for kind in kinds]
    unmatched = sorted((m for kind in CANONICAL_OPS for m in seen[kind] - matched[kind] if not _wraps(m, matched[kind])),
                       key=_layer_order)
    return MatchReport(counts, unmatched, assumed)


@register_transform("match_report", stage="match")
class MatchReportTransform(Transform):
    """Report expected vs found canonical ops and the unmatched modules; changes nothing."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        hf_config = getattr(context.model_factory, "hf_config", None)
        try:
            report = match_report(module, hf_config)
        except Exception as error:  # a report is advice: a config it does not understand must not stop the deploy
            logger.warning("match report unavailable: %s: %s", type(error).__name__, error)
            return TransformResult(notes=f"report unavailable ({type(error).__name__}: {error})")
        if not report.complete:
            logger.warning("match stage left model parts unmatched: %s", report)
        return TransformResult(notes=str(report))
