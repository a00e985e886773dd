"""The batch-invariant kernels (``custom_ops/triton/batch_invariant.py``): the references' results, and a row's bits
the same whatever else the call computes. Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py``),
so the shapes are tiny; on a GPU the same tests run compiled, in bfloat16, where the fast kernels do differ."""

from __future__ import annotations

import pytest
import torch

from autodeploy.custom_ops.cached_attention import cached_attention_reference
from autodeploy.custom_ops.triton.batch_invariant import invariant_attention, invariant_linear
from tests.custom_ops.test_paged_attention_triton import interpreter_loops_with_numpy_2_4  # noqa: F401  (autouse)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.fixture(autouse=True, scope="module")
def interpreter_dots_row_by_row():
    """A GPU's matrix instructions sum an output element's products in one order wherever its row sits in the
    tile; the interpreter's ``tl.dot`` is one numpy matmul, whose BLAS may not (OpenBLAS's AVX-512 kernels on an
    AMD EPYC give a row other bits at another offset in the tile). So that the interpreted kernels are held to
    the property the kernels rely on (and not to a CPU BLAS's blocking), the interpreter multiplies a row at a
    time while these tests run."""
    if torch.cuda.is_available():
        yield
        return
    import numpy as np
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_by_rows(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:  # fp8 and batched dots as Triton does them
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [np.matmul(a.data[i:i + 1], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_by_rows)
        yield


@pytest.mark.parametrize("in_features, out_features, bias", [(96, 80, False), (64, 130, True)])
def test_linear_is_the_reference_and_each_row_the_same_at_any_row_count(in_features, out_features, bias):
    generator = torch.Generator().manual_seed(in_features)
    x = torch.randn(70, in_features, generator=generator).to(DEVICE, DTYPE)
    weight = torch.randn(out_features, in_features, generator=generator).to(DEVICE, DTYPE)
    b = torch.randn(out_features, generator=generator).to(DEVICE, DTYPE) if bias else None
    full = invariant_linear(x, weight, b)
    torch.testing.assert_close(full.float(), torch.nn.functional.linear(x.float(), weight.float(), b.float() if bias else None),
                               atol=0.05 if DTYPE == torch.bfloat16 else 1e-4, rtol=0.02 if DTYPE == torch.bfloat16 else 1e-4)
    for first, rows in ((0, 1), (3, 5), (64, 6), (10, 33)):  # one row, a verification's few, past a tile, a tile's edge
        assert torch.equal(invariant_linear(x[first:first + rows], weight, b), full[first:first + rows])


def test_linear_keeps_leading_dims():
    x = torch.randn(1, 3, 16).to(DEVICE, DTYPE)
    weight = torch.randn(8, 16).to(DEVICE, DTYPE)
    assert invariant_linear(x, weight, None).shape == (1, 3, 8)


def _paged(lengths: list[int], block: int, kv_heads: int, dim: int, generator) -> tuple:
    """Caches holding every sequence's keys (all but their last ``new`` tokens written by the call) and its block table."""
    blocks_per_seq = [-(-n // block) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator)
    order = torch.randperm(num_blocks - 1, generator=generator)[: sum(blocks_per_seq)] + 1  # block 0 never used
    tables = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
    at = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[at:at + count]
        at += count
    return k_cache, v_cache, tables


def _step(q_lens: list[int], kv_lens: list[int], tables: torch.Tensor, block: int) -> tuple:
    seq_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = []
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        for position in range(kv_len - q_len, kv_len):
            slots.append(int(tables[s, position // block]) * block + position % block)
    return seq_start, torch.tensor(kv_lens, dtype=torch.int32), torch.tensor(slots)


def _batch_info(q_lens: list[int], kv_lens: list[int]) -> torch.Tensor:
    """``[num_prefill, num_decode, max_q_len, max_kv_len]`` (the decodes last; the kernel reads none of it)."""
    decodes = sum(1 for n in q_lens if n == 1)
    return torch.tensor([len(q_lens) - decodes, decodes, max(q_lens), max(kv_lens)], dtype=torch.int32)


@pytest.mark.parametrize("heads, kv_heads, window, cap", [(4, 2, None, None), (2, 2, 7, None), (3, 1, None, 5.0)])
def test_attention_is_the_reference_and_each_token_the_same_as_its_decode(heads, kv_heads, window, cap):
    """A step of a 70-token prompt chunk after a cached prefix, a 5-token verification and a decode; then each
    of those tokens again as a one-token decode over the same cache: the same bits."""
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    block, dim = 8, 16
    q_lens, kv_lens = [70, 5, 1], [90, 40, 13]
    k_cache, v_cache, tables = _paged(kv_lens, block, kv_heads, dim, generator)
    seq_start, lens, slots = _step(q_lens, kv_lens, tables, block)
    total = sum(q_lens)
    q = torch.randn(1, total, heads, dim, generator=generator)
    k = torch.randn(1, total, kv_heads, dim, generator=generator)
    v = torch.randn(1, total, kv_heads, dim, generator=generator)
    options = dict(sliding_window=window, logit_cap=cap)
    caches = [c.clone() for c in (k_cache, v_cache)]
    info = _batch_info(q_lens, kv_lens)
    want = cached_attention_reference(q, k, v, *caches, seq_start, lens, tables, slots, info, dim**-0.5, **options)
    to = dict(device=DEVICE)
    k_dev, v_dev = k_cache.to(DEVICE, DTYPE), v_cache.to(DEVICE, DTYPE)
    inputs = [t.to(DEVICE, DTYPE) for t in (q, k, v)]
    got = invariant_attention(*inputs, k_dev, v_dev, seq_start.to(**to), lens.to(**to), tables.to(**to), slots.to(**to),
                              info, dim**-0.5, **options)
    assert torch.equal(k_dev.cpu().float(), caches[0].to(DTYPE).float())  # the new keys are in their slots
    tolerance = dict(atol=0.03, rtol=0.03) if DTYPE == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float().cpu(), want.float(), **tolerance)
    # Each sequence's tokens, one at a time, as decodes over the cache the step left.
    starts = seq_start.tolist()
    for s in range(len(q_lens)):
        for j in (0, q_lens[s] // 2, q_lens[s] - 1):
            token = starts[s] + j
            position = kv_lens[s] - q_lens[s] + j
            one = invariant_attention(
                inputs[0][:, token:token + 1], inputs[1][:, token:token + 1], inputs[2][:, token:token + 1], k_dev, v_dev,
                torch.tensor([0, 1], dtype=torch.int32, **to), torch.tensor([position + 1], dtype=torch.int32, **to),
                tables[s:s + 1].to(**to), slots[token:token + 1].to(**to), _batch_info([1], [position + 1]), dim**-0.5,
                **options)
            assert torch.equal(one[0, 0], got[0, token]), (s, j)


def test_padded_rows_past_the_step_are_zeros():
    """A captured graph's rows past ``seq_start[-1]``: zeros, never the buffer's old contents."""
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = _paged([3], 4, 1, 16, generator)
    seq_start, lens, slots = _step([1], [3], tables, 4)
    slots = torch.cat([slots, torch.tensor([0, 0])])  # the padded rows write the scratch block 0
    to = dict(device=DEVICE)
    q, k, v = (torch.randn(1, 3, 1, 16, generator=generator).to(DEVICE, DTYPE) for _ in range(3))
    out = invariant_attention(q, k, v, k_cache.to(DEVICE, DTYPE), v_cache.to(DEVICE, DTYPE), seq_start.to(**to),
                              lens.to(**to), tables.to(**to), slots.to(**to), _batch_info([1], [3]), 0.25)
    assert torch.equal(out[0, 1:], torch.zeros_like(out[0, 1:]))
    assert out[0, 0].abs().sum() > 0
