"""The tensor-parallel ops with one rank (no process group): ``all_reduce`` and ``all_gather`` copy, and
``embedding_rows`` over each half of a table sums to the whole table's lookup. Two ranks:
``tests/distributed/test_tensor_parallel.py``."""

import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

ops = torch.ops.autodeploy


def test_one_rank_reduces_and_gathers_to_a_copy():
    x = torch.randn(3, 5)
    for op in (ops.all_reduce, ops.all_gather):
        out = op(x)
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_embedding_rows_of_each_half_sum_to_the_whole_lookup():
    table, ids = torch.randn(10, 4), torch.tensor([[0, 4, 5, 9, 3]])
    halves = ops.embedding_rows(table[:5], ids, 0) + ops.embedding_rows(table[5:], ids, 5)
    assert torch.equal(halves, torch.nn.functional.embedding(ids, table))
    assert torch.equal(ops.embedding_rows(table[5:], ids, 5)[0, :2], torch.zeros(2, 4))  # ids 0, 4: another rank's
