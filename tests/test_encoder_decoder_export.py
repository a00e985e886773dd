"""The two functions an encoder–decoder checkpoint is exported as (``export/encoder_decoder.py``), on tiny random
BART, mBART and T5 (v1.0 and v1.1): the encoder's cross keys and values fed to the decoder give Hugging Face's logits,
positions are the ones given, both export with their dims dynamic, the match and cache stages keep HF's logits (T5's
relative position bias an input of the attention ops), and other encoder–decoders are refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import BartConfig, GPT2Config, LongT5Config, T5Config, UMT5Config

from autodeploy.errors import UnsupportedModelError
from autodeploy.export.encoder_decoder import EncoderCrossKV, EncoderDecoderLogits
from autodeploy.export.export import export_to_graph_module
from autodeploy.models.encoder_decoder import cross_attentions, encoder_decoder_spec
from tests.tiny_seq2seq_models import TINY, TINY_T5, TINY_T5_V1_1, tiny

KINDS = ["bart", "mbart", "t5", "t5_v1_1"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_decoder_reading_the_encoders_cross_keys_and_values_gives_hugging_faces_logits(kind):
    model = tiny(kind)
    spec = encoder_decoder_spec(model.config)
    source = torch.randint(3, 512, (2, 11))
    target = torch.randint(3, 512, (2, 7))
    with torch.no_grad():
        expected = model(input_ids=source, decoder_input_ids=target).logits
        keys, values = EncoderCrossKV(model, spec)(source)
        assert keys.shape == values.shape == (2, 2, 11, 4, 8)  # [layers, B, S, heads, head_dim]
        logits = EncoderDecoderLogits(model, spec)(target, torch.arange(7).expand(2, 7), keys, values)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    patched = [*cross_attentions(model, spec), getattr(model.get_decoder(), "embed_positions", None)]
    assert not any("forward" in vars(module) for module in patched if module is not None)  # HF's modules are as they were


def test_the_decoders_positions_are_the_ones_given():
    """A decoder token at position 5 is embedded as position 5 though it is the graph's first token: the served graph
    takes many sequences' tokens in one row. Its logits are those of HF's sixth token when the five before it are
    masked out of its attention — here simply checked against the same token placed sixth with its own prefix."""
    model = tiny("bart", seed=1)
    spec = encoder_decoder_spec(model.config)
    source = torch.randint(3, 512, (1, 9))
    target = torch.randint(3, 512, (1, 6))
    with torch.no_grad():
        keys, values = EncoderCrossKV(model, spec)(source)
        logits = EncoderDecoderLogits(model, spec)
        at_start = logits(target[:, :1], torch.tensor([[0]]), keys, values)
        at_five = logits(target[:, :1], torch.tensor([[5]]), keys, values)
        expected = model(input_ids=source, decoder_input_ids=target[:, :1]).logits
    torch.testing.assert_close(at_start, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(at_five, at_start)


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_both_functions_export_with_their_dims_dynamic(kind):
    model = tiny(kind)
    spec = encoder_decoder_spec(model.config)
    batch, length, tokens = (torch.export.Dim.DYNAMIC(min=1, max=64) for _ in range(3))
    encoder = export_to_graph_module(EncoderCrossKV(model, spec), (torch.randint(3, 512, (2, 5)),), ({0: batch, 1: length},))
    source = torch.randint(3, 512, (1, 13))
    keys, values = encoder(source)
    assert keys.shape == (2, 1, 13, 4, 8)
    ids, positions = torch.randint(3, 512, (2, 4)), torch.arange(4).expand(2, 4)
    decoder = export_to_graph_module(EncoderDecoderLogits(model, spec), (ids, positions, *EncoderCrossKV(model, spec)(torch.randint(3, 512, (2, 5)))),
                                     ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {1: batch, 2: length}, {1: batch, 2: length}))
    target = torch.randint(3, 512, (1, 3))
    with torch.no_grad():
        expected = model(input_ids=source, decoder_input_ids=target).logits
    torch.testing.assert_close(decoder(target, torch.arange(3)[None], keys, values), expected, rtol=1e-5, atol=1e-5)


def test_which_configs_are_encoder_decoders_autodeploy_exports():
    spec = encoder_decoder_spec(BartConfig(**TINY))
    assert (spec.model_type, spec.decoder_start_token_id, spec.num_layers, spec.num_heads, spec.head_dim) == ("bart", 2, 2, 4, 8)
    assert encoder_decoder_spec(GPT2Config()) is None
    t5 = encoder_decoder_spec(T5Config(**TINY_T5))
    assert (t5.decoder_start_token_id, t5.num_layers, t5.num_heads, t5.head_dim, t5.output_scale) == (0, 2, 4, 8, 32**-0.5)
    assert encoder_decoder_spec(T5Config(**TINY_T5_V1_1)).output_scale is None  # v1.1: an untied head, no scaling
    with pytest.raises(UnsupportedModelError, match=r"UMT5Config \(umt5\) is an encoder-decoder model; .*a table in every layer"):
        encoder_decoder_spec(UMT5Config(decoder_start_token_id=0), "umt5-small")
    with pytest.raises(UnsupportedModelError, match=r"LongT5Config \(longt5\) .*local and transient-global attention"):
        encoder_decoder_spec(LongT5Config(decoder_start_token_id=0))
    with pytest.raises(UnsupportedModelError, match="no decoder_start_token_id"):
        encoder_decoder_spec(BartConfig(**{**TINY, "decoder_start_token_id": None}))


CLEANUP = ("cleanup_noop", "cleanup_transposes", "cleanup_dead_code")


def exported(kind: str, seed: int):
    """The tiny model, its spec, and its encoder and decoder graphs as the export stage makes them (dims dynamic)."""
    from autodeploy.export.export import ExportConfig

    model = tiny(kind, seed=seed)
    spec = encoder_decoder_spec(model.config)
    patches = ExportConfig().patches
    batch, length, tokens = (torch.export.Dim.DYNAMIC(min=1, max=64) for _ in range(3))
    encoder = export_to_graph_module(EncoderCrossKV(model, spec), (torch.randint(3, 512, (2, 5)),), ({0: batch, 1: length},), patches)
    keys, values = EncoderCrossKV(model, spec)(torch.randint(3, 512, (2, 5)))
    decoder = export_to_graph_module(EncoderDecoderLogits(model, spec), (torch.randint(3, 512, (2, 4)), torch.arange(4).expand(2, 4), keys, values),
                                     ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {1: batch, 2: length}, {1: batch, 2: length}), patches)
    return model, spec, encoder, decoder


def through(gm, names: tuple[str, ...], context=None):
    """``gm`` after the transforms ``names`` (their default configs), and the build context they ran in."""
    from autodeploy import pipeline
    from autodeploy.config import load_settings
    from autodeploy.transforms.registry import TransformContext, get_transform_class

    context = context or TransformContext(settings=load_settings(set_arguments=["device=cpu", "dtype=float32", "max_seq_len=64"]))
    for name in names:
        transform_class = get_transform_class(name)
        gm = pipeline.run_transform(transform_class(transform_class.config_class()), gm, context).module or gm
    return gm, context


@pytest.mark.parametrize("kind", KINDS)
def test_the_match_stage_finds_every_attention_of_both_graphs_and_they_still_compute_hf_logits(kind):
    """The encoder's self-attention (HF hands SDPA a mask that hides nothing) becomes ``bidirectional_attention``; the
    decoder's becomes the causal ``attention``; its cross-attention is ``bidirectional_attention`` from export on. T5's
    relative position bias (one a stack, HF folds it into the SDPA mask) is one ``relative_position_bias`` that every
    self-attention of its stack takes as its ``bias``; its norms and MLPs (ReLU, gated ``gelu_new``) match too."""
    model, _, encoder, decoder = exported(kind, seed=2)
    ops = torch.ops.autodeploy
    biases = 1 if kind.startswith("t5") else 0
    mlps = {ops.gated_mlp.default if kind == "t5_v1_1" else ops.mlp.default: 2} if biases else {}
    graphs = []
    for graph, expected in ((encoder, {ops.bidirectional_attention.default: 2, ops.relative_position_bias.default: biases, **mlps}),
                            (decoder, {ops.bidirectional_attention.default: 2, ops.attention.default: 2,
                                       ops.relative_position_bias.default: biases, **mlps})):
        self_attention = ops.bidirectional_attention.default if graph is encoder else ops.attention.default
        graph, _ = through(graph, (*CLEANUP, "match_patterns"))
        targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
        assert {target: targets.count(target) for target in expected} == expected
        assert torch.ops.aten.scaled_dot_product_attention.default not in targets
        for node in graph.graph.find_nodes(op="call_function", target=self_attention):
            bias = dict(zip((a.name for a in self_attention._schema.arguments), node.args)).get("bias")
            assert getattr(bias, "target", None) == (ops.relative_position_bias.default if biases else None)
        graphs.append(graph)
    source, target = torch.randint(3, 512, (1, 10)), torch.randint(3, 512, (1, 4))
    with torch.no_grad():
        expected_logits = model(input_ids=source, decoder_input_ids=target).logits
        logits = graphs[1](target, torch.arange(4)[None], *graphs[0](source))
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)


def served_decoder(kind: str, seed: int):
    """The tiny model's decoder graph through cleanup, match and the cache stage, and its build context."""
    model, spec, _, decoder = exported(kind, seed)
    gm, context = through(decoder, (*CLEANUP, "match_patterns", "match_linear", "insert_cached_attention"))
    return model, spec, gm, context


