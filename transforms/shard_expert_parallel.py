"""``shard_expert_parallel`` (stage ``shard``, after ``shard_tensor_parallel``): each MoE layer's experts over the
ranks of a pipeline stage, found as the canonical ``moe`` op, whatever the model calls its experts.

- ``distributed.expert_parallel = N``: rank ``r`` keeps ``E/N`` whole experts (dim 0 of both stacked weights)
  and each ``moe`` becomes ``moe_expert_parallel`` (``custom_ops/moe_expert_parallel.py``): a rank routes its
  share of the tokens, sends each to its experts' ranks with all-to-all, runs its own experts on what it
  receives, sends the results back and all-gathers the tokens, so every rank returns the whole ``[T, H]``.
  With ``tensor_parallel = N`` too, the dense layers are ``shard_tensor_parallel``'s; the experts are placed here.
- ``tensor_parallel = N`` alone: every rank keeps every expert's ``1/N`` of the intermediate size: gate rows
  ``r·I/N … (r+1)·I/N`` and the same up rows (``gate_up_weight[E, 2I, H]`` holds gate rows, then up rows: two
  ranges, recorded as one list of rows) and the same columns of ``down_weight``; routing needs no change and
  an ``all_reduce`` sums the ranks' partial outputs. A shared expert is a ``gated_mlp``: the TP pass slices it.

``distributed.expert_placement``: ``contiguous`` (rank r: experts ``r·E/N …``) or ``balanced``: the float model
(this graph, its tensor-parallel slices included, with the checkpoint's weights) runs over the calibration
text (``quantize.calibration``), each ``moe`` counts the experts its router picks, and each layer's experts are
dealt to the ranks, most loaded first, to the rank with the least load that still has room (``E/N`` each);
the contiguous placement is kept where that is no better. Load imbalance is the largest rank's routed pairs
over the mean rank's; the notes give it before (contiguous) and after, the details each expert's count.

Each rank's slices go to ``load_weights`` through ``SHARDS`` (``(dim, start, stop)``, or ``(dim, rows)`` for a
list of rows: a balanced placement, an expert's gate and up halves). ``quantize.experts`` (``int8_wo``,
``int4_wo``) runs after this stage: it rewrites ``moe_expert_parallel`` into its quantized variant over the
rank's experts, and ``load_weights`` quantizes the experts it slices from the checkpoint; every expert has its
own scales, so a rank holds exactly its experts' part of one process's quantized tensors. Refused with a
``ConfigError``: ``expert_parallel`` on a model without MoE layers, experts (or, for TP, the intermediate size)
that ``N`` does not divide, and ``quantize.experts`` under tensor parallelism alone (a down projection's scales
span the whole intermediate size, which a rank holds only a slice of).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.fx import GraphModule

from autodeploy.custom_ops import parallel_state
from autodeploy.custom_ops.moe import route
from autodeploy.errors import ConfigError
from autodeploy.transforms.quantize_linear import module_path, quantizes_dense_layers
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform
from autodeploy.transforms.shard_tensor_parallel import SHARDS

logger = logging.getLogger(__name__)
ops = torch.ops.autodeploy


def rank_loads(order: list[int], counts: list[int], ranks: int) -> list[int]:
    """The routed pairs each rank serves when rank r holds experts ``order[r·E/N : (r+1)·E/N]``."""
    per_rank = len(order) // ranks
    return [sum(counts[e] for e in order[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]


def imbalance(order: list[int], counts: list[int], ranks: int) -> float:
    """Largest rank load over the mean rank load (1.0: even; 1.0 too when nothing was routed)."""
    loads = rank_loads(order, counts, ranks)
    mean = sum(loads) / ranks
    return max(loads) / mean if mean else 1.0


def balanced_placement(counts: list[int], ranks: int) -> list[int]:
    """An expert order (rank r holds ``order[r·E/N : (r+1)·E/N]``, each rank's sorted) with ``E/N`` experts a
    rank: the most routed expert first, each to the least loaded rank with room (ties: the lower rank). The
    contiguous order when that greedy one is no better. Deterministic.

    >>> balanced_placement([9, 8, 1, 0], 2)   # contiguous: loads 17 and 1
    [0, 3, 1, 2]
    """
    experts = len(counts)
    per_rank = experts // ranks
    members: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for expert in sorted(range(experts), key=lambda e: (-counts[e], e)):
        rank = min((r for r in range(ranks) if len(members[r]) < per_rank), key=lambda r: (loads[r], r))
        members[rank].append(expert)
        loads[rank] += counts[expert]
    greedy = [expert for member in members for expert in sorted(member)]
    contiguous = list(range(experts))
    return greedy if imbalance(greedy, counts, ranks) < imbalance(contiguous, counts, ranks) else contiguous


class _Slicer:
    """New (meta) parameters of this rank's shape, and the slices ``load_weights`` fills them from."""

    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.shards: dict = gm.meta.setdefault(SHARDS, {})

    def keep(self, weight: fx.Node, dim: int, rows: list[int]) -> None:
        """Keep indices ``rows`` of ``dim`` of the parameter behind ``weight``: ``(dim, start, stop)`` when they
        are one range, else ``(dim, rows)``."""
        target = weight.target
        if target in self.shards or len(weight.users) != 1:
            raise ConfigError(f"expert weights {module_path(target)} are read by another node too; deploy this model "
                              f"with expert_parallel=1 and tensor_parallel=1")
        param = self.gm.get_parameter(target)
        shape = list(param.shape)
        shape[dim] = len(rows)
        owner, _, leaf = target.rpartition(".")
        module = self.gm.get_submodule(owner) if owner else self.gm
        module._parameters[leaf] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device), requires_grad=False)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self.shards[target] = (dim, rows[0], rows[0] + len(rows)) if contiguous else (dim, tuple(rows))


