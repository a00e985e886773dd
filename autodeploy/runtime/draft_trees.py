"""Tree drafts (``runtime/speculative.py``): several candidates at a position, verified in one forward.

A ``DraftTree`` lists its nodes in order, each after its parent. The verification chunk is the sequence's newest
token (row 0) then node ``i`` at row ``i + 1``: in the KV slots after the newest token, at the position of its
depth (``tree_depths``), seeing the cached tokens, its ancestors and itself (``tree_masks``: ``cached_attention``'s
``tree_mask`` bits). The rows' samples decide which path is kept (``accepted_path``).

    >>> tree = DraftTree(tokens=[5, 7, 6, 8], parents=[-1, -1, 0, 0])  # 5 or 7; after 5, 6 or 8
    >>> tree_depths(tree.parents), tree_masks(tree.parents)
    ([1, 1, 2, 2], [1, 3, 5, 11, 19])
    >>> accepted_path(tree.tokens, tree.parents, sampled=[5, 8, 0, 0, 0])  # the model: 5, then 8
    [0, 3]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftTree:
    """Drafted tokens as a tree: ``tokens[i]`` follows ``tokens[parents[i]]`` (-1: the sequence's newest token), each
    node after its parent (``parents[i] < i``). Siblings are alternatives for one position, likeliest first."""

    tokens: list[int]
    parents: list[int]

    def main_chain(self) -> list[int]:
        """The tokens of the path that takes each node's first child: the chain the tree extends."""
        chain, current = [], -1
        for node, parent in enumerate(self.parents):
            if parent == current:
                chain.append(self.tokens[node])
                current = node
        return chain

    def check(self, method: str) -> None:
        """A ``RuntimeError`` naming the drafter when the parents do not make a tree in order."""
        if len(self.parents) != len(self.tokens) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise RuntimeError(f"the {method!r} drafter returned a DraftTree whose parents {self.parents} are not a tree in "
                               f"order over its {len(self.tokens)} tokens (each parent -1 or an earlier node)")


def tree_depths(parents: list[int]) -> list[int]:
    """Each node's depth (1: a child of the newest token)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_masks(parents: list[int]) -> list[int]:
    """``cached_attention``'s ``tree_mask`` rows of a verification chunk: the newest token (row 0) sees itself; node
    ``i`` (row ``i + 1``) its ancestors, the newest token and itself."""
    masks = [1]
    for i, parent in enumerate(parents):
        masks.append(masks[parent + 1] | (1 << (i + 1)))
    return masks


def tree_path(parents: list[int], node: int) -> list[int]:
    """The nodes from the newest token's child down to ``node`` (-1: none)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def accepted_path(tokens: list[int], parents: list[int], sampled: list[int]) -> list[int]:
    """The nodes the model's own samples confirm, from the root down: at each step the child whose token the model
    sampled after the path so far (``sampled``: one token per row, row 0 the newest token's, row ``i + 1`` node
    ``i``'s), until none matches."""
    path, row = [], 0
    while True:
        wanted = sampled[row]
        parent = row - 1
        child = next((i for i in range(parent + 1, len(tokens)) if parents[i] == parent and tokens[i] == wanted), None)
        if child is None:
            return path
        path.append(child)
        row = child + 1
