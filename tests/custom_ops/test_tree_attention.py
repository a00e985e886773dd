"""``cached_attention``'s ``tree_mask``: each node of a tree verification chunk attends exactly as the chain from the
sequence's newest token down to it would, and the SDPA backend agrees with the reference."""

from __future__ import annotations

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops.cached_attention import cached_attention_reference
from autodeploy.custom_ops.cached_attention_sdpa import cached_attention_sdpa
from autodeploy.runtime.draft_trees import tree_masks, tree_path

BLOCK, HQ, HKV, D = 4, 4, 2, 8
PARENTS = [-1, -1, 0, 0, 2, 1]  # two candidates after the newest token; the first has two children, one of them a child


def _step(prefix: int, chunks: list[int], masks: list[int], q, k, v, caches):
    """A step over sequences with ``prefix`` cached tokens each and ``chunks[s]`` new tokens, on blocks 0, 1, …"""
    seq_start, kv_lens, tables, slots, block = [0], [], [], [], 0
    for length in chunks:
        total = prefix + length
        table = list(range(block, block + -(-total // BLOCK)))
        block += len(table)
        tables.append(table + [0] * (8 - len(table)))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(prefix, total)]
        seq_start.append(seq_start[-1] + length)
        kv_lens.append(total)
    metadata = (torch.tensor(seq_start, dtype=torch.int32), torch.tensor(kv_lens, dtype=torch.int32),
                torch.tensor(tables, dtype=torch.int32), torch.tensor(slots),
                torch.tensor([len(chunks), 0, max(chunks), max(kv_lens)], dtype=torch.int32))
    return q, k, v, *caches, *metadata, D**-0.5


def _prefilled_caches(prefix: int, sequences: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    caches = (torch.zeros(16, BLOCK, HKV, D, dtype=torch.float64), torch.zeros(16, BLOCK, HKV, D, dtype=torch.float64))
    keys, values = (torch.randn(1, prefix * sequences, HKV, D, generator=generator, dtype=torch.float64) for _ in range(2))
    q = torch.randn(1, prefix * sequences, HQ, D, generator=generator, dtype=torch.float64)
    cached_attention_reference(*_step(0, [prefix] * sequences, [], q, keys, values, caches))
    return caches


@pytest.mark.parametrize("backend", [cached_attention_reference, cached_attention_sdpa])
def test_each_tree_node_attends_as_its_own_chain_would(backend):
    generator = torch.Generator().manual_seed(0)
    prefix, nodes = 6, len(PARENTS) + 1
    caches = _prefilled_caches(prefix, 2, generator)
    q, k, v = (torch.randn(1, 2 * nodes, h, D, generator=generator, dtype=torch.float64) for h in (HQ, HKV, HKV))
    masks = tree_masks(PARENTS) + [-1] * nodes  # the second sequence: a plain causal chunk
    tree_caches = tuple(c.clone() for c in caches)
    out = backend(*_step(prefix, [nodes, nodes], masks, q, k, v, tree_caches), tree_mask=torch.tensor(masks))
    plain = cached_attention_reference(*_step(prefix, [nodes, nodes], masks, q, k, v, tuple(c.clone() for c in caches)))
    torch.testing.assert_close(out[:, nodes:], plain[:, nodes:])  # -1 rows: causal, as without a mask
    for node in range(-1, len(PARENTS)):  # the newest token (-1), then each node: its chain alone
        rows = [0] + [n + 1 for n in tree_path(PARENTS, node)]
        chain = cached_attention_reference(*_step(prefix, [len(rows)], [], q[:, rows], k[:, rows], v[:, rows],
                                                  tuple(c.clone() for c in caches)))
        torch.testing.assert_close(out[0, rows[-1]], chain[0, -1])


def test_a_chunk_whose_rows_are_all_causal_needs_no_mask():
    from autodeploy.custom_ops.cached_attention import tree_visibility

    assert tree_visibility(torch.tensor([-1, -1, -1]), 0, 3, 10) is None
    visible = tree_visibility(torch.tensor(tree_masks([-1, -1])), 0, 3, 5)
    assert visible.tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                                [True, True, True, False, True]]
