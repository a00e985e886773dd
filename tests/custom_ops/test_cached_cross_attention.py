"""cached_cross_attention and write_cross_kv: the reference against dense per-sequence attention and against Hugging
Face's BART and T5 cross-attention, on mixed batches whose cross caches sit in shuffled blocks (every slot that no
sequence owns holds NaN, so a read past a sequence's encoder keys fails loudly); the SDPA backend against the
reference; the capturable dense backend against the reference, on the decode batches a CUDA graph replays (tables as
wide as the graph's, spare rows with no encoder positions) and without reading a device tensor on the host; fp8 caches;
the fake through FakeTensorMode, opcheck and torch.export."""

from __future__ import annotations

import doctest
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim
from transformers import BartConfig, T5Config
from transformers.models.bart.modeling_bart import BartAttention
from transformers.models.t5.modeling_t5 import T5Attention

from autodeploy.custom_ops import candidates, canonical_ops
from autodeploy.custom_ops import cached_cross_attention as cross_module
from autodeploy.custom_ops.cached_attention import read_back
from autodeploy.custom_ops.cached_cross_attention import (cached_cross_attention, cached_cross_attention_dense,
                                                          cached_cross_attention_reference, cached_cross_attention_sdpa,
                                                          write_cross_kv)


def paged_cross_cache(keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, seed: int,
                      cache_dtype: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> tuple:
    """``(k_cache, v_cache, cross_lens, block_tables)`` holding each sequence's encoder ``keys[s]`` / ``values[s]``
    (``[L_s, Hkv, D]``), written with ``write_cross_kv`` into blocks at shuffled places; table padding names a block
    that no sequence owns, and every slot no sequence owns holds NaN."""
    blocks_per_seq = [-(-len(k) // block_size) for k in keys]
    order = list(range(sum(blocks_per_seq) + 1))
    random.Random(seed).shuffle(order)
    width, cursor, tables, slots = max(max(blocks_per_seq), 1), 0, [], []
    for length, count in zip((len(k) for k in keys), blocks_per_seq):
        table = order[cursor : cursor + count]
        cursor += count
        tables.append(table + [order[-1]] * (width - count))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(length)]
    caches = [torch.full((len(order), block_size, *rows[0].shape[1:]), float("nan")).to(cache_dtype or rows[0].dtype)
              for rows in (keys, values)]
    write_cross_kv(torch.cat(keys)[None], torch.cat(values)[None], *caches, torch.tensor(slots, dtype=torch.int64),
                   k_scale, v_scale)
    return (*caches, torch.tensor([len(k) for k in keys], dtype=torch.int32), torch.tensor(tables, dtype=torch.int32))


def cross_batch(seed: int, prefills: list[tuple[int, int]], decodes: list[int], block_size: int = 4, q_heads: int = 4,
                kv_heads: int = 2, dim: int = 8, value_dim: int = 6, dtype: torch.dtype = torch.float32,
                cache_dtype: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
    """The op's arguments (up to ``batch_info``) for ``prefills`` as (decoder tokens, encoder length) then one-token
    ``decodes`` of the given encoder lengths, and the encoder keys and values each sequence's cache holds."""
    generator = torch.Generator().manual_seed(seed)
    q_lens = [q_len for q_len, _ in prefills] + [1] * len(decodes)
    lengths = [length for _, length in prefills] + list(decodes)
    keys = [torch.randn(n, kv_heads, dim, generator=generator).to(dtype) for n in lengths]
    values = [torch.randn(n, kv_heads, value_dim, generator=generator).to(dtype) for n in lengths]
    k_cache, v_cache, cross_lens, tables = paged_cross_cache(keys, values, block_size, seed, cache_dtype, k_scale, v_scale)
    q = torch.randn(1, sum(q_lens), q_heads, dim, generator=generator).to(dtype)
    seq_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    batch_info = torch.tensor([len(prefills), len(decodes), max(q_lens), max(lengths)], dtype=torch.int32)
    return (q, k_cache, v_cache, seq_start, cross_lens, tables, batch_info), keys, values


def dense_cross_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(scale · q kᵀ) v`` of one sequence in float64, kv heads repeated for their query heads:
    ``q[q_len, Hq, D]``, ``keys[L, Hkv, D]`` → ``[q_len, Hq, Dv]``."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("ihd,jhd->hij", q.double(), keys) * scale, dim=-1)
    return torch.einsum("hij,jhd->ihd", probs, values)


def per_sequence(out: torch.Tensor, seq_start: torch.Tensor) -> list[torch.Tensor]:
    starts = seq_start.tolist()
    return [out[0, first:last] for first, last in zip(starts, starts[1:])]


batches = dict(
    seed=st.integers(0, 10_000),
    prefills=st.lists(st.tuples(st.integers(1, 7), st.integers(0, 20)), max_size=3),
    decodes=st.lists(st.integers(0, 30), max_size=5),
    block_size=st.sampled_from([1, 4, 16]),
    kv_heads=st.sampled_from([1, 2, 4]),
)


@settings(max_examples=40, deadline=None)
@given(**batches, scale=st.sampled_from([None, 1.0, 0.3]))
def test_reference_equals_dense_attention_over_each_sequences_encoder_keys(seed, prefills, decodes, block_size,
                                                                           kv_heads, scale):
    if not prefills and not decodes:
        return
    args, keys, values = cross_batch(seed, prefills, decodes, block_size, kv_heads=kv_heads)
    out = cached_cross_attention_reference(*args, scale)
    assert out.shape == (1, args[0].shape[1], 4, 6) and out.dtype == torch.float32
    q_rows = per_sequence(args[0], args[3])
    for got, q, k, v in zip(per_sequence(out, args[3]), q_rows, keys, values):
        expected = dense_cross_attention(q, k, v, 8**-0.5 if scale is None else scale)
        torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)


BACKENDS = pytest.mark.parametrize("backend", [cached_cross_attention_sdpa, cached_cross_attention_dense], ids=["sdpa", "dense"])
KERNELS = pytest.mark.parametrize("kernel", [cached_cross_attention_reference, cached_cross_attention_sdpa, cached_cross_attention_dense],
                                  ids=["reference", "sdpa", "dense"])


@BACKENDS
@settings(max_examples=40, deadline=None)
@given(**batches)
def test_each_backend_equals_the_reference(backend, seed, prefills, decodes, block_size, kv_heads):
    if not prefills and not decodes:
        return
    args, _, _ = cross_batch(seed, prefills, decodes, block_size, kv_heads=kv_heads)
    torch.testing.assert_close(backend(*args), cached_cross_attention_reference(*args), atol=1e-5, rtol=1e-5)


def graph_decode_batch(seed: int, lengths: list[int], size: int, max_blocks: int, block_size: int = 4, kv_heads: int = 2,
                       num_blocks: int = 0):
    """A decode step as a captured graph holds it: ``lengths`` real decodes, then spare rows up to ``size`` with no
    encoder positions whose tables name block 0, every table ``max_blocks`` wide (past a sequence's blocks: blocks
    it does not own, NaN in every slot); the caches padded to ``num_blocks`` blocks of NaN."""
    (q, k_cache, v_cache, _, cross_lens, tables, _), _, _ = cross_batch(seed, [], lengths, block_size, kv_heads=kv_heads)
    k_cache, v_cache = (torch.cat([c, c.new_full((num_blocks - len(c), *c.shape[1:]), float("nan"))]) if num_blocks > len(c)
                        else c for c in (k_cache, v_cache))
    unowned = int(k_cache.flatten(1).isnan().all(1).nonzero()[0])
    wide = torch.full((size, max_blocks), unowned, dtype=torch.int32)
    wide[: len(lengths), : tables.shape[1]] = tables
    wide[len(lengths) :] = 0
    padded_q = torch.cat([q, torch.randn(1, size - len(lengths), *q.shape[2:])], dim=1)
    lens = torch.cat([cross_lens, torch.zeros(size - len(lengths), dtype=torch.int32)])
    seq_start = torch.arange(size + 1, dtype=torch.int32)
    return (padded_q, k_cache, v_cache, seq_start, lens, wide, torch.tensor([0, size, 1, max_blocks * block_size], dtype=torch.int32))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), lengths=st.lists(st.integers(0, 30), min_size=1, max_size=5),
       spare=st.integers(0, 3), kv_heads=st.sampled_from([1, 2, 4]))