def _moe_nodes(gm: GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if node.op == "call_function" and node.target is ops.moe.default]


def _routing(node: fx.Node) -> tuple[int, str, bool]:
    """A ``moe`` node's ``(top_k, scoring, renormalize)``, its op's defaults where the node leaves them out."""
    names = ("x", "router_logits", "gate_up_weight", "down_weight", "top_k", "scoring", "renormalize")
    given = {**dict(zip(names, node.args)), **node.kwargs}
    return given["top_k"], given.get("scoring", "softmax"), given.get("renormalize", True)


def _moe_shapes(gm: GraphModule, node: fx.Node) -> tuple[int, int]:
    """(experts, intermediate size) of a ``moe`` node's stacked weights."""
    experts, double_inner, _ = gm.get_parameter(node.args[2].target).shape
    return experts, double_inner // 2


@register_transform("shard_expert_parallel", stage="shard", shapes="all")
class ShardExpertParallel(Transform):
    """Place MoE experts over the stage's ranks (expert parallel), or slice them by intermediate size (TP alone)."""

    def validate(self, context: TransformContext) -> None:
        settings = context.settings
        if settings.distributed.expert_placement != "balanced":
            return
        if int(settings.distributed.expert_parallel) == 1:
            raise ConfigError("distributed.expert_placement=balanced places experts over expert_parallel ranks; with "
                              "expert_parallel=1 it would do nothing: set expert_parallel, or expert_placement=contiguous")
        if settings.weights == "random":
            raise ConfigError("distributed.expert_placement=balanced measures routing on the checkpoint's weights; with "
                              "weights=random use expert_placement=contiguous")

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        distributed = context.settings.distributed
        tensor, experts_parallel = int(distributed.tensor_parallel), int(distributed.expert_parallel)
        moes = _moe_nodes(module)
        if tensor == 1 and experts_parallel == 1:
            return TransformResult(notes="expert_parallel=1, tensor_parallel=1: nothing to place")
        if not moes:
            if experts_parallel > 1:
                raise ConfigError(f"expert_parallel={experts_parallel} but this model has no MoE layers (no moe op after "
                                  f"the match stage): it would do nothing; use tensor_parallel for a dense model")
            return TransformResult(notes="no MoE layers")
        if experts_parallel > 1 and quantizes_dense_layers(context.settings):
            raise ConfigError("expert_parallel > 1 with quantized dense layers is not available yet (their calibration "
                              "would run the expert-parallel graph); quantize only the experts (quantize.experts, "
                              "quantize.default=none) or set expert_parallel=1")
        if context.settings.quantize.experts != "none" and experts_parallel == 1:
            raise ConfigError(f"quantize.experts={context.settings.quantize.experts} with expert_parallel=1 and "
                              f"tensor_parallel={tensor} is not available: tensor parallelism slices every expert's "
                              f"intermediate size, and a down projection's scales (a row's, or a group's) would be "
                              f"computed over a rank's slice, not as one process computes them; set expert_parallel="
                              f"{tensor} (whole experts a rank, quantized exactly as one process quantizes them), or "
                              f"quantize.experts=none")
        if any(not (isinstance(w, fx.Node) and w.op == "get_attr") for node in moes for w in node.args[2:4]):
            raise ConfigError("a MoE layer's expert weights are computed, not read from a parameter; they cannot be "
                              "placed over ranks: deploy this model with expert_parallel=1 and tensor_parallel=1")
        rank = parallel_state.layout().stage_rank
        if experts_parallel == 1:
            return self._slice_intermediate(module, moes, rank, tensor)
        return self._place_experts(module, context, moes, rank, experts_parallel)

    @staticmethod
    def _slice_intermediate(module: GraphModule, moes: list[fx.Node], rank: int, parts: int) -> TransformResult:
        slicer, graph = _Slicer(module), module.graph
        for node in moes:
            _, inner = _moe_shapes(module, node)
            if inner % parts:
                raise ConfigError(f"tensor_parallel={parts} does not divide the experts' intermediate size ({inner}) of "
                                  f"{module_path(node.args[2].target)}; choose a tensor_parallel that divides it")
            share = range(rank * inner // parts, (rank + 1) * inner // parts)
            slicer.keep(node.args[2], 1, [*share, *(inner + i for i in share)])  # its gate rows, then its up rows
            slicer.keep(node.args[3], 2, list(share))
            with graph.inserting_after(node):
                total = graph.call_function(ops.all_reduce.default, (node,))
            total.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            node.replace_all_uses_with(total, delete_user_cb=lambda user: user is not total)
        return TransformResult(matches=len(moes), changed=True,
                               notes=f"rank {rank} of {parts}: {len(moes)} MoE layers' experts sliced by intermediate size "
                                     f"({inner // parts} of {inner} a rank), all-reduced")

    @staticmethod
    def _place_experts(module: GraphModule, context: TransformContext, moes: list[fx.Node], rank: int,
                       parts: int) -> TransformResult:
        layers = {node: module_path(node.args[2].target) for node in moes}
        for node in moes:
            experts, _ = _moe_shapes(module, node)
            if experts % parts:
                raise ConfigError(f"expert_parallel={parts} must divide the experts ({experts}) of {layers[node]}; "
                                  f"choose an expert_parallel that divides {experts}")
        placement = str(context.settings.distributed.expert_placement)
        details: list[str] = []
        orders = {node: list(range(_moe_shapes(module, node)[0])) for node in moes}
        balance = ""
        if placement == "balanced":
            counts, tokens = _routing_counts(module, context, moes)
            before, after = [], []
            for node in moes:
                orders[node] = balanced_placement(counts[node], parts)
                before.append(imbalance(list(range(len(counts[node]))), counts[node], parts))
                after.append(imbalance(orders[node], counts[node], parts))
                per_rank = len(orders[node]) // parts
                details.append(f"{layers[node]}: pairs routed to each expert {counts[node]}; load imbalance contiguous "
                               f"{before[-1]:.3f} → balanced {after[-1]:.3f}; experts by rank "
                               f"{[orders[node][r * per_rank:(r + 1) * per_rank] for r in range(parts)]}")
            worst = max(range(len(moes)), key=lambda i: before[i])
            balance = (f" on {tokens} calibration tokens' routing: load imbalance (max / mean rank "
                       f"load) contiguous {sum(before) / len(before):.3f} → balanced {sum(after) / len(after):.3f} "
                       f"(mean over layers; worst layer {before[worst]:.3f} → {after[worst]:.3f})")
            for line in details:
                logger.info("expert placement: %s", line)
        slicer, graph = _Slicer(module), module.graph
        for node in moes:
            order = orders[node]
            per_rank = len(order) // parts
            for weight in node.args[2:4]:
                slicer.keep(weight, 0, order[rank * per_rank:(rank + 1) * per_rank])
            x, router_logits, gate_up, down, top_k, *options = node.args
            with graph.inserting_before(node):
                placed = graph.call_function(ops.moe_expert_parallel.default,
                                             (x, router_logits, gate_up, down, order, top_k, *options), dict(node.kwargs))
            placed.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            node.replace_all_uses_with(placed)
            graph.erase_node(node)
        experts = len(orders[moes[0]])
        notes = (f"rank {rank} of {parts}: {len(moes)} MoE layers, {experts // parts} of {experts} experts a rank, tokens "
                 f"dispatched with all-to-all; placement {placement}{balance}")
        logger.info("shard_expert_parallel: %s", notes)
        return TransformResult(matches=len(moes), changed=True, notes=notes, details=details)


def _routing_counts(module: GraphModule, context: TransformContext, moes: list[fx.Node]) -> tuple[dict[fx.Node, list[int]], int]:
    """Per ``moe`` node, the (token, expert) pairs its router sends to each expert over the calibration text,
    and the tokens run: the graph as it stands (this rank's tensor-parallel slices, whole experts) with the
    checkpoint's weights, on every rank when tensor-parallel collectives are in it, else on the stage's first
    rank; that rank's counts are broadcast, so every rank places alike."""
    from autodeploy.transforms.calibration import calibration_windows
    from autodeploy.transforms.load_weights import float_graph

    settings, factory = context.settings, context.model_factory
    layout = parallel_state.layout()
    counts: list[list[int]] | None = None
    tokens = 0
    if int(settings.distributed.tensor_parallel) > 1 or layout.stage_rank == 0:
        calibration = settings.quantize.calibration
        windows = calibration_windows(factory.load_tokenizer(settings.tokenizer), str(calibration.dataset),
                                      int(calibration.samples), int(calibration.seq_len))
        vocabulary = getattr(factory.hf_config.get_text_config(), "vocab_size", None)
        if vocabulary:  # a reduced verification twin's vocabulary is smaller than the tokenizer's (models/twin.py)
            windows = [[token % vocabulary for token in window] for window in windows]
        tokens = sum(len(w) for w in windows)
        graph = fx.Graph()
        graph.output(graph.graph_copy(module.graph, {}))
        snapshot = GraphModule(module, graph)
        snapshot.meta[SHARDS] = dict(module.meta.get(SHARDS, {}))
        device = torch.device(settings.device) if torch.device(settings.device).type == "cuda" else torch.device("cpu")
        logger.info("expert placement: routing %d calibration tokens through %d MoE layers (%s)", tokens, len(moes), device)
        snapshot = float_graph(snapshot, factory, device)
        index = {copied: i for i, copied in enumerate(_moe_nodes(snapshot))}  # graph_copy keeps the node order
        counts = [[0] * _moe_shapes(snapshot, node)[0] for node in index]

        class Router(fx.Interpreter):
            def run_node(self, node):
                if node in index:
                    router_logits = self.env[node.args[1]]
                    _, chosen = route(router_logits.reshape(-1, router_logits.shape[-1]), *_routing(node))
                    tally = torch.bincount(chosen.flatten(), minlength=len(counts[index[node]])).tolist()
                    counts[index[node]] = [a + b for a, b in zip(counts[index[node]], tally)]
                return super().run_node(node)

        router = Router(snapshot)
        with torch.no_grad():
            for window in windows:
                router.run(torch.tensor([window], device=device), torch.arange(len(window), device=device)[None])
        del snapshot, router
    if layout.stage_size > 1:
        shared = [counts, tokens]
        dist.broadcast_object_list(shared, src=layout.stage_ranks(layout.stage)[0], group=parallel_state.stage_group())
        counts, tokens = shared
    return dict(zip(moes, counts)), tokens
