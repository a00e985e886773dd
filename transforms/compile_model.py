"""``compile_model`` (stage ``compile``): decide how the runtime executes the graph — CUDA graphs, torch.compile.

With ``compile.backend: cuda_graph`` (the default) on a GPU, the runtime captures the whole decode step
(every layer, attention included) once per batch size of ``compile.batch_sizes`` and replays it; a decode
batch is padded up to the next captured size (``autodeploy/runtime/cuda_graphs.py``). This pass checks
that the graph can be captured at all and declares the sizes in the serving signature
(``TransformContext.decode_graph_batch_sizes``); it does not rewrite the graph. ``torch_compile`` runs the
graph under ``torch.compile`` (``autodeploy/runtime/compiled_graph.py``, any device) without CUDA graphs;
``torch_compile_cuda_graph`` captures the compiled graph's decode steps.

A graph can be captured when every kernel it calls runs without reading device tensors on the host
(``Backend.capturable``): the paged Triton attention and an encoder–decoder's ``dense`` cross-attention can, the
SDPA and reference attention cannot (they read ``kv_lens`` / ``cross_lens`` per sequence); ``select`` prefers the
capturable ones where decode steps replay graphs (``captures_decode_steps``). A graph that cannot stays eager, with a
warning and a report line naming the node, its kernel and the capturable kernels of its op: the deploy is slower,
never wrong. On the CPU there are no CUDA graphs.

    # configs: compile: {backend: cuda_graph, batch_sizes: [1, 2, 4, 8, 16, 32]}
    llm = autodeploy("llama-3-8b", weights="random", compile={"backend": "none"})   # always eager
    llm = autodeploy("llama-3-8b", weights="random", compile={"backend": "torch_compile_cuda_graph"})
"""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule

from autodeploy.custom_ops import candidates, op_by_target
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)


def default_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 up to 128, then every 32: padding a batch to the next size costs at most
    a third more rows, and a decode step's time is mostly reading the weights, whatever the rows."""
    sizes = [1, 2, 4, 8, *range(16, 129, 16), *range(160, max_batch_size + 1, 32)]
    return tuple(sorted({s for s in sizes if s < max_batch_size} | {max_batch_size}))


def default_prefill_token_sizes(max_tokens: int) -> tuple[int, ...]:
    """16, 32, 64, … up to ``max_tokens`` (and it): a step pads to at most twice its tokens, and at large
    counts a prefill is compute-bound, so the padding's cost is what the launches saved at small ones."""
    sizes = [16 << i for i in range(16) if 16 << i < max_tokens]
    return tuple(sizes + [max_tokens])


def captures_decode_steps(settings) -> bool:
    """Whether this deploy's decode steps are meant to replay CUDA graphs: ``compile.backend`` ``cuda_graph`` or
    ``torch_compile_cuda_graph``, on a GPU, one pipeline stage. ``select`` then prefers capturable kernels."""
    return (settings.compile.backend in ("cuda_graph", "torch_compile_cuda_graph")
            and torch.device(str(settings.device)).type == "cuda" and int(settings.distributed.pipeline_parallel) <= 1)


def uncapturable_nodes(module: GraphModule) -> list[str]:
    """``"node → kernel"`` for every node whose kernel syncs with the host (see ``Backend.capturable``)."""
    return [blocker for _, blocker in _uncapturable(module)]


def _uncapturable(module: GraphModule) -> list[tuple[str, str]]:
    """``(canonical op, "node → kernel")`` for every node whose kernel syncs with the host."""
    found = []
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        kernels = getattr(node.target, "backends", None)  # a select dispatch by token count
        if kernels is None:
            known = op_by_target(node.target)
            if known is None:
                continue
            record, name = known
            kernels = [b for b in candidates(record.name) if b.name == name]
        for kernel in kernels:
            if not kernel.capturable:
                op_name = op_by_target(kernel.op)[0].name
                found.append((op_name, f"{node.name} → {getattr(kernel.op, '__name__', kernel.name).removesuffix('.default')}"))
    return found