def test_dense_serves_a_padded_decode_graph_batch_and_its_spare_rows_give_zeros(seed, lengths, spare, kv_heads):
    args = graph_decode_batch(seed, lengths, len(lengths) + spare, max_blocks=10, kv_heads=kv_heads)
    out = cached_cross_attention_dense(*args)
    assert not out.isnan().any()
    real = len(lengths)
    trimmed = (args[0][:, :real], *args[1:3], args[3][: real + 1], args[4][:real], args[5][:real],
               torch.tensor([0, real, 1, max(lengths)], dtype=torch.int32))
    torch.testing.assert_close(out[:, :real], cached_cross_attention_reference(*trimmed), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, real:], torch.zeros_like(out[:, real:]))


@pytest.mark.parametrize("batch", [dict(prefills=[], decodes=[6, 0, 13]), dict(prefills=[(4, 5), (2, 0)], decodes=[9, 3])],
                         ids=["decodes", "mixed"])
def test_dense_reads_no_device_tensor_on_the_host(batch):
    """Every tensor but ``batch_info`` (the CPU's, as the runtime passes it) on the meta device, whose data no host
    read can reach: what a CUDA graph capture asks of a kernel."""
    args, _, _ = cross_batch(1, **batch)
    out = cached_cross_attention_dense(*(a.to("meta") for a in args[:6]), args[6])
    assert out.shape == args[0].shape[:3] + (6,) and out.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_on_a_gpu_dense_is_captured_once_and_replays_each_steps_lengths_and_tables(dtype, tolerance):
    """One capture over static buffers, then replays after new queries, lengths (0 among them) and tables are copied in:
    each replay computes that step's attention, as the decode graphs' replays must."""
    steps = [graph_decode_batch(seed, lengths, 4, max_blocks=8, num_blocks=12)
             for seed, lengths in ((0, [5, 17]), (1, [30, 0, 2]), (2, [1, 9, 12, 4]))]
    steps = [(step[0].to(dtype), *(c.to(dtype) for c in step[1:3]), *step[3:]) for step in steps]
    # q, caches, seq_start, lengths and tables at fixed addresses, as the engine's; batch_info stays on the CPU
    static = [a.cuda() for a in steps[0][:6]] + [steps[0][6]]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cached_cross_attention_dense(*static)  # once eagerly before capture, as the engine does
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cached_cross_attention_dense(*static)
    for step in steps:
        for buffer, value in zip(static, step[:6]):
            buffer.copy_(value)
        graph.replay()
        torch.testing.assert_close(out.cpu(), cached_cross_attention_reference(*step), atol=tolerance, rtol=tolerance)


