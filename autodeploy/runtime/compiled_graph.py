"""The executable graph under ``torch.compile`` (``compile.backend: torch_compile`` or
``torch_compile_cuda_graph``), falling back to the eager graph when compiling fails.

Inductor compiles the whole graph once (dynamic token and batch dims; sizes of 1 get their own
specialisation) and fuses what lies between our canonical ops — residual adds, casts, views — while the
ops themselves stay opaque calls to the backend kernels ``select`` chose (their fake implementations
give Inductor the shapes). The KV-cache writes stay in place: Inductor re-inplaces the mutating
attention op over the cache inputs, no copy of a cache is made. Compiling happens at the first call
(the engine's warm-up forward, inside the build) and is cached by Inductor on disk for the next build.
A compile that raises — an op without a usable fake, a graph break under ``fullgraph`` — is logged as a
warning and every later call runs the eager graph: slower, never wrong.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

logger = logging.getLogger(__name__)

TORCH_COMPILE_BACKENDS = ("torch_compile", "torch_compile_cuda_graph")  # the compile.backend values it serves


class CompiledGraph:
    """Calls ``torch.compile(graph)``; after a failure to compile, ``graph`` itself."""

    def __init__(self, graph: fx.GraphModule):
        self.eager = graph
        self._compiled = torch.compile(graph, dynamic=True, fullgraph=True)
        self.failure: Exception | None = None

    def __call__(self, *inputs):
        if self.failure is None:
            try:
                return self._compiled(*inputs)
            except torch._dynamo.exc.TorchDynamoException as error:  # compile errors, not the kernels' own
                self.failure = error
                logger.warning("torch.compile failed (%s: %s); the graph runs eagerly",
                               type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return self.eager(*inputs)
