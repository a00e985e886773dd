"""``fuse_fp8_quantization`` (stage ``fuse``): an fp8 linear's per-token rounding moves into the kernel that makes its input.

``fp8_linear`` (dynamic activation scales) rounds each row of its input to e4m3 before its product: a
kernel of its own that reads the activations and writes them again. Where the input comes from a
kernel that already holds each row whole, that kernel can round as it writes (``custom_ops/fp8_activations.py``):

- ``add_rms_norm``'s norm (before q/k/v and gate/up in a pre-norm decoder) → ``add_rms_norm_fp8``;
- ``gated_activation`` (between a quantized gated MLP's projections, before down) → ``gated_activation_fp8``;

and each fp8 linear reading it becomes ``fp8_prequantized_linear(x_q, x_scale, ...)``. Several fp8 linears
over one norm (q, k and v left apart) share one rounding. The rewrite is exact: the fused ops compute the
unfused ops' bits. A producer is left as it is (and named in the report) when anything but fp8 linears
reads its output: that reader needs the unrounded values. ``o_proj`` reads attention's output, which no
kernel here rounds; static scales (``fp8_static_linear``) keep their own rounding. A float32 deploy on a
GPU is left as it is: ``fp8_linear``'s GEMV keeps its float32 sums there, and no fast kernel of
``fp8_prequantized_linear`` writes float32 (the e4m3 tensor-core MMA and ``torch._scaled_mm`` on CUDA
accumulate or write with fewer bits).

    # YAML: transforms: {fuse_fp8_quantization: {enabled: false}} keeps each fp8 linear's own rounding
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx import GraphModule

from autodeploy.custom_ops.fp8_activations import add_rms_norm_fp8_fake, gated_activation_fp8_fake
from autodeploy.patterns.graph_walk import NoMatch, call_arguments, is_call, node_value, require
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

ops = torch.ops.autodeploy
FP8_LINEAR = ops.fp8_linear.default
ADD_RMS_NORM = ops.add_rms_norm.default
GATED_ACTIVATION = ops.gated_activation.default
FUSED = {ADD_RMS_NORM: ops.add_rms_norm_fp8.default, GATED_ACTIVATION: ops.gated_activation_fp8.default}


def _producer(x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(the op node, the node of its output that x is)`` when ``x`` is an ``add_rms_norm``'s norm or a
    ``gated_activation``'s output; else None."""
    if is_call(x, {GATED_ACTIVATION}):
        return x, x
    if is_call(x, {operator.getitem}) and x.args[1] == 0 and is_call(x.args[0], {ADD_RMS_NORM}):
        return x.args[0], x
    return None


def _fp8_readers(output: fx.Node) -> list[fx.Node]:
    """The fp8 linears reading ``output`` as their input, when nothing else reads it; else ``NoMatch``."""
    for reader in output.users:
        require(is_call(reader, {FP8_LINEAR}) and call_arguments(reader, {FP8_LINEAR}, "fp8_linear")["x"] is output,
                f"{reader.name} reads {output.name} and is not an fp8_linear over it")
    return list(output.users)


def _outputs(op: fx.Node) -> dict[int, fx.Node]:
    """An ``add_rms_norm``'s output nodes by index (``getitem``s), when only those read it."""
    outputs = {}
    for user in op.users:
        require(is_call(user, {operator.getitem}), f"{user.name} reads {op.name} whole")
        outputs[user.args[1]] = user
    return outputs


def _fake(op: fx.Node):
    """The fused op's outputs as fake tensors, for the new nodes' ``meta['val']``."""
    arguments = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in op.args]
    fake = add_rms_norm_fp8_fake if op.target == ADD_RMS_NORM else gated_activation_fp8_fake
    with detect_fake_mode([node_value(op.args[0])]) or contextlib.nullcontext():
        return fake(*arguments, **op.kwargs)


def _fuse(graph: fx.Graph, op: fx.Node, output: fx.Node, readers: list[fx.Node]) -> None:
    dtype = node_value(output).dtype
    old_outputs = _outputs(op) if op.target == ADD_RMS_NORM else {}
    with graph.inserting_before(op):
        fused = graph.call_function(FUSED[op.target], op.args, dict(op.kwargs))
        new_outputs = [graph.call_function(operator.getitem, (fused, i)) for i in range(2)]
        if 1 in old_outputs:  # the residual sum: add_rms_norm's second output, the fused op's third
            new_outputs.append(graph.call_function(operator.getitem, (fused, 2)))
    # Module stacks (what reports and verification read) stay the replaced nodes'.
    fused.meta.update({key: value for key, value in op.meta.items() if key != "val"})
    fused.meta["val"] = _fake(op)
    for index, node in enumerate(new_outputs):
        node.meta.update({key: value for key, value in (old_outputs.get(1) if index == 2 else output).meta.items()
                          if key != "val"})
        node.meta["val"] = fused.meta["val"][index]
    x_q, x_scale = new_outputs[:2]
    for reader in readers:
        arguments = call_arguments(reader, {FP8_LINEAR}, "fp8_linear")
        with graph.inserting_before(reader):
            linear = graph.call_function(ops.fp8_prequantized_linear.default, (
                x_q, x_scale, arguments["qweight"], arguments["scale"], arguments["bias"], dtype))
        linear.meta.update(reader.meta)
        reader.replace_all_uses_with(linear)
        graph.erase_node(reader)
    if 1 in old_outputs:
        old_outputs[1].replace_all_uses_with(new_outputs[2])
    for node in [*old_outputs.values(), op]:  # now unread
        graph.erase_node(node)


@register_transform("fuse_fp8_quantization", stage="fuse")
class FuseFp8Quantization(Transform):
    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        graph = module.graph
        settings = getattr(context, "settings", None)
        on_gpu = settings is not None and torch.device(str(settings.device)).type == "cuda"
        producers = {}
        for linear in graph.find_nodes(op="call_function", target=FP8_LINEAR):
            if on_gpu and node_value(linear).dtype == torch.float32:
                continue  # fp8_linear's float32 GEMV serves it (see the module docstring)
            found = _producer(call_arguments(linear, {FP8_LINEAR}, "fp8_linear")["x"])
            if found is not None:
                producers.setdefault(found[0], found[1])
        fused, kept_apart = 0, []
        for op, output in producers.items():
            try:
                readers = _fp8_readers(output)
                if op.target == ADD_RMS_NORM:
                    _outputs(op)
            except NoMatch as reason:
                kept_apart.append(f"{op.name} keeps its fp8 readers' own rounding: {reason}")
                continue
            _fuse(graph, op, output, readers)
            fused += 1
        notes = (f"{fused} norms / gated activations now write e4m3 rows for their fp8 linears" if fused
                 else "no fp8 linear's rounding moved into the op before it")
        if kept_apart:
            notes += f" ({len(kept_apart)} kept apart, see details)"
        return TransformResult(matches=fused, changed=bool(fused), notes=notes, details=kept_apart)