@KERNELS
def test_a_sequence_without_encoder_positions_gets_zeros(kernel):
    args, keys, values = cross_batch(5, [(3, 0), (2, 9)], [0, 7, 0], block_size=4)
    out = per_sequence(kernel(*args), args[3])
    for s in (0, 2, 4):
        assert torch.equal(out[s], torch.zeros_like(out[s]))
    for s in (1, 3):
        expected = dense_cross_attention(per_sequence(args[0], args[3])[s], keys[s], values[s], 8**-0.5)
        torch.testing.assert_close(out[s], expected.float(), atol=1e-5, rtol=1e-5)


@KERNELS
def test_decodes_alone_of_one_encoder_length_and_of_several(kernel):
    """Decodes only: the batched SDPA call without a mask (equal lengths, beam search's case) and with one."""
    for decodes in ([6, 6, 6], [6, 1, 13]):
        args, keys, values = cross_batch(2, [], decodes)
        for got, q, k, v in zip(per_sequence(kernel(*args), args[3]), per_sequence(args[0], args[3]), keys, values):
            torch.testing.assert_close(got, dense_cross_attention(q, k, v, 8**-0.5).float(), atol=1e-5, rtol=1e-5)


def test_scale_none_is_the_inverse_square_root_of_the_head_dim_and_differs_from_one():
    args, _, _ = cross_batch(1, [(3, 7)], [5])
    default = cached_cross_attention_reference(*args)
    assert torch.equal(default, cached_cross_attention_reference(*args, 8**-0.5))
    assert not torch.allclose(default, cached_cross_attention_reference(*args, 1.0))


