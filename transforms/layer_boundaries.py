"""Layer boundaries of a canonical graph, found from the graph (not from module names): the residual stream
entering a layer is the one tensor computed from weights that is still to be read between the previous
layer's attention and this one's. ``shard_pipeline_parallel`` cuts the graph there; ``expose_hidden_states``
copies it out for a drafter. The layers are the graph's canonical ``attention`` nodes, in order."""

from __future__ import annotations

from torch import fx
from torch.fx import GraphModule

from autodeploy.errors import ConfigError


def _weighted(module: GraphModule) -> set[fx.Node]:
    """The computed nodes that read a parameter, directly or through other nodes."""
    parameters = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    weighted: set[fx.Node] = set()
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        if any(i in weighted or (i.op == "get_attr" and i.target in parameters) for i in node.all_input_nodes):
            weighted.add(node)
    return weighted


def residual_streams(module: GraphModule, attentions: list[fx.Node], boundaries: list[int], who: str, fix: str) -> list[fx.Node]:
    """For each layer index in ``boundaries`` (1 … layers − 1), the one weighted tensor that crosses into that
    layer: the residual stream entering it. ``who`` and ``fix`` word the ``ConfigError`` when there is none."""
    nodes = list(module.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    weighted = _weighted(module)
    # live[p]: the weighted nodes computed at or before position p and read after it.
    opened: list[list[fx.Node]] = [[] for _ in nodes]
    closes: dict[fx.Node, int] = {}
    for node in weighted:
        last = max((position[user] for user in node.users), default=position[node])
        if last > position[node]:
            opened[position[node]].append(node)
            closes[node] = last
    cuts = []
    for layer in boundaries:
        start, stop = position[attentions[layer - 1]], position[attentions[layer]]
        live = {n for n, last in closes.items() if position[n] <= start < last}
        found = None
        for p in range(start, stop):
            if p > start:
                live = {n for n in live if closes[n] > p} | set(opened[p])
            if len(live) == 1:
                found = next(iter(live))
        if found is None:
            raise ConfigError(
                f"{who} found no single tensor passing from layer {layer - 1} to layer {layer} "
                f"(between {attentions[layer - 1].name} and {attentions[layer].name}); {fix}")
        cuts.append(found)
    return cuts