def _capturable_advice(ops: list[str]) -> str:
    """What to do about uncapturable kernels of ``ops``: name each op's capturable kernels (bar the opt-in ones) as a
    ``backends`` setting."""
    kernels = {op: [b.name for b in candidates(op) if b.capturable and not b.opt_in] for op in dict.fromkeys(ops)}
    lacking = [op for op, names in kernels.items() if not names]
    if lacking:
        return f"no capturable kernel serves {', '.join(lacking)}; set compile.backend: none to deploy without CUDA graphs"
    listed = ", ".join(f"{op}: [{', '.join(names)}]" for op, names in kernels.items())
    return f"choose capturable kernels (backends: {{{listed}}}) or set compile.backend: none"


@register_transform("compile_model", stage="compile")
class CompileModel(Transform):
    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        settings = context.settings
        backend = settings.compile.backend
        device = torch.device(str(settings.device))
        inductor = ["torch.compile (Inductor, our ops opaque): the graph compiles at the engine's first forward"] \
            if backend in ("torch_compile", "torch_compile_cuda_graph") else []
        if backend in ("none", "torch_compile"):
            return TransformResult(notes="torch.compile, decode without CUDA graphs" if inductor else "eager (compile.backend: none)",
                                   details=[*inductor, f"decode: no CUDA graphs (compile.backend: {backend})"])
        if device.type != "cuda":
            reason = f"decode: no CUDA graphs (they need a GPU; the deploy runs on {device.type})"
            return TransformResult(notes=("torch.compile; " if inductor else "") + f"no CUDA graphs on {device.type}",
                                   details=[*inductor, reason])
        if int(settings.distributed.pipeline_parallel) > 1:
            # A stage's graph receives and sends between the stages, and a step runs it once a micro-batch
            # (runtime/pipeline_schedule.py); capturing that is not built yet.
            message = "no CUDA graphs: pipeline_parallel > 1 (each micro-batch's graph call sends to and receives from other stages)"
            logger.info(message)
            return TransformResult(notes="no CUDA graphs: pipeline parallel", details=[*inductor, message])
        found = _uncapturable(module)
        if found:
            blockers = [blocker for _, blocker in found]
            shown = ", ".join(blockers[:3]) + (f" and {len(blockers) - 3} more" if len(blockers) > 3 else "")
            message = (f"decode stays eager: {shown} read device tensors on the host, which CUDA graph capture "
                       f"forbids; {_capturable_advice([op for op, _ in found])}")
            logger.warning(message)
            return TransformResult(notes="no CUDA graphs: kernels that sync with the host", details=[*inductor, message])
        max_batch_size = int(settings.max_batch_size)
        sizes = settings.compile.batch_sizes
        sizes = default_batch_sizes(max_batch_size) if sizes is None else tuple(sorted({min(int(s), max_batch_size) for s in sizes}))
        context.decode_graph_batch_sizes = sizes
        details = [*inductor, f"decode: CUDA graphs at batch sizes {', '.join(map(str, sizes))} (a batch pads up to the next)"]
        notes = ("torch.compile + " if inductor else "") + f"decode CUDA graphs at {len(sizes)} batch sizes"
        if not inductor:  # the compiled graph is not an fx graph to split
            max_tokens = min(int(settings.scheduler.max_num_tokens), int(settings.max_seq_len or settings.scheduler.max_num_tokens))
            tokens = settings.compile.prefill_token_sizes
            tokens = default_prefill_token_sizes(max_tokens) if tokens is None else tuple(sorted({min(int(t), max_tokens) for t in tokens}))
            context.prefill_graph_token_sizes = tokens
            if tokens:
                notes += f", prefill pieces at {len(tokens)} token counts"
                details.append(f"prefill and mixed steps: piecewise CUDA graphs (all but attention) at {', '.join(map(str, tokens))} "
                               f"tokens; more run eagerly")
        return TransformResult(matches=len(sizes), notes=notes, details=details)