def hf_cross_attention_inputs(attention: torch.nn.Module, q_proj, k_proj, v_proj, heads: int, dtype: torch.dtype,
                              prefills: list[tuple[int, int]], decodes: list[int], seed: int):
    """Decoder hidden states and encoder outputs per sequence, and the op's arguments built from the module's own
    projections: q from the decoder tokens flattened into one row, cross keys and values from the encoder outputs,
    written into a shuffled paged cache."""
    generator = torch.Generator().manual_seed(seed)
    width = q_proj.in_features
    sequences = list(prefills) + [(1, length) for length in decodes]
    decoder = [torch.randn(1, q_len, width, generator=generator).to(dtype) for q_len, _ in sequences]
    encoder = [torch.randn(1, length, width, generator=generator).to(dtype) for _, length in sequences]
    with torch.no_grad():
        q = q_proj(torch.cat(decoder, dim=1)).unflatten(-1, (heads, -1))
        keys = [k_proj(states)[0].unflatten(-1, (heads, -1)) for states in encoder]
        values = [v_proj(states)[0].unflatten(-1, (heads, -1)) for states in encoder]
    k_cache, v_cache, cross_lens, tables = paged_cross_cache(keys, values, 4, seed)
    seq_start = torch.tensor([0, *torch.tensor([n for n, _ in sequences]).cumsum(0).tolist()], dtype=torch.int32)
    batch_info = torch.tensor([len(prefills), len(decodes), max(n for n, _ in sequences), max(cross_lens)], dtype=torch.int32)
    return decoder, encoder, (q, k_cache, v_cache, seq_start, cross_lens, tables, batch_info)


# Encoder lengths 5, 9 and 3 under 4 decoder tokens (a first step with a forced prefix) and two single-token decodes;
# the decodes' lengths differ, so the SDPA backend pads and masks them.
MIXED = dict(prefills=[(4, 5)], decodes=[9, 3])
DTYPES = pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])


@DTYPES
@KERNELS
def test_equals_hugging_face_bart_cross_attention(kernel, dtype, tolerance):
    config = BartConfig(d_model=32, decoder_attention_heads=4)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = BartAttention(32, 4, is_decoder=True, config=config, layer_idx=0).to(dtype).eval()
    decoder, encoder, args = hf_cross_attention_inputs(attention, attention.q_proj, attention.k_proj, attention.v_proj,
                                                      4, dtype, seed=3, **MIXED)
    with torch.no_grad():
        out = attention.out_proj(kernel(*args).flatten(-2))  # scale None: BART's head_dim ** -0.5
        for got, hidden, states in zip(per_sequence(out, args[3]), decoder, encoder):
            expected, _ = attention(hidden, key_value_states=states)
            torch.testing.assert_close(got, expected[0], atol=tolerance, rtol=tolerance)


@DTYPES
@KERNELS
def test_equals_hugging_face_t5_cross_attention_with_unscaled_logits(kernel, dtype, tolerance):
    config = T5Config(d_model=32, d_kv=8, num_heads=4, is_decoder=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = T5Attention(config, has_relative_attention_bias=False, layer_idx=0).to(dtype).eval()
    decoder, encoder, args = hf_cross_attention_inputs(attention, attention.q, attention.k, attention.v, 4, dtype,
                                                      seed=4, **MIXED)
    with torch.no_grad():
        out = attention.o(kernel(*args, 1.0).flatten(-2))
        for got, hidden, states in zip(per_sequence(out, args[3]), decoder, encoder):
            expected = attention(hidden, key_value_states=states)[0]
            torch.testing.assert_close(got, expected[0], atol=tolerance, rtol=tolerance)


def test_an_fp8_cache_is_read_back_times_its_scales():
    args, keys, values = cross_batch(7, [(3, 11)], [6, 2], cache_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.02)
    k_cache, v_cache = args[1], args[2]
    assert k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
    out = cached_cross_attention_reference(*args, None, 0.5, 0.02)
    q_rows = per_sequence(args[0], args[3])
    for s, got in enumerate(per_sequence(out, args[3])):
        stored_k = (keys[s].float() / 0.5).to(torch.float8_e4m3fn)
        stored_v = (values[s].float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
        expected = dense_cross_attention(q_rows[s], read_back(stored_k, torch.float32, 0.5),
                                         read_back(stored_v, torch.float32, 0.02), 8**-0.5)
        torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
        unquantized = dense_cross_attention(q_rows[s], keys[s], values[s], 8**-0.5).float()
        torch.testing.assert_close(got, unquantized, atol=0.2, rtol=0.1)
    for backend in (cached_cross_attention_sdpa, cached_cross_attention_dense):
        torch.testing.assert_close(backend(*args, None, 0.5, 0.02), out, atol=1e-5, rtol=1e-5)


def test_write_cross_kv_stores_each_encoder_token_at_its_slot_and_nothing_else():
    keys, values = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 6)
    k_cache, v_cache = torch.full((4, 2, 2, 8), float("nan")), torch.full((4, 2, 2, 6), float("nan"))
    slots = torch.tensor([6, 7, 2, 0, 1])
    write_cross_kv(keys, values, k_cache, v_cache, slots)
    assert torch.equal(k_cache.flatten(0, 1)[slots], keys[0]) and torch.equal(v_cache.flatten(0, 1)[slots], values[0])
    assert k_cache.flatten(0, 1)[[3, 4, 5]].isnan().all() and v_cache.flatten(0, 1)[[3, 4, 5]].isnan().all()


def test_reference_rejects_query_heads_that_are_no_multiple_of_the_kv_heads():
    args, _, _ = cross_batch(0, [(2, 3)], [4], kv_heads=3)
    with pytest.raises(ValueError, match="Hq=4 must be a multiple of kv heads Hkv=3"):
        cached_cross_attention_reference(*args)


def test_reference_rejects_an_encoder_length_past_its_block_table():
    args, _, _ = cross_batch(0, [(2, 3)], [4])  # block size 4, one block a sequence
    too_long = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="must lie in 0 … 4"):
        cached_cross_attention_reference(*args[:4], too_long, *args[5:])


