"""cached_attention's reference against un-cached attention over each sequence's whole history, on
random mixed batches (prompt chunks after cached prefixes, then decodes, blocks in shuffled places), T5's
bias by distance against its dense relative position bias; the SDPA backend against the reference, and the kernels
without a position bias refusing it."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy.custom_ops import canonical_ops
from autodeploy.custom_ops.attention import attention_reference
from autodeploy.custom_ops.cached_attention import cached_attention_reference
from autodeploy.custom_ops.cached_attention_sdpa import cached_attention_sdpa


def mixed_batch(seed: int, chunks: list[tuple[int, int]], decodes: list[int], block_size: int, q_heads=4, kv_heads=2, dim=8):
    """Inputs for prompt ``chunks`` (cached tokens, new tokens) then single-token ``decodes`` (context
    before the new token), with every sequence's blocks at shuffled places in the cache."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    sequences = [(cached, new) for cached, new in chunks] + [(context, 1) for context in decodes]
    blocks_per_seq = [-(-(cached + new) // block_size) for cached, new in sequences]
    order = list(range(sum(blocks_per_seq) + 2))
    rng.shuffle(order)
    width = max(blocks_per_seq)
    tables, slots, starts, lens, cursor = [], [], [0], [], 0
    for (cached, new), count in zip(sequences, blocks_per_seq):
        table = order[cursor : cursor + count]
        cursor += count
        tables.append(table + [0] * (width - count))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
        starts.append(starts[-1] + new)
        lens.append(cached + new)
    total = starts[-1]
    caches = [torch.randn(len(order), block_size, kv_heads, dim, generator=generator) for _ in range(2)]
    return (
        torch.randn(1, total, q_heads, dim, generator=generator),
        torch.randn(1, total, kv_heads, dim, generator=generator),
        torch.randn(1, total, kv_heads, dim, generator=generator),
        *caches,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(slots),
        torch.tensor([len(chunks), len(decodes), max([n for _, n in chunks], default=1), max(lens)], dtype=torch.int32),
    )


def run(kernel, inputs, *options):
    copied = [t.clone() for t in inputs]
    out = kernel(*copied, 0.3, *options)
    return out, copied[3], copied[4]


def t5_bias(seed: int, length: int, num_buckets: int = 8, max_distance: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder's relative position bias table ``[num_buckets, 4]`` and its rows by distance ``[4, length]``."""
    table = torch.randn(num_buckets, 4, generator=torch.Generator().manual_seed(seed)) * 2
    return table, torch.ops.autodeploy.relative_position_bias_by_distance(table, length, False, max_distance)


def test_reference_prefill_equals_uncached_attention():
    inputs = mixed_batch(0, [(0, 11)], [], block_size=4)
    out, _, _ = run(cached_attention_reference, inputs, 5)
    q, k, v = inputs[:3]
    torch.testing.assert_close(out, attention_reference(q, k, v, 0.3, 5))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    chunks=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), max_size=3),
    decodes=st.lists(st.integers(1, 40), max_size=6),
    block_size=st.sampled_from([1, 4, 8]),
    window=st.sampled_from([None, 3, 16]),
    cap=st.sampled_from([None, 5.0]),
    with_sinks=st.booleans(),
    with_alibi=st.booleans(),
    bias_spare=st.one_of(st.none(), st.integers(0, 30)),  # a distance bias, its columns past the longest sequence
)
def test_each_sequence_sees_exactly_its_own_history(seed, chunks, decodes, block_size, window, cap, with_sinks, with_alibi,
                                                     bias_spare):
    """Against un-cached attention over the sequence's whole history; a ``distance_bias`` (T5's decoder) against the
    dense ``relative_position_bias`` over those positions, whatever is cached."""
    if not chunks and not decodes:
        return
    inputs = mixed_batch(seed, chunks, decodes, block_size)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
    alibi = [0.5, 0.25, 0.125, 0.0625] if with_alibi else None
    table, by_distance = t5_bias(seed, int(inputs[6].max()) + bias_spare) if bias_spare is not None else (None, None)
    out, k_cache, v_cache = run(cached_attention_reference, inputs, window, cap, sinks, alibi, 1.0, 1.0, None, None, by_distance)
    q, k, v, k_before, v_before, starts, lens, tables = inputs[:8]
    for s, (first, last) in enumerate(zip(starts.tolist(), starts.tolist()[1:])):
        total, new = int(lens[s]), last - first
        slots = [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(total)]
        keys = k_before.flatten(0, 1)[slots[: total - new]]
        values = v_before.flatten(0, 1)[slots[: total - new]]
        full_k = torch.cat((keys, k[0, first:last]))[None]
        full_v = torch.cat((values, v[0, first:last]))[None]
        full_q = torch.cat((torch.zeros(total - new, *q.shape[2:]), q[0, first:last]))[None]
        positions = torch.arange(total)
        dense = None if table is None else torch.ops.autodeploy.relative_position_bias(table, positions, positions, False, 12)
        expected = attention_reference(full_q, full_k, full_v, 0.3, window, cap, sinks, alibi, dense)[:, total - new :]
        torch.testing.assert_close(out[:, first:last], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(k_cache.flatten(0, 1)[slots[total - new :]], k[0, first:last])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    chunks=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), max_size=3),
    decodes=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 4, 8]),
    window=st.sampled_from([None, 3, 16]),
    alibi=st.sampled_from([None, [0.5, 0.25, 0.125, 0.0625]]),
    with_bias=st.booleans(),
)
def test_sdpa_backend_equals_the_reference(seed, chunks, decodes, block_size, window, alibi, with_bias):
    """Prompts, the batched decodes (the decode-only fast path when there are no chunks), window, ALiBi and T5's
    ``distance_bias``, alone or together."""
    inputs = mixed_batch(seed, chunks, decodes, block_size)
    options = (window, None, None, alibi, 1.0, 1.0, None, None, t5_bias(seed, 64)[1] if with_bias else None)
    expected, k_ref, v_ref = run(cached_attention_reference, inputs, *options)
    got, k_new, v_new = run(cached_attention_sdpa, inputs, *options)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)


