"""Piecewise CUDA graphs of prefill and mixed steps: everything but attention, per token-count bucket.

A step that prefills (or mixes prompt chunks with decodes) has a token count and a sequence layout that
change every step; attention depends on that layout, everything else — embedding, GEMMs, norms, RoPE,
activations — depends only on the token count, one row per token. So the graph is split
(``torch.fx.passes.split_module``) into pieces: the nodes that read the step's sequence metadata or the KV
caches (attention) run eagerly, and so does the tail from the ``logit_index`` gather on (its row count is
the number of sequences, not tokens); every piece between them is captured once per token bucket of
``TransformContext.prefill_graph_token_sizes`` and replayed. A step of ``T`` tokens runs the smallest bucket
``Tb ≥ T``: its ``input_ids`` / ``position_ids`` are copied into the bucket's static buffers (rows
``T … Tb-1`` keep whatever they held: every captured op treats rows independently, and the tail reads only
the rows ``logit_index`` names), each eager piece gets its token-row inputs narrowed to ``T`` rows, and its
token-row outputs are copied into the next piece's static buffers. 32 layers are then 33 graph launches
and 32 attention calls instead of ~800 kernel launches from Python.

Token rows are found by contract: the serving signature's ``input_ids[1, T]`` and ``position_ids[1, T]``,
and tensors crossing between pieces whose dim 1 is the export's token dimension. A graph whose captured
pieces read any other input, or pass anything else that depends on the token count, is not split
(``NotSplittable`` says why) and its prefill steps run eagerly.

All pieces are captured before the KV pool is sized (they need no cache: attention is eager), largest
bucket first, into one memory pool; their outputs stay allocated, and the pool's size is reported. On the
CPU nothing is captured: the same static buffers and narrowing run eagerly, so the tests check the logic a
GPU replays.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from autodeploy.custom_ops.graph_capture import GraphCapture

logger = logging.getLogger(__name__)

TOKEN_INPUTS = ("input_ids", "position_ids")  # the serving signature's [1, T] inputs
LOGIT_INDEX = "logit_index"


class NotSplittable(Exception):
    """The graph cannot run as captured pieces (the message says why); its prefill steps run eagerly."""


@dataclass
class _Piece:
    """One submodule of the split graph and how each of its arguments is fed."""

    module: fx.GraphModule
    captured: bool
    token_rows: list[bool]  # per argument: dim 1 is the token count (narrowed when eager, padded when captured)
    attributes: list[bool]  # per argument: a parameter or buffer of the model (a fixed address)
    token_counts: list[bool]  # per argument: the token count itself (an int: T when eager, the bucket when captured)

    @functools.cached_property
    def structure(self) -> tuple:
        """What the piece calls, in order, with which constants: equal for the pieces of two layers alike."""
        def constant(argument):
            return argument if argument is None or isinstance(argument, (int, float, str, bool)) else type(argument).__name__

        # A placeholder is named after what feeds it (another layer's weight), so only its place counts.
        return tuple((n.op, None if n.op == "placeholder" else _target_name(n.target), tuple(map(constant, n.args)))
                     for n in self.module.graph.nodes)


class PiecewiseGraphs:
    """The split graph of ``graph`` and its captured pieces per token bucket; see the module docstring.
    Raises ``NotSplittable`` for a graph it cannot split."""

    def __init__(self, graph: fx.GraphModule, input_names: Sequence[str], token_sizes: Sequence[int], device: torch.device):
        self.input_names = list(input_names)
        self.sizes = sorted(set(token_sizes))
        self.device = device
        self.capture = device.type == "cuda"
        self.split, self.pieces = split_into_pieces(graph)
        # The split graph's get_attr values (the weights), looked up once rather than at every step.
        self._attributes = {node: functools.reduce(getattr, node.target.split("."), self.split)
                            for node in self.split.graph.nodes if node.op == "get_attr"}
        self._buffers: dict[int, dict[int, list[torch.Tensor | None]]] = {}  # bucket → piece → static argument buffers
        self._graphs: dict[int, dict[int, tuple[torch.cuda.CUDAGraph, object]]] = {}  # bucket → piece → (graph, outputs)
        self.pool_bytes = 0
        self._warmed: set[tuple] = set()  # (bucket, piece structure, argument layouts) run eagerly before a capture

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def serves(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def capture_all(self, probe_inputs: Callable[[int], list[torch.Tensor]]) -> None:
        """Make every bucket's static buffers and (on a GPU) capture its pieces, largest bucket first into
        one memory pool. ``probe_inputs(tokens)`` gives the graph's inputs for a step of that many tokens
        on a scratch cache: the eager pieces run on them, so the captured ones see real shapes."""
        capture = GraphCapture(self.device) if self.capture else None
        for size in reversed(self.sizes):
            self._buffers[size], self._graphs[size] = {}, {}
            self._run(probe_inputs(size), size, size, setting_up=True, capture=capture)
        if capture is not None:
            self.pool_bytes = capture.pool_bytes()
            logger.info("prefill CUDA graphs: %d pieces at %d token counts up to %d, %.2f GiB; %s",
                        sum(p.captured for p in self.pieces), len(self.sizes), self.max_tokens, self.pool_bytes / 2**30,
                        capture.times)

    def run(self, inputs: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
        """The logits of a step of ``num_tokens`` tokens (``serves(num_tokens)`` must hold)."""
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        return self._run(inputs, num_tokens, size)[0]

    def _run(self, inputs: list[torch.Tensor], num_tokens: int, size: int, setting_up: bool = False,
             capture: GraphCapture | None = None):
        values: dict[fx.Node, object] = {}
        named = dict(zip(self.input_names, inputs))
        pieces = iter(enumerate(self.pieces))
        for node in self.split.graph.nodes:
            if node.op == "placeholder":
                values[node] = named[node.target]
            elif node.op == "get_attr":
                values[node] = self._attributes[node]
            elif node.op == "call_module":
                index, piece = next(pieces)
                args = [values[a] for a in node.args]
                if piece.captured:
                    args = [size if count else a for a, count in zip(args, piece.token_counts)]
                    values[node] = self._call_captured(index, piece, args, size, setting_up, capture)
                else:
                    args = [num_tokens if count else a.narrow(1, 0, num_tokens) if rows else a
                            for a, rows, count in zip(args, piece.token_rows, piece.token_counts)]
                    values[node] = piece.module(*args)
            elif node.op == "call_function":  # the getitems of a piece's outputs
                values[node] = node.target(*[values[a] if isinstance(a, fx.Node) else a for a in node.args])
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], lambda n: values[n])
        raise RuntimeError("the split graph has no output node")

    def _call_captured(self, index: int, piece: _Piece, args: list, size: int, setting_up: bool,
                       capture: GraphCapture | None):
        graphs = self._graphs[size]
        if setting_up:  # first time at this bucket: buffers for what does not keep its address
            self._buffers[size][index] = [
                None if attribute or _captured_output(argument, graphs) else _static_buffer(argument, rows, size)
                for argument, rows, attribute in zip(args, piece.token_rows, piece.attributes)
            ]
        call_args = []
        for argument, buffer, rows in zip(args, self._buffers[size][index], piece.token_rows):
            if buffer is None:
                call_args.append(argument)
                continue
            if argument is not buffer:
                (buffer.narrow(1, 0, argument.shape[1]) if rows else buffer).copy_(argument)
            call_args.append(buffer)
        if capture is not None:
            # Once eagerly first, unless a piece alike (another layer's) already ran on arguments of these
            # shapes at this bucket.
            warmed = (size, piece.structure, tuple(_layout(a) for a in call_args))
            warm_up = warmed not in self._warmed
            self._warmed.add(warmed)
            graphs[index] = capture.capture(piece.module, call_args, warm_up=warm_up)
            return graphs[index][1]
        if index in graphs:
            graph, outputs = graphs[index]
            graph.replay()
            return outputs
        return piece.module(*call_args)


def _target_name(target) -> str:
    # A token dispatch is made per node, so its str() holds its address; its name says which backend
    # serves each bucket, which is what makes two calls alike.
    return target.__name__ if hasattr(target, "by_token_bucket") else str(target)


def _layout(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.data_ptr() % 16)
    return (type(value).__name__, value if isinstance(value, (int, float, bool)) else None)


def split_into_pieces(graph: fx.GraphModule) -> tuple[fx.GraphModule, list[_Piece]]:
    """``graph`` split at its eager nodes (see ``eager_nodes``), and its pieces in call order."""
    token = _token_expression(graph)
    if token is None:
        raise NotSplittable("the graph's input_ids carries no recorded shape, so its token rows cannot be told apart")
    eager = eager_nodes(graph)
    partition_of: dict[fx.Node, int] = {}
    partition, previous = 0, None
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if previous is not None and (node in eager) != previous:
            partition += 1
        previous = node in eager
        partition_of[node] = partition
    eager_partitions = {partition_of[node] for node in eager}
    split = split_module(graph, graph, partition_of.__getitem__, keep_original_order=True)
    graph_inputs = {n.target for n in graph.graph.nodes if n.op == "placeholder"}
    pieces = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        module = getattr(split, node.target)
        captured = int(node.target.removeprefix("submod_")) not in eager_partitions
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        token_rows = [_is_token_rows(p.meta.get("val"), token) for p in placeholders]
        if captured:
            for argument, placeholder, rows in zip(node.args, placeholders, token_rows):
                value = placeholder.meta.get("val")
                if argument.op == "placeholder" and argument.target not in TOKEN_INPUTS and argument.target in graph_inputs:
                    raise NotSplittable(f"{node.target} would capture a node reading the step input {argument.target}")
                if not rows and _depends_on_tokens(value, token):
                    raise NotSplittable(f"{node.target} takes {placeholder.name} of shape {tuple(value.shape)}: it depends "
                                        f"on the token count other than as dim 1")
        token_counts = [_expression(p.meta.get("val")) == token for p in placeholders]
        pieces.append(_Piece(module, captured, token_rows, [a.op == "get_attr" for a in node.args], token_counts))
    return split, pieces


def eager_nodes(graph: fx.GraphModule) -> set[fx.Node]:
    """The nodes that run outside the captured pieces: those reading a graph input other than the token
    rows (attention reads the sequence metadata and the caches), and every node downstream of the
    ``logit_index`` gather (its rows are the sequences, not the tokens)."""
    eager: set[fx.Node] = set()
    tail: set[fx.Node] = set()
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if any(i.op == "placeholder" and i.target == LOGIT_INDEX for i in inputs) or any(i in tail for i in inputs):
            tail.add(node)
        if node in tail or any(i.op == "placeholder" and i.target not in TOKEN_INPUTS for i in inputs):
            eager.add(node)
    return eager


def _token_expression(graph: fx.GraphModule):
    """The export's symbol for the token count: dim 1 of ``input_ids``' recorded value (None if unrecorded)."""
    for node in graph.graph.nodes:
        if node.op == "placeholder" and node.target == "input_ids":
            value = node.meta.get("val")
            return None if value is None else _expression(value.shape[1])
    return None


def _expression(dim):
    return dim.node.expr if isinstance(dim, torch.SymInt) else dim


def _is_token_rows(value, token) -> bool:
    """A tensor whose dim 1 is the token count."""
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) >= 2 and _expression(shape[1]) == token


def _depends_on_tokens(value, token) -> bool:
    shape = getattr(value, "shape", None)
    return shape is not None and any(token in getattr(_expression(dim), "free_symbols", ()) for dim in shape)


def _static_buffer(value, token_rows: bool, size: int) -> torch.Tensor | None:
    """A buffer that will keep its address, for an argument that does not: token rows padded to ``size``."""
    if not isinstance(value, torch.Tensor):
        return None
    shape = list(value.shape)
    if token_rows:
        shape[1] = size
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def _captured_output(value, graphs: dict) -> bool:
    """Whether ``value`` is (an element of) the output of a piece captured at this bucket: a fixed address."""
    for _, outputs in graphs.values():
        elements = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        if any(value is element for element in elements):
            return True
    return False