def test_sdpa_and_dense_are_candidates_for_every_call_and_only_dense_is_captured():
    (sdpa, _, dense, reference) = candidates("cached_cross_attention")
    assert (sdpa.name, dense.name, reference.name) == ("sdpa", "dense", "reference")
    assert sdpa.op is torch.ops.autodeploy.cached_cross_attention_sdpa.default
    assert dense.op is torch.ops.autodeploy.cached_cross_attention_dense.default
    args, _, _ = cross_batch(0, [(2, 3)], [4], cache_dtype=torch.float8_e4m3fn)
    meta = [a.to("meta") if a.is_floating_point() else a for a in args]
    for backend in (sdpa, dense):
        assert backend.check([*meta, 1.0, 0.5, 0.5], torch.device("cuda")) is None
    assert dense.capturable and not sdpa.capturable and not canonical_ops()["cached_cross_attention"].reference_capturable
    args, _, _ = cross_batch(0, [(2, 3)], [4])
    for backend in (sdpa, dense):
        torch.testing.assert_close(backend.op(*args), reference.op(*args), atol=1e-5, rtol=1e-5)


def test_dense_refuses_query_heads_that_are_no_multiple_of_the_kv_heads():
    args, _, _ = cross_batch(0, [(2, 3)], [4], kv_heads=3)
    dense = next(b for b in candidates("cached_cross_attention") if b.name == "dense")
    assert dense.check([a.to("meta") if a.is_floating_point() else a for a in args], torch.device("cuda")) == (
        "query heads Hq=4 must be a multiple of kv heads Hkv=3")


def test_fake_gives_shape_and_dtype():
    args, _, _ = cross_batch(0, [(3, 5)], [4, 2], dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        out = cached_cross_attention(*(mode.from_tensor(a) for a in args))
    assert (out.shape, out.dtype) == ((1, 5, 4, 6), torch.bfloat16)


def test_opcheck():
    args, _, _ = cross_batch(0, [(3, 5)], [4, 2])
    torch.library.opcheck(cached_cross_attention, args)
    torch.library.opcheck(cached_cross_attention, (*args, 1.0, 0.5, 2.0))
    torch.library.opcheck(torch.ops.autodeploy.cached_cross_attention_dense.default, args)
    torch.library.opcheck(torch.ops.autodeploy.cached_cross_attention_dense.default, graph_decode_batch(0, [3, 0, 9], 4, 5))
    keys, values, caches = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 6), (torch.zeros(2, 2, 2, 8), torch.zeros(2, 2, 2, 6))
    torch.library.opcheck(write_cross_kv, (keys, values, *caches, torch.tensor([3, 0, 1])))


class DecoderCrossAttention(torch.nn.Module):
    """A query projection, then cross-attention over the paged cache: a decoder layer's half."""

    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 32)

    def forward(self, hidden, k_cache, v_cache, seq_start, cross_lens, block_tables, batch_info):
        q = self.q_proj(hidden).unflatten(-1, (4, 8))
        return cached_cross_attention(q, k_cache, v_cache, seq_start, cross_lens, block_tables, batch_info).flatten(-2)