@pytest.mark.parametrize(
    "chunks, decodes, window",
    [
        ([(0, 7)] * 3, [12, 12], None),   # fresh prompts of one length: one batched causal call; uniform decodes
        ([(0, 7), (0, 5)], [3], None),     # fresh prompts of two lengths: one causal call each; a lone decode
        ([(0, 7), (4, 3)], [12, 12], 16),  # a prefixed chunk among fresh ones; a window wider than every length
        ([(0, 7)] * 2, [12, 12], 5),       # a window that hides keys: masks, no fast path
    ],
)
def test_sdpa_fast_paths_equal_the_reference(chunks, decodes, window):
    inputs = mixed_batch(11, chunks, decodes, 4)
    expected, k_ref, v_ref = run(cached_attention_reference, inputs, window)
    got, k_new, v_new = run(cached_attention_sdpa, inputs, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)


def test_sdpa_refuses_soft_capping_and_sinks_so_select_passes_them_on():
    sdpa = next(b for b in canonical_ops()["cached_attention"].backends if b.name == "sdpa")
    inputs = [t.to("meta") for t in mixed_batch(3, [(5, 6)], [9], block_size=4)]
    assert sdpa.check([*inputs, 0.1], torch.device("cpu")) is None
    assert sdpa.check([*inputs, 0.1, None, 5.0], torch.device("cpu")) == "SDPA has no soft-capping or sinks"
    with pytest.raises(ValueError, match="no soft-capping or sinks"):
        run(cached_attention_sdpa, mixed_batch(3, [(5, 6)], [9], block_size=4), None, 5.0)


def test_sdpa_backend_in_bfloat16():
    inputs = [t.bfloat16() if t.is_floating_point() else t for t in mixed_batch(3, [(5, 6)], [9, 30, 2], block_size=4)]
    expected, _, _ = run(cached_attention_reference, inputs, 4)
    got, _, _ = run(cached_attention_sdpa, inputs, 4)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_an_fp8_cache_stores_values_over_their_scale_and_reads_them_back_times_it():
    from autodeploy.custom_ops.cached_attention import read_back, write_kv_cache

    k, v = torch.tensor([[[[1.0, -600.0]]]]), torch.tensor([[[[0.01, 2.0]]]])  # [1, T=1, Hkv=1, D=2]
    k_cache, v_cache = (torch.zeros(2, 2, 1, 2, dtype=torch.float8_e4m3fn) for _ in range(2))
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([3]), k_scale=0.5, v_scale=0.01)
    assert k_cache[1, 1, 0].float().tolist() == [2.0, -448.0]  # 1 / 0.5; -1200 saturates
    assert read_back(k_cache[1, 1], torch.float32, 0.5)[0].tolist() == [1.0, -224.0]
    assert read_back(v_cache[1, 1], torch.float32, 0.01)[0].tolist() == pytest.approx([0.01, 2.0], rel=2**-4)


