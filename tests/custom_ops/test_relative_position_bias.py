"""autodeploy::relative_position_bias and its bucket function against HF's T5Attention; relative_position_bias_by_distance
against it."""

import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim
from transformers import T5Config
from transformers.models.t5.modeling_t5 import T5Attention

from autodeploy.custom_ops import relative_position_bias as bias_module  # registers the op
from autodeploy.custom_ops.relative_position_bias import relative_position_bucket

relative_position_bias = torch.ops.autodeploy.relative_position_bias
hf_bucket = T5Attention._relative_position_bucket

BUCKET_SETTINGS = [(32, 128), (8, 20), (32, 20), (8, 128)]  # (num_buckets, max_distance)


def _edge_positions(num_buckets: int, max_distance: int) -> torch.Tensor:
    max_exact = num_buckets // 4  # the bidirectional one; the one-sided one (num_buckets // 2) is listed too
    distances = {0, 1, 2, max_exact - 1, max_exact, max_exact + 1, num_buckets // 2 - 1, num_buckets // 2,
                 max_distance - 1, max_distance, max_distance + 1, 2 * max_distance, 10**6, 2**31 - 1}
    return torch.tensor(sorted({sign * d for d in distances for sign in (1, -1)}))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), BUCKET_SETTINGS)
def test_bucket_equals_hf_at_the_edges(bidirectional, num_buckets, max_distance):
    positions = _edge_positions(num_buckets, max_distance)
    expected = hf_bucket(positions, bidirectional, num_buckets, max_distance)
    got = relative_position_bucket(positions, bidirectional, num_buckets, max_distance)
    assert got.dtype == torch.long
    assert got.tolist() == expected.tolist()


@settings(max_examples=60, deadline=None)
@given(
    relative_positions=st.lists(st.integers(-(10**5), 10**5), min_size=1, max_size=64),
    bidirectional=st.booleans(),
    num_buckets=st.integers(4, 64),
    extra_distance=st.integers(1, 300),
    int32=st.booleans(),
)
def test_bucket_equals_hf_and_stays_in_range(relative_positions, bidirectional, num_buckets, extra_distance, int32):
    max_distance = (num_buckets // 2 if bidirectional else num_buckets) // 2 + extra_distance
    positions = torch.tensor(relative_positions, dtype=torch.int32 if int32 else torch.long)
    got = relative_position_bucket(positions, bidirectional, num_buckets, max_distance)
    assert got.tolist() == hf_bucket(positions, bidirectional, num_buckets, max_distance).tolist()
    assert 0 <= got.min() and got.max() < num_buckets


def test_bucket_docstring_example():
    results = doctest.testmod(bias_module)
    assert results.attempted > 0 and results.failed == 0


@pytest.mark.parametrize(("num_buckets", "bidirectional", "max_distance"), [(3, True, 128), (1, False, 128), (32, True, 8)])
def test_bucket_rejects_parameters_without_log_buckets(num_buckets, bidirectional, max_distance):
    with pytest.raises(ValueError, match="T5 uses 32 and 128"):
        relative_position_bucket(torch.arange(4), bidirectional, num_buckets, max_distance)


def _t5_attention(is_decoder: bool, num_buckets: int, max_distance: int) -> T5Attention:
    config = T5Config(d_model=16, d_kv=4, num_heads=3, relative_attention_num_buckets=num_buckets,
                      relative_attention_max_distance=max_distance, is_decoder=is_decoder)
    torch.manual_seed(0)
    attention = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    torch.nn.init.normal_(attention.relative_attention_bias.weight)
    return attention


@pytest.mark.parametrize("is_decoder", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20)])
@pytest.mark.parametrize(
    ("query_length", "key_length", "past_seen_tokens"),
    [(7, 7, 0), (1, 1, 0), (300, 300, 0), (1, 40, 39), (5, 150, 145)],
    ids=["prefill", "one token", "beyond max_distance", "decode step", "chunk after a long past"],
)
def test_op_equals_hf_compute_bias(is_decoder, num_buckets, max_distance, query_length, key_length, past_seen_tokens):
    attention = _t5_attention(is_decoder, num_buckets, max_distance)
    with torch.no_grad():
        expected = attention.compute_bias(query_length, key_length, past_seen_tokens=past_seen_tokens)
        got = relative_position_bias(
            attention.relative_attention_bias.weight,
            torch.arange(query_length) + past_seen_tokens,
            torch.arange(key_length),
            not is_decoder,
            max_distance,
        )
    assert got.shape == (1, 3, query_length, key_length)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_op_reads_int32_positions_and_keeps_the_table_dtype():
    table = torch.randn(32, 4).to(torch.bfloat16)
    positions = torch.arange(9, dtype=torch.int32)
    out = relative_position_bias(table, positions, positions, False, 128)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, relative_position_bias(table, positions.long(), positions.long(), False, 128),
                               rtol=0, atol=0)


