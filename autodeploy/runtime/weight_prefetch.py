"""Captured decode steps that bring each projection's weight into L2 while the kernels before it run.

In a decode step the projections stream their weights at the memory's full rate, and the kernels between
them (RoPE and the K/V write, attention over a few hundred keys, the norms, the gated activation) barely
use it. :func:`with_weight_prefetches` returns a copy of the step's graph (sharing its weights) in which,
right after each node that streams a weight, a call starts fetching the first ``max_bytes`` of the *next*
such node's weight into L2 (``custom_ops/triton/l2_prefetch.py``) on a side stream. The fetch then runs
beside the light kernels, and the next projection finds that part of its weight in L2. A call before the
output joins the side stream back, so the step stays one capturable unit. Only the decode CUDA graphs
run this copy (``runtime/cuda_graphs.py``); prefill steps, compute-bound, run the graph as it is.

A node streams a weight when it reads a parameter of at least ``_STREAMED_BYTES`` (the projections, fused
or quantized, and the LM head, whose weight is the next layer's first to prefetch...); embeddings read
a few rows of their table and are not counted. Values are unchanged: a prefetch is a hint.

    graph, count = with_weight_prefetches(graph, max_bytes=32 << 20)   # compile.l2_prefetch_bytes
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import fx

logger = logging.getLogger(__name__)

_STREAMED_BYTES = 1 << 20  # a parameter at least this large, read whole by its node
_MAX_ROWS = 64  # past this many rows a projection is no longer bound by its weight's read


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))


def prefetch_after(after, weight: torch.Tensor, max_bytes: int) -> None:
    """Once ``after`` (a projection's output) is written, start fetching ``weight``'s first ``max_bytes``
    into L2 on the side stream; nothing when the step has more than ``_MAX_ROWS`` rows or runs off a GPU."""
    from autodeploy.custom_ops.triton.l2_prefetch import prefetch_l2

    if isinstance(after, (tuple, list)):
        after = after[0]
    if weight.device.type != "cuda" or after.numel() > _MAX_ROWS * after.shape[-1]:
        return
    stream = _side_stream(weight.device.index or 0)
    stream.wait_stream(torch.cuda.current_stream(weight.device))
    with torch.cuda.stream(stream):
        prefetch_l2(weight, max_bytes)


def join_prefetches(result, device_index: int):
    """Make the current stream wait for the side stream's prefetches (a capture must join every stream it
    forked); returns ``result`` unchanged."""
    if torch.cuda.is_available() and device_index >= 0:
        torch.cuda.current_stream(device_index).wait_stream(_side_stream(device_index))
    return result


def _streamed_weight(node: fx.Node, parameters: dict[str, torch.Tensor]) -> torch.Tensor | None:
    if node.op != "call_function" or "embedding" in getattr(node.target, "__name__", str(node.target)):
        return None
    weights = [parameters[a.target] for a in node.all_input_nodes if a.op == "get_attr" and a.target in parameters]
    weights = [w for w in weights if isinstance(w, torch.Tensor) and w.numel() * w.element_size() >= _STREAMED_BYTES]
    return max(weights, key=lambda w: w.numel() * w.element_size()) if weights else None


def with_weight_prefetches(graph: fx.GraphModule, max_bytes: int) -> tuple[fx.GraphModule, int]:
    """A copy of ``graph`` over the same weights with the prefetches described in the module docstring,
    and how many it makes (``graph`` itself when none)."""
    parameters = {name: tensor for name, tensor in [*graph.named_parameters(), *graph.named_buffers()]}
    copied = fx.Graph()
    output = copied.graph_copy(graph.graph, {})
    copied.output(output)
    streaming = [(node, weight) for node in copied.nodes if (weight := _streamed_weight(node, parameters)) is not None]
    if len(streaming) < 2:
        return graph, 0
    for (before, _), (after, weight) in zip(streaming, streaming[1:]):
        target = next(a.target for a in after.all_input_nodes if a.op == "get_attr" and parameters.get(a.target) is weight)
        with copied.inserting_before(before.next):  # its own get_attr: the next node's may come later
            copied.call_function(prefetch_after, (before, copied.get_attr(target), int(max_bytes)))
    device = streaming[0][1].device
    output_node = next(n for n in copied.nodes if n.op == "output")
    with copied.inserting_before(output_node):
        joined = copied.call_function(join_prefetches, (output_node.args[0], device.index or 0))
    output_node.args = (joined,)
    return fx.GraphModule(graph, copied), len(streaming) - 1