class EncoderCrossKV(torch.nn.Module):
    """The encoder graph's end: a layer's cross key and value projections written into its cross cache."""

    def __init__(self):
        super().__init__()
        self.k_proj, self.v_proj = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)

    def forward(self, encoder_states, k_cache, v_cache, slot_mapping):
        kv_shape = (2, 8)
        write_cross_kv(self.k_proj(encoder_states).unflatten(-1, kv_shape), self.v_proj(encoder_states).unflatten(-1, kv_shape),
                       k_cache, v_cache, slot_mapping)
        return encoder_states


def test_export_writes_the_cross_cache_and_reads_it_with_a_dynamic_token_count():
    torch.manual_seed(0)
    encoder, decoder = EncoderCrossKV(), DecoderCrossAttention()
    caches = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    slots = torch.tensor([20, 21, 22, 23, 8, 9, 10, 4, 5])  # 7 encoder tokens in blocks [5, 2], then 2 in block [1]
    encoder_program = torch.export.export(encoder, (torch.randn(1, 9, 32), *caches, slots),
                                          dynamic_shapes=({1: Dim("encoder_tokens")}, None, None, {0: Dim("encoder_tokens")}))
    states = torch.randn(1, 6, 32)
    exported_caches, eager_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    encoder_program.module()(states, *exported_caches, slots[:6])
    encoder(states, *eager_caches, slots[:6])
    assert all(torch.equal(a, b) for a, b in zip(exported_caches, eager_caches))

    metadata = (torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([6, 0], dtype=torch.int32),
                torch.tensor([[5, 2], [1, 1]], dtype=torch.int32), torch.tensor([1, 1, 3, 6], dtype=torch.int32))
    program = torch.export.export(decoder, (torch.randn(1, 4, 32), *exported_caches, *metadata),
                                  dynamic_shapes=({1: Dim("decoder_tokens")}, *[None] * 6))
    (node,) = [n for n in program.graph.nodes if n.target is torch.ops.autodeploy.cached_cross_attention.default]
    assert isinstance(node.meta["val"].shape[1], torch.SymInt)
    hidden = torch.randn(1, 6, 32)
    longer = (torch.tensor([0, 5, 6], dtype=torch.int32), *metadata[1:3], torch.tensor([1, 1, 5, 6], dtype=torch.int32))
    torch.testing.assert_close(program.module()(hidden, *exported_caches, *longer), decoder(hidden, *eager_caches, *longer))


def test_module_docstring_example():
    results = doctest.testmod(cross_module)
    assert results.attempted > 0 and results.failed == 0


from tests.custom_ops.test_paged_attention_triton import interpreter_loops_with_numpy_2_4  # noqa: E402,F401  (autouse)

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: Triton's interpreter (tests/conftest.py)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       spare=st.integers(0, 2), kv_heads=st.sampled_from([1, 2, 4]))
def test_triton_serves_a_padded_decode_graph_batch_from_the_blocks_in_place(seed, lengths, spare, kv_heads):
    """The paged decode kernel over each sequence's own encoder positions: equal to the reference, spare rows zeros."""
    from autodeploy.custom_ops.cached_cross_attention import cached_cross_attention_triton

    args = graph_decode_batch(seed, lengths, len(lengths) + spare, max_blocks=12, kv_heads=kv_heads)
    out = cached_cross_attention_triton(*(a.to(TRITON_DEVICE) for a in args[:6]), args[6]).cpu()
    real = len(lengths)
    trimmed = (args[0][:, :real], *args[1:3], args[3][: real + 1], args[4][:real], args[5][:real],
               torch.tensor([0, real, 1, max(lengths)], dtype=torch.int32))
    torch.testing.assert_close(out[:, :real], cached_cross_attention_reference(*trimmed), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, real:], torch.zeros_like(out[:, real:]))


def test_triton_hands_steps_with_prefill_chunks_to_dense_and_is_a_capturable_candidate_on_cuda_only():
    from autodeploy.custom_ops.cached_cross_attention import cached_cross_attention_triton

    args, _, _ = cross_batch(3, [(3, 7), (1, 2)], [9, 4])
    torch.testing.assert_close(cached_cross_attention_triton(*args), cached_cross_attention_reference(*args), atol=1e-5, rtol=1e-5)
    triton = next(b for b in candidates("cached_cross_attention") if b.name == "triton")
    assert triton.capturable
    assert "CUDA" in triton.check([*args, None, 1.0, 1.0], torch.device("cpu"))
    meta = [a.to("meta") if a.is_floating_point() else a for a in args]
    assert triton.check([*meta, None, 1.0, 1.0], torch.device("cuda")) is None
