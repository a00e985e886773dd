"""``expose_hidden_states`` (stage ``fuse``, before the fusions): the graph copies the residual stream entering the
layers a drafter reads (EAGLE-3: a low, a middle and a high one) into a buffer of its own, every step.

``speculative.method`` names a drafter registered with ``hidden_states`` (``runtime/speculative.py``); it
says which layers. For each, the residual stream entering that layer (found from the graph,
``layer_boundaries.residual_streams``: the one weighted tensor between the previous layer's attention and
this one's; for layer ``L`` of ``L``, the final norm's output, what the LM head reads: MTP's input) gets a ``save_hidden_states`` node writing its token rows into columns ``i·H … (i+1)·H`` of the
graph buffer ``speculative_hidden_states`` ``[max_num_tokens, layers·H]`` (not saved with the weights). The
buffer keeps one address, so every way the runtime runs a step (eager, CUDA graphs, piecewise graphs) leaves
the hidden states there; the engine hands the step's rows to the drafter (``Speculator.observe``). Nothing
else changes: the logits are the model's. A model with fewer layers than the drafter asks for, or a layer
with no single residual tensor, is a ``ConfigError``.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from autodeploy.errors import ConfigError
from autodeploy.runtime.speculative import HIDDEN_STATE_LAYERS, HIDDEN_STATES, hidden_state_layers
from autodeploy.transforms.insert_cached_attention import lm_head
from autodeploy.transforms.layer_boundaries import residual_streams
from autodeploy.transforms.quantize_linear import ATTENTION
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

@register_transform("expose_hidden_states", stage="fuse")
class ExposeHiddenStates(Transform):
    """Copy the residual stream entering the drafter's layers into the graph's ``speculative_hidden_states``."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        settings = context.settings
        graph = module.graph
        attentions = list(graph.find_nodes(op="call_function", target=ATTENTION))
        layers = hidden_state_layers(settings, len(attentions))
        if not layers:
            return TransformResult(notes="no drafter reads hidden states")
        method = settings.speculative.method
        outside = [layer for layer in layers if not 1 <= layer <= len(attentions)]
        if outside:
            raise ConfigError(f"speculative.method={method!r} reads the hidden states entering layer(s) {outside}, but the "
                              f"model has {len(attentions)} attention layers (1 … {len(attentions)} can be read, the last "
                              f"being the final norm's output); use a head trained for this model")
        entering = sorted({layer for layer in layers if layer < len(attentions)})
        found = dict(zip(entering, residual_streams(module, attentions, entering, f"speculative.method={method!r}",
                                                    "this model's layers cannot be read by a hidden-state drafter; use "
                                                    "method 'draft' or 'ngram'")))
        if len(attentions) in layers:
            found[len(attentions)] = _final_hidden(graph, method)
        streams = [found[layer] for layer in layers]
        values = [stream.meta.get("val") for stream in streams]
        if any(not isinstance(v, torch.Tensor) for v in values) or len({v.shape[-1] for v in values}) != 1:
            raise ConfigError(f"speculative.method={method!r}: the hidden states entering layers {layers} have no single "
                              f"known width ({[getattr(v, 'shape', None) for v in values]})")
        width = values[0].shape[-1]
        device = next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device(settings.device))
        buffer = torch.zeros(settings.scheduler.max_num_tokens, width * len(layers), dtype=values[0].dtype, device=device)
        module.register_buffer(HIDDEN_STATES, buffer, persistent=False)
        module.meta[HIDDEN_STATE_LAYERS] = (tuple(layers), len(attentions), width)
        for index, stream in enumerate(streams):
            with graph.inserting_after(stream):
                out = graph.get_attr(HIDDEN_STATES)
            with graph.inserting_after(out):
                graph.call_function(torch.ops.autodeploy.save_hidden_states.default, (stream, out, index * width))
        return TransformResult(matches=len(layers), changed=True,
                               notes=f"layers {layers} → {HIDDEN_STATES} {tuple(buffer.shape)} for {method!r}")


def _final_hidden(graph, method: str):
    """The final norm's output: what the LM head reads."""
    output = graph.output_node()
    logits = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    head = lm_head(logits)
    if head is None:
        raise ConfigError(f"speculative.method={method!r} reads the model's final hidden states, but its graph has no "
                          f"single linear LM head to find them by; use method 'draft' or 'ngram'")
    return head.args[0]