@pytest.mark.parametrize("kind", ["bart", "t5", "t5_v1_1"])
def test_the_cache_stage_gives_the_decoder_a_cross_cache_per_layer_and_its_steps_give_hf_logits(kind):
    """Two requests (encoder inputs of 9 and 4 tokens) prefill 4 and 3 decoder tokens in one flattened step, then
    decode one token each: every row's logits are HF's for that request at that position. The dense cross inputs
    are gone; each layer reads its cross cache through ``cached_cross_attention``. T5's self-attentions read its
    relative position bias by distance (``[heads, max_seq_len]``, one for both layers) instead of the dense bias."""
    from autodeploy.custom_ops.cached_attention import write_kv_cache

    model, spec, gm, context = served_decoder(kind, seed=3)
    names = context.graph_inputs
    assert "cross_keys" not in names and {"cross_lens", "cross_block_tables", "cross_k_cache_1", "cross_v_cache_1"} <= set(names)
    assert [c.key_input for c in context.cross_kv_caches] == ["cross_k_cache_0", "cross_k_cache_1"]
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.autodeploy.cached_cross_attention.default) == 2
    assert targets.count(torch.ops.autodeploy.cached_attention.default) == 2
    assert torch.ops.autodeploy.bidirectional_attention.default not in targets
    assert torch.ops.autodeploy.relative_position_bias.default not in targets
    by_distance = [n for n in gm.graph.nodes if n.target == torch.ops.autodeploy.relative_position_bias_by_distance.default]
    assert len(by_distance) == (1 if kind.startswith("t5") else 0) and all(n.args[1:3] == (64, False) for n in by_distance)

    block, blocks = 4, 16
    sources = [torch.randint(3, 512, (1, 9)), torch.randint(3, 512, (1, 4))]
    outputs = [torch.randint(3, 512, (1, 5)), torch.randint(3, 512, (1, 4))]  # prefill all but the last, then decode it
    caches = {s.key_input: torch.zeros(blocks, block, s.kv_heads, s.head_dim) for s in (*context.kv_caches, *context.cross_kv_caches)}
    caches |= {s.value_input: torch.zeros(blocks, block, s.kv_heads, s.value_head_dim) for s in (*context.kv_caches, *context.cross_kv_caches)}
    self_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cross_tables = torch.tensor([[7, 5, 9], [11, 0, 0]], dtype=torch.int32)  # scattered blocks
    with torch.no_grad():
        for s, source in enumerate(sources):  # the encoder pass: each layer's keys and values into its cross cache
            keys, values = EncoderCrossKV(model, spec)(source)
            slots = torch.tensor([int(cross_tables[s, p // block]) * block + p % block for p in range(source.shape[1])])
            for layer, cross in enumerate(context.cross_kv_caches):
                write_kv_cache(keys[layer], values[layer], caches[cross.key_input], caches[cross.value_input], slots)
        expected = [model(input_ids=src, decoder_input_ids=out).logits[0] for src, out in zip(sources, outputs)]

        def step(chunks, starts, num_prefill):
            """chunks: each sequence's new tokens; starts: their first position."""
            ids = torch.cat(chunks)[None]
            positions = torch.cat([torch.arange(a, a + len(c)) for c, a in zip(chunks, starts)])[None]
            lengths = [len(c) for c in chunks]
            seq_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            kv_lens = torch.tensor([a + n for a, n in zip(starts, lengths)], dtype=torch.int32)
            slots = torch.cat([torch.tensor([int(self_tables[s, p // block]) * block + p % block for p in range(a, a + n)])
                               for s, (a, n) in enumerate(zip(starts, lengths))])
            inputs = {"input_ids": ids, "position_ids": positions, "seq_start": seq_start, "kv_lens": kv_lens,
                      "block_tables": self_tables, "slot_mapping": slots,
                      "batch_info": torch.tensor([num_prefill, len(chunks) - num_prefill, max(lengths), int(kv_lens.max())], dtype=torch.int32),
                      "logit_index": (seq_start[1:] - 1).long(), "cross_lens": torch.tensor([9, 4], dtype=torch.int32),
                      "cross_block_tables": cross_tables, **caches}
            return gm(*(inputs[name] for name in names))[0]

        prefill = step([outputs[0][0, :4], outputs[1][0, :3]], [0, 0], num_prefill=2)
        torch.testing.assert_close(prefill[0], expected[0][3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(prefill[1], expected[1][2], rtol=1e-5, atol=1e-5)
        decode = step([outputs[0][0, 4:], outputs[1][0, 3:]], [4, 3], num_prefill=0)
        torch.testing.assert_close(decode[0], expected[0][4], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode[1], expected[1][3], rtol=1e-5, atol=1e-5)