def block_rows(starts: list[int], lens: list[int], blocks: list[list[tuple[int, int]]]) -> torch.Tensor:
    """``attend_until`` for the prompt chunks of a batch: a token inside one of its sequence's ``blocks`` (absolute
    [first, end) spans) sees up to the block's last position; every other token -1."""
    rows = []
    for s, (first, last) in enumerate(zip(starts, starts[1:])):
        chunk_start = lens[s] - (last - first)
        for position in range(chunk_start, lens[s]):
            rows.append(next((end - 1 for a, end in (blocks[s] if s < len(blocks) else ()) if a <= position < end), -1))
    return torch.tensor(rows)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cached=st.integers(0, 6),
    block=st.tuples(st.integers(0, 8), st.integers(2, 9)),  # where the block starts in the chunk, its length
    decodes=st.lists(st.integers(1, 20), max_size=3),
    block_size=st.sampled_from([1, 4]),
    window=st.sampled_from([None, 3]),
)
def test_bidirectional_blocks_see_one_another_as_hugging_faces_token_type_mask_says(seed, cached, block, decodes,
                                                                                   block_size, window):
    """A prompt chunk holding a block of tokens that see one another both ways (Gemma 3's image) after a cached
    prefix, beside decodes: the reference equals a dense mask built as Hugging Face builds it — (causal or same
    block) and within the window — and the SDPA backend equals the reference."""
    offset, length = block
    new = offset + length + 2
    inputs = mixed_batch(seed, [(cached, new)], decodes, block_size)
    starts, lens = inputs[5].tolist(), inputs[6].tolist()
    first, end = cached + offset, cached + offset + length
    until = block_rows(starts, lens, [[(first, end)]])
    out, _, _ = run(cached_attention_reference, inputs, window, None, None, None, 1.0, 1.0, None, until)
    q, k, v, k_before, _, _, _, tables = inputs[:8]
    total = cached + new
    slots = [int(tables[0, p // block_size]) * block_size + p % block_size for p in range(cached)]
    keys = torch.cat((k_before.flatten(0, 1)[slots], k[0, :new])).double()
    values = torch.cat((inputs[4].flatten(0, 1)[slots], v[0, :new])).double()
    positions = torch.arange(total)
    query_pos, key_pos = positions[cached:, None], positions[None, :]
    same_block = (query_pos >= first) & (query_pos < end) & (key_pos >= first) & (key_pos < end)
    visible = (key_pos <= query_pos) | same_block
    if window is not None:
        visible &= key_pos > query_pos - window
    heads = torch.arange(4) // 2
    logits = torch.einsum("qhd,khd->hqk", q[0, :new].double(), keys[:, heads]) * 0.3
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
    expected = torch.einsum("hqk,khd->qhd", probs, values[:, heads]).float()
    torch.testing.assert_close(out[0, :new], expected, atol=1e-5, rtol=1e-5)
    causal, _, _ = run(cached_attention_reference, inputs, window)
    assert not torch.allclose(out[0, first - cached : end - cached - 1], causal[0, first - cached : end - cached - 1])
    got, _, _ = run(cached_attention_sdpa, inputs, window, None, None, None, 1.0, 1.0, None, until)
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)


def test_a_distance_bias_shorter_than_a_sequence_or_beside_attend_until_is_refused():
    inputs = mixed_batch(2, [(5, 6)], [9], block_size=4)  # sequences of 11 and 10 tokens
    _, too_short = t5_bias(0, 10)
    for kernel in (cached_attention_reference, cached_attention_sdpa):
        with pytest.raises(ValueError, match=r"distance_bias must be \[Hq=4, L ≥ 11 \(the longest sequence\)\]; got \(4, 10\)"):
            run(kernel, inputs, None, None, None, None, 1.0, 1.0, None, None, too_short)
    until = torch.full((7,), -1)
    with pytest.raises(ValueError, match="cannot bias keys after it"):
        run(cached_attention_reference, inputs, None, None, None, None, 1.0, 1.0, None, until, t5_bias(0, 11)[1])


def test_the_triton_kernels_take_a_position_bias_and_the_batch_invariant_ones_refuse_it():
    """On a GPU the Triton kernels (``cached_attention``'s and its rope variant's) take a ``distance_bias`` (T5's decoder),
    so select gives T5's self-attention a capturable kernel; the batch-invariant ones do not, and say so."""
    from autodeploy.custom_ops.cached_attention import DISTANCE_BIAS_REFUSAL, CachedAttentionArgs
    from autodeploy.custom_ops.registry import candidates
    from autodeploy.custom_ops.triton.batch_invariant import unsupported_attention

    inputs = [t.to("meta") for t in mixed_batch(3, [(5, 6)], [9], block_size=4)]
    biased = [*inputs, 0.3, None, None, None, None, 1.0, 1.0, None, None, torch.empty(4, 16, device="meta")]
    angles = (torch.ones(1, 7, 8, device="meta"), torch.ones(1, 7, 8, device="meta"), False)
    cuda = torch.device("cuda")
    assert {b.name: b.check(biased, cuda) for b in candidates("cached_attention")}["triton"] is None
    assert {b.name: b.check([*biased[:3], *angles, *biased[3:]], cuda) for b in candidates("cached_attention_rope")}["triton"] is None
    assert unsupported_attention(CachedAttentionArgs(*biased)) == DISTANCE_BIAS_REFUSAL