@pytest.mark.parametrize(
    ("table", "query_positions", "match"),
    [(torch.randn(32), torch.arange(3), "table must be"), (torch.randn(32, 2), torch.arange(3.0), "query_positions")],
)
def test_op_rejects_malformed_inputs(table, query_positions, match):
    with pytest.raises(ValueError, match=match):
        relative_position_bias(table, query_positions, torch.arange(3), True, 128)


def test_fake_gives_shape_and_dtype():
    with FakeTensorMode() as mode:
        out = relative_position_bias(mode.from_tensor(torch.randn(32, 6).half()), mode.from_tensor(torch.arange(5)),
                                     mode.from_tensor(torch.arange(11)), True, 128)
    assert (out.shape, out.dtype) == ((1, 6, 5, 11), torch.float16)


def test_opcheck():
    torch.library.opcheck(relative_position_bias, (torch.randn(32, 3), torch.arange(4) + 6, torch.arange(10), False, 128))


class _Bias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(32, 3)

    def forward(self, query_positions, key_positions):
        return relative_position_bias(self.table.weight, query_positions, key_positions, True, 128)


def test_exports_with_dynamic_query_and_key_lengths():
    module = _Bias()
    exported = torch.export.export(
        module, (torch.arange(4), torch.arange(6)),
        dynamic_shapes=({0: Dim("query_length")}, {0: Dim("key_length")}),
    )
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.autodeploy.relative_position_bias.default]
    query_positions, key_positions = torch.arange(3) + 17, torch.arange(20)
    torch.testing.assert_close(exported.module()(query_positions, key_positions),
                               module(query_positions, key_positions), rtol=0, atol=0)


by_distance = torch.ops.autodeploy.relative_position_bias_by_distance


@settings(max_examples=40, deadline=None)
@given(
    bidirectional=st.booleans(),
    num_buckets=st.integers(4, 40),
    extra_distance=st.integers(1, 200),
    length=st.integers(1, 300),
    query=st.integers(0, 299),
)
def test_by_distance_is_the_bias_of_every_key_at_or_before_its_query(bidirectional, num_buckets, extra_distance, length, query):
    """Row ``h``, column ``d``: what ``relative_position_bias`` gives a query at any position and the key ``d`` before it,
    exactly (T5's decoder sees only those keys)."""
    max_distance = (num_buckets // 2 if bidirectional else num_buckets) // 2 + extra_distance
    table = torch.randn(num_buckets, 3, generator=torch.Generator().manual_seed(length))
    rows = by_distance(table, length, bidirectional, max_distance)
    query = query % length
    dense = relative_position_bias(table, torch.tensor([query]), torch.arange(query + 1), bidirectional, max_distance)
    assert rows.shape == (3, length)
    torch.testing.assert_close(rows[:, : query + 1].flip(-1), dense[0, :, 0], rtol=0, atol=0)


def test_by_distance_fake_opcheck_and_refusals():
    with FakeTensorMode() as mode:
        out = by_distance(mode.from_tensor(torch.randn(32, 6).half()), 50, False, 128)
    assert (out.shape, out.dtype) == ((6, 50), torch.float16)
    torch.library.opcheck(by_distance, (torch.randn(32, 3), 20, False, 128))
    with pytest.raises(ValueError, match=r"table must be \[num_buckets, H\] and length ≥ 1; got \(32, 3\) and 0"):
        by_distance(torch.randn(32, 3), 0, False, 128)
