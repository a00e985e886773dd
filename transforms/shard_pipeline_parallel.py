"""``shard_pipeline_parallel`` (stage ``shard``): each pipeline stage keeps whole consecutive layers of the
canonical graph, found from the graph, not from module names.

With ``distributed.pipeline_parallel = P`` the ``L`` canonical ``attention`` nodes, in order, are the
layers; stage ``s`` (``parallel_state.layout().stage``) keeps layers ``s·L/P … (s+1)·L/P − 1``, stage 0
also what comes before the first layer (the embedding), the last stage also what comes after the last
(the final norm and the LM head). The cut before layer ``b`` is the latest point of the graph's order
before attention ``b`` where exactly one tensor computed from weights is still to be read (the residual
stream): that tensor goes to the next stage. Nodes computed from the inputs alone (positions → rotary
tables, masks, sizes) are cheap and stay on every stage that reads them.

On this rank's graph:

- stage ``s > 0`` receives the residual stream (``pipeline_recv`` from ``pipeline_peer(s − 1)``, shaped
  like the token ids plus the hidden width) in place of the layers before it;
- stage ``s < P − 1`` sends its last layer's output to ``pipeline_peer(s + 1)`` (``pipeline_send``) and
  receives the logits from the last stage (a deferrable ``pipeline_recv``: the runtime's GPipe schedule
  collects them at the end of the step);
- the last stage sends its logits to every other stage's rank of its place, so every rank samples the
  same tokens from the same logits.

Everything of the other stages is dropped, parameters included (``load_weights`` skips the checkpoint
tensors no graph parameter takes), so a rank holds about ``1/P`` of the weights (the embedding on the first
stage, the LM head on the last: both when tied) and the cache stage declares KV caches for its own
attention layers only (``LAYERS``). Runs after ``shard_tensor_parallel``: its collectives stay inside the
stage. Refused with a ``ConfigError``: ``P`` more than the layers or not dividing them, no single tensor
between two layers, quantization (calibration would run one stage's part of the model alone) and
``torch.compile`` backends. ``compile_model`` captures no CUDA graphs under pipeline parallelism.
"""

from __future__ import annotations


import torch
from torch import fx
from torch.fx import GraphModule

from autodeploy.custom_ops import parallel_state
from autodeploy.errors import ConfigError
from autodeploy.transforms.insert_cached_attention import LAYERS
from autodeploy.transforms.layer_boundaries import residual_streams
from autodeploy.transforms.quantize_linear import ATTENTION, quantizes_dense_layers
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform
from autodeploy.transforms.shape_propagation import infer_values

ops = torch.ops.autodeploy


def _drop_unused_parameters(module: GraphModule) -> None:
    used = {node.target for node in module.graph.nodes if node.op == "get_attr"}
    module.delete_all_unused_submodules()
    for name, _ in list(module.named_parameters(remove_duplicate=False)):
        if name not in used:
            owner, _, leaf = name.rpartition(".")
            (module.get_submodule(owner) if owner else module)._parameters.pop(leaf, None)


def _value(node: fx.Node) -> torch.Tensor:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"pipeline parallelism needs the shape of {node.name}, which carries none; deploy with pipeline_parallel=1")
    return value


@register_transform("shard_pipeline_parallel", stage="shard")
class ShardPipelineParallel(Transform):
    """Keep this rank's pipeline stage of the layers; send and receive the activations between stages."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        settings = context.settings
        stages = int(settings.distributed.pipeline_parallel)
        if stages == 1:
            return TransformResult(notes="pipeline_parallel=1: nothing to cut")
        if quantizes_dense_layers(settings):
            raise ConfigError("pipeline_parallel > 1 with quantization is not available yet (calibration would run one "
                              "stage's layers alone); set quantize.default=none or pipeline_parallel=1")
        if settings.compile.backend in ("torch_compile", "torch_compile_cuda_graph"):
            # Inductor could copy a stage's logits out of their buffer before an asynchronous receive fills it.
            raise ConfigError(f"compile.backend={settings.compile.backend} with pipeline_parallel > 1 is not available yet; "
                              f"set compile.backend to cuda_graph (on GPUs: eager under pipeline parallelism) or none")
        graph = module.graph
        attentions = list(graph.find_nodes(op="call_function", target=ATTENTION))
        layers = len(attentions)
        if layers < stages or layers % stages:
            raise ConfigError(f"pipeline_parallel={stages} must divide the layers ({layers} attention layers in the graph) "
                              f"and be at most their number; choose a divisor of {layers}")
        per_stage = layers // stages
        layout = parallel_state.layout()
        stage = layout.stage
        cuts = residual_streams(module, attentions, [s * per_stage for s in range(1, stages)], "pipeline parallelism",
                                "deploy with pipeline_parallel=1")
        ids = next(n for n in graph.find_nodes(op="placeholder") if n.target == "input_ids")
        output = graph.output_node()
        logits = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
        logits_value = _value(logits)
        new: list[fx.Node] = []
        if stage < stages - 1:
            sent = cuts[stage]
            with graph.inserting_after(sent):
                new.append(graph.call_function(ops.pipeline_send.default, (sent, layout.pipeline_peer(stage + 1))))
            with graph.inserting_before(output):
                received = graph.call_function(ops.pipeline_recv.default, (
                    ids, logits_value.shape[-1], logits_value.dtype, layout.pipeline_peer(stages - 1), True))
            output.args = ((received,),) if isinstance(output.args[0], (tuple, list)) else (received,)
            new.append(received)
        else:
            for other in range(stages - 1):
                with graph.inserting_before(output):
                    new.append(graph.call_function(ops.pipeline_send.default, (logits, layout.pipeline_peer(other))))
        if stage > 0:
            before = cuts[stage - 1]
            value = _value(before)
            if [str(d) for d in value.shape[:-1]] != [str(d) for d in _value(ids).shape]:  # symbolic dims: compared by name
                raise ConfigError(f"pipeline parallelism passes {before.name} {tuple(value.shape)} between layers, not "
                                  f"one row a token ({tuple(_value(ids).shape)}); deploy with pipeline_parallel=1")
            with graph.inserting_after(before):
                hidden = graph.call_function(ops.pipeline_recv.default, (
                    ids, value.shape[-1], value.dtype, layout.pipeline_peer(stage - 1), False))
            before.replace_all_uses_with(hidden, delete_user_cb=lambda user: user is not hidden)
            new.insert(0, hidden)
        graph.eliminate_dead_code()
        _drop_unused_parameters(module)
        infer_values(module, new)
        first = stage * per_stage
        module.meta[LAYERS] = (first, layers)
        kept = list(graph.find_nodes(op="call_function", target=ATTENTION))
        parts = [f"stage {stage} of {stages}: layers {first}…{first + per_stage - 1} of {layers} ({len(kept)} attentions)"]
        if stage > 0:
            parts.append(f"receives {cuts[stage - 1].name} from rank {layout.pipeline_peer(stage - 1)}")
        if stage < stages - 1:
            parts.append(f"sends {cuts[stage].name} to rank {layout.pipeline_peer(stage + 1)}, receives the logits from "
                         f"rank {layout.pipeline_peer(stages - 1)}")
        else:
            parts.append(f"sends the logits to ranks {[layout.pipeline_peer(s) for s in range(stages - 1)]}")
        return TransformResult(matches=per_stage, changed=True, notes="; ".join(parts))
