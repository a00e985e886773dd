"""T5's ``compute_bias`` subgraph becomes one ``autodeploy.relative_position_bias`` per stack, with the table,
direction and ``max_distance`` Hugging Face's config gave it, and the stack's outputs stay the same; a bucket
formula that is not T5's, or T5's with parameters the graph does not prove, is left as exported."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Attention

from autodeploy import pipeline
from autodeploy.export.export import ExportConfig, export_to_graph_module
from autodeploy.patterns.relative_position_bias import replace_relative_position_bias
from autodeploy.patterns.registry import select_patterns
from autodeploy.transforms import TransformContext
from autodeploy.transforms.match_patterns import MatchPatterns, MatchPatternsConfig
from tests.transforms.cleanup_harness import CLEANUP_PASSES, call_targets, run_transform

BIAS = torch.ops.autodeploy.relative_position_bias.default
# What _relative_position_bucket exports to: none of it may survive the match.
BUCKET_OPS = ("aten.log.default", "aten.abs.default", "aten.neg.default", "aten.full_like.default", "aten.where.self",
              "aten.lt.Scalar", "aten.gt.Scalar", "aten.min.other", "aten.zeros_like.default", "aten.permute.default")
TINY = dict(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, decoder_start_token_id=0)
CONFIGS = {
    "t5-v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),  # 32 buckets, max_distance 128
    # Flan-T5's kind, with buckets small enough that 64 tokens reach the logarithmic and the last buckets.
    "t5-v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=16,
                    relative_attention_max_distance=24),
}
LENGTHS = [(1, 1, 1), (2, 9, 5), (3, 64, 40)]  # batch, decoder (or encoder) tokens, encoder tokens


def _tiny_t5(version: str, attn_implementation: str = "sdpa") -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(**TINY, **CONFIGS[version], attn_implementation=attn_implementation)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF's initialisation gives the table a small spread: make every bucket count
        for module in model.modules():
            if isinstance(module, T5Attention) and module.has_relative_attention_bias:
                module.relative_attention_bias.weight.normal_()
    return model


class _StackOutput(nn.Module):
    """A T5 stack's last hidden state: the encoder's of ``input_ids``, the decoder's also reading the encoder's states."""

    def __init__(self, stack: nn.Module):
        super().__init__()
        self.stack = stack

    def forward(self, input_ids, encoder_hidden_states=None):
        return self.stack(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states).last_hidden_state


def _stack_inputs(model, stack: str, batch: int, tokens: int, encoder_tokens: int, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=generator)
    if stack == "encoder":
        return (input_ids,)
    return input_ids, torch.randn(batch, encoder_tokens, model.config.d_model, generator=generator)


def _exported_stack(model, stack: str):
    """What the pipeline hands the match stage: one stack exported with dynamic dims and the default patches, cleaned up."""
    batch, tokens, encoder_tokens = (torch.export.Dim.DYNAMIC(min=1, max=64) for _ in range(3))
    dynamic = ({0: batch, 1: tokens},) if stack == "encoder" else ({0: batch, 1: tokens}, {0: batch, 1: encoder_tokens})
    example = _stack_inputs(model, stack, 2, 5, 4)
    example = tuple(t.to(next(model.parameters()).device) for t in example)
    gm = export_to_graph_module(_StackOutput(getattr(model, stack)), example, dynamic, ExportConfig().patches)
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    return gm


def _match_bias(gm):
    """The match stage with this pattern alone (its upkeep included: dead-code elimination, recompile)."""
    transform = MatchPatterns(MatchPatternsConfig(patterns=["relative_position_bias"]))
    return pipeline.run_transform(transform, gm, TransformContext(settings=None))


def _the_bias(gm) -> torch.fx.Node:
    (node,) = gm.graph.find_nodes(op="call_function", target=BIAS)
    return node


def _assert_same_outputs(before, after, inputs_at, hugging_face=None) -> None:
    """``after`` gives exactly ``before``'s outputs (and Hugging Face's, to float tolerance) at every length."""
    for batch, tokens, encoder_tokens in LENGTHS:
        inputs = inputs_at(batch, tokens, encoder_tokens)
        with torch.no_grad():
            out = after(*inputs)
            torch.testing.assert_close(out, before(*inputs), rtol=0, atol=0)
            if hugging_face is not None:
                torch.testing.assert_close(out, hugging_face(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("version", list(CONFIGS))
@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_each_stack_computes_its_bias_once_with_the_configs_parameters(version, stack):
    model = _tiny_t5(version)
    gm = _exported_stack(model, stack)
    before = copy.deepcopy(gm)
    # HF's ``relative_buckets += …``: in place in the encoder (so cleanup keeps its ``x + 0`` steps), not in the decoder.
    assert call_targets(gm)["aten.add_.Tensor"] == (stack == "encoder")

    result = _match_bias(gm)

    assert result.matches == 1 and result.notes == "relative_position_bias×1"
    ops = call_targets(gm)
    assert ops["autodeploy.relative_position_bias.default"] == 1
    assert not [op for op in BUCKET_OPS if ops[op]], "bucket arithmetic survived"
    assert ops["aten.embedding.default"] == 1  # the token embedding's
    bias = _the_bias(gm)
    table, query_positions, key_positions, bidirectional, max_distance = bias.args
    layer_0 = getattr(model, stack).block[0].layer[0].SelfAttention
    assert torch.equal(gm.get_parameter(table.target), layer_0.relative_attention_bias.weight)
    assert (bidirectional, max_distance) == (stack == "encoder", model.config.relative_attention_max_distance)
    assert query_positions.target is key_positions.target is torch.ops.aten.arange.default
    assert len(bias.users) == model.config.num_layers  # every layer's self-attention reads the first layer's bias
    _assert_same_outputs(before, gm, lambda *lengths: _stack_inputs(model, stack, *lengths, seed=sum(lengths)),
                         hugging_face=_StackOutput(getattr(model, stack)))


def test_eager_attention_adds_the_same_bias():
    model = _tiny_t5("t5-v1.0", attn_implementation="eager")
    gm = _exported_stack(model, "decoder")
    before = copy.deepcopy(gm)

    assert _match_bias(gm).matches == 1
    assert _the_bias(gm).args[3:] == (False, 128)
    _assert_same_outputs(before, gm, lambda *lengths: _stack_inputs(model, "decoder", *lengths))


def test_a_meta_device_bfloat16_stack_matches():
    """What the pipeline exports on a GPU: the model on the meta device, in bfloat16."""
    model = _tiny_t5("t5-v1.1").to(device="meta", dtype=torch.bfloat16)
    gm = _exported_stack(model, "encoder")

    assert _match_bias(gm).matches == 1
    bias = _the_bias(gm)
    assert bias.args[3:] == (True, 24)
    assert bias.meta["val"].dtype == torch.bfloat16 and bias.meta["val"].shape[:2] == (1, model.config.num_heads)


def test_registered_in_the_attention_family():
    assert "relative_position_bias" in {pattern.name for pattern in select_patterns(["attention"])}


# ------------------------------------------------------------- biases written by hand: T5's and others


def _bucket(relative_position, bidirectional, num_buckets, max_distance, float_dtype=torch.float32, divisor=None):
    """HF's ``_relative_position_bucket`` with knobs: the log's dtype and its divisor."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    divisor = math.log(max_distance / max_exact) if divisor is None else divisor
    large = max_exact + (torch.log(relative_position.to(float_dtype) / max_exact) / divisor * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return relative_buckets + torch.where(relative_position < max_exact, relative_position, large)


class _HandWrittenBias(nn.Module):
    """``table[bucket(distance), h]`` as compute_bias lays it out, ``[1, H, Sq, Sk]``, over given positions."""

    def __init__(self, rows: int, bucket, query_minus_key: bool = False, past: bool = False):
        super().__init__()
        self.table = nn.Embedding(rows, 3)
        self.bucket, self.query_minus_key, self.past = bucket, query_minus_key, past

    def forward(self, query_positions, key_positions):
        queries = query_positions[:, None] + (key_positions.shape[0] - query_positions.shape[0] if self.past else 0)
        keys = key_positions[None, :]
        distance = queries - keys if self.query_minus_key else keys - queries
        return self.table(self.bucket(distance)).permute([2, 0, 1]).unsqueeze(0)


def _exported_bias(module: nn.Module):
    torch.manual_seed(0)
    nn.init.normal_(module.table.weight)
    queries, keys = torch.export.Dim.DYNAMIC(min=1, max=512), torch.export.Dim.DYNAMIC(min=1, max=512)
    gm = export_to_graph_module(module, (torch.arange(3), torch.arange(5)), ({0: queries}, {0: keys}))
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    return gm


@pytest.mark.parametrize(
    ("rows", "bidirectional", "max_distance", "past"),
    [(32, True, 128, False), (16, False, 40, False), (8, True, 20, True), (12, False, 9, True)],
    ids=["t5 encoder", "one-sided", "after a past", "one-sided after a past"],
)
def test_t5s_formula_matches_with_the_parameters_it_computes_with(rows, bidirectional, max_distance, past):
    module = _HandWrittenBias(rows, lambda d: _bucket(d, bidirectional, rows, max_distance), past=past)
    gm = _exported_bias(module)

    assert replace_relative_position_bias(gm) == 1
    assert _the_bias(gm).args[3:] == (bidirectional, max_distance)
    gm.graph.eliminate_dead_code()
    generator = torch.Generator().manual_seed(rows)
    for queries, keys in [(1, 1), (7, 7), (5, 300), (300, 300)]:
        query_positions = torch.randint(-400, 400, (queries,), generator=generator)
        key_positions = torch.randint(-400, 400, (keys,), generator=generator)
        with torch.no_grad():
            torch.testing.assert_close(gm(query_positions, key_positions), module(query_positions, key_positions),
                                       rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rows", "bucket", "query_minus_key"),
    [
        (64, lambda d: _bucket(d, True, 32, 128), False),  # the literals bucket for a 32-row table
        (32, lambda d: _bucket(d, True, 32, 128, float_dtype=torch.float64), False),  # another log precision
        (32, lambda d: _bucket(d, True, 32, 128, divisor=math.log(16) * 1.001), False),  # no integer max_distance
        (32, lambda d: _bucket(d, True, 32, 128), True),  # query − key: the mirror image
        (15, lambda d: d.clamp(-7, 7) + 7, False),  # a clipped-distance bias (not T5's)
    ],
    ids=["table rows", "float64 log", "divisor", "query minus key", "clipped distance"],
)
def test_other_bucket_formulas_are_left_as_exported(rows, bucket, query_minus_key):
    gm = _exported_bias(_HandWrittenBias(rows, bucket, query_minus_key=query_minus_key))
    before = gm.graph.python_code("self").src

    assert replace_relative_position_bias(gm) == 0
    assert gm.graph.python_code("self").src == before
