"""The attention and RoPE patterns turn every attention of exported HF models into one
``autodeploy.attention`` and every q/k rotation into one ``autodeploy.rope``, with the options the
config implies (scale, sliding window, soft-cap, sinks), and keep the logits equal to HF eager;
masks that are not causal are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autodeploy.patterns.attention  # noqa: F401  (registers attention_sdpa, attention_eager)
import autodeploy.patterns.rope  # noqa: F401  (registers the rope_* patterns)
import autodeploy.transforms.match_patterns  # noqa: F401  (registers match_patterns)
from autodeploy.export.export import ExportConfig, export_causal_lm, export_to_graph_module
from autodeploy.patterns.attention import replace_sdpa_attention
from tests.logit_comparison import max_logit_diff
from tests.patterns.tiny_family_configs_attention import (
    ATTENTION_IMPLEMENTATIONS,
    SLIDING_WINDOW,
    TINY_CONFIGS,
    VOCAB_SIZE,
    tiny_family_model,
)
from tests.transforms.cleanup_harness import CLEANUP_PASSES, call_targets, run_transform

ATTENTION, ROPE = torch.ops.autodeploy.attention.default, torch.ops.autodeploy.rope.default
SHAPES = [(1, 1, 0), (2, 9, 0), (3, 17, 5)]  # batch, seq, first position; 9 and 17 > SLIDING_WINDOW (6)
# What builds HF's masks from position ids (packed-sequence detection, eager's additive form): dead after matching.
MASK_OPS = ("aten.diff.default", "aten.cumsum.default", "aten.new_ones.default", "aten.where.ScalarOther")

# Qwen2, Qwen3 and Mixtral run Llama's eager_attention_forward verbatim; their eager graphs add nothing.
SAME_EAGER_AS_LLAMA = ("qwen2", "qwen3", "mixtral")
CASES = [
    (arch, implementation)
    for arch in TINY_CONFIGS
    for implementation in ATTENTION_IMPLEMENTATIONS[arch]
    if not (implementation == "eager" and arch in SAME_EAGER_AS_LLAMA)
]


def _exported_and_cleaned(model: nn.Module):
    """What the pipeline hands the match stage: export with the default patches, then the cleanup passes."""
    gm = export_causal_lm(model, max_num_tokens=64, max_seq_len=64, patches=ExportConfig().patches)
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    return gm


def _max_logit_diff(model, gm) -> float:
    return max_logit_diff(model, gm, SHAPES)


def _expected_options(config, layer: int, attn_implementation: str) -> tuple[float, int | None, float | None, bool]:
    """(scale, sliding window, soft-cap, has sinks) of one layer's attention, from the HF config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scale = getattr(config, "query_pre_attn_scalar", head_dim) ** -0.5
    layer_types = getattr(config, "layer_types", None)
    windowed = layer_types[layer] == "sliding_attention" if layer_types else getattr(config, "sliding_window", None)
    window = config.sliding_window if windowed else None
    # HF's SDPA path ignores soft-capping (Gemma-2 built with sdpa does not cap); its eager path caps.
    cap = getattr(config, "attn_logit_softcapping", None) if attn_implementation == "eager" else None
    return scale, window, cap, config.model_type == "gpt_oss"


@pytest.mark.parametrize("arch, attn_implementation", CASES)
def test_attention_and_rope_become_canonical_ops(arch, attn_implementation):
    model = tiny_family_model(arch, attn_implementation)
    layers = model.config.num_hidden_layers
    gm = _exported_and_cleaned(model)

    run_transform("match_patterns", gm)  # every registered family, as the match stage runs them

    ops = call_targets(gm)
    assert ops["autodeploy.attention.default"] == layers
    assert ops["autodeploy.rope.default"] == 2 * layers
    assert ops["aten.scaled_dot_product_attention.default"] == 0
    assert not [op for op in MASK_OPS if ops[op]], "mask-building nodes survived"
    attentions = gm.graph.find_nodes(op="call_function", target=ATTENTION)
    for layer, node in enumerate(attentions):
        scale, window, cap, sinks = node.args[3:7]
        expected = _expected_options(model.config, layer, attn_implementation)
        assert (pytest.approx(scale), window, cap, sinks is not None) == expected
    for rope in gm.graph.find_nodes(op="call_function", target=ROPE):
        assert rope.args[0].meta["val"].dim() == 4 and rope.args[1].meta["val"].dim() == 3
    assert _max_logit_diff(model, gm) <= 1e-5


def test_bfloat16_spellings_match():
    """Half-precision graphs keep the casts float32 graphs lose (Cohere's ``x.float()`` RoPE, eager's
    softmax ``.to(dtype)``); the ops compute in float32, so logits differ from HF only by bf16 rounding."""
    model = tiny_family_model("cohere", "eager").to(torch.bfloat16)
    gm = _exported_and_cleaned(model)

    run_transform("match_patterns", gm)

    ops = call_targets(gm)
    assert ops["autodeploy.attention.default"] == model.config.num_hidden_layers
    assert ops["autodeploy.rope.default"] == 2 * model.config.num_hidden_layers
    assert _max_logit_diff(model, gm) <= 0.1


def test_meta_device_bfloat16_graph_matches():
    """What the pipeline exports on a GPU: SDPA, bfloat16, on the meta device. The masks are still
    evaluated (on the CPU) and understood."""
    model = tiny_family_model("mistral").to(device="meta", dtype=torch.bfloat16)
    gm = _exported_and_cleaned(model)

    run_transform("match_patterns", gm)

    ops = call_targets(gm)
    assert ops["autodeploy.rope.default"] == 2 * model.config.num_hidden_layers
    windows = [node.args[4] for node in gm.graph.find_nodes(op="call_function", target=ATTENTION)]
    assert windows == [SLIDING_WINDOW] * model.config.num_hidden_layers


class MaskedAttention(nn.Module):
    """One SDPA over embedded tokens, 4 query and 2 kv heads, with a mask built from index comparisons as
    HF builds its masks: boolean, or additive (0 / finfo.min); ``None`` uses ``is_causal=True``."""

    def __init__(self, allowed, additive: bool = False, enable_gqa: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, 128)
        self.allowed, self.additive, self.enable_gqa = allowed, additive, enable_gqa

    def forward(self, input_ids, position_ids):
        batch, seq = input_ids.shape
        q, k, v = self.embed(input_ids).view(batch, seq, 8, 16).transpose(1, 2).split([4, 2, 2], dim=1)
        if not self.enable_gqa:  # HF's repeat_kv
            k, v = (t[:, :, None].expand(batch, 2, 2, seq, 16).reshape(batch, 4, seq, 16) for t in (k, v))
        mask = None
        if self.allowed is not None:
            index = torch.arange(seq, device=input_ids.device)
            mask = self.allowed(index[:, None], index[None, :])[None, None]
            if self.additive:
                mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.enable_gqa
        )
        return out.transpose(1, 2).reshape(batch, seq, 64)


MASKS = {  # name: (allowed(query, key), expected sliding window or "unmatched")
    "causal": (lambda q, k: k <= q, None),
    "causal_window_40": (lambda q, k: (k <= q) & (k > q - 40), 40),  # decided by a 42-token probe
    "causal_window_beyond_max_seq": (lambda q, k: (k <= q) & (k > q - 100), None),  # no sequence reaches it
    "is_causal_without_mask": (None, None),
    "bidirectional": (lambda q, k: k >= 0, "bidirectional"),  # hides nothing: an encoder's, bidirectional_attention
    "causal_plus_one": (lambda q, k: k <= q + 1, "unmatched"),
    "window_only_from_query_32": (lambda q, k: (k <= q) & ((k > q - 4) | (q < 32)), "unmatched"),
}


MASK_CASES = [(name, False, False) for name in MASKS] + [
    (name, True, True) for name in ("causal", "causal_window_40", "bidirectional")  # additive masks, enable_gqa
]


@pytest.mark.parametrize("name, additive, enable_gqa", MASK_CASES)
def test_mask_analysis_decides_causality_and_window(name, additive, enable_gqa):
    allowed, expected = MASKS[name]
    module = MaskedAttention(allowed, additive, enable_gqa).eval()
    seq = torch.export.Dim.DYNAMIC(min=2, max=64)  # a named Dim trips torch 2.11 on repeat_kv's reshape
    example = (torch.zeros(2, 4, dtype=torch.long), torch.arange(4).expand(2, 4))
    gm = export_to_graph_module(module, example, dynamic_shapes=({1: seq}, {1: seq}))

    replaced = replace_sdpa_attention(gm)

    if expected == "unmatched":
        assert replaced == 0
        return
    assert replaced == 1
    if expected == "bidirectional":
        (node,) = gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.bidirectional_attention.default)
    else:
        (node,) = gm.graph.find_nodes(op="call_function", target=ATTENTION)
        assert node.args[4] == expected
    assert node.args[1].meta["val"].shape[2] == 2  # k keeps its 2 kv heads: repeat_kv is gone
    gm.graph.eliminate_dead_code()
    gm.recompile()
    input_ids = torch.randint(0, VOCAB_SIZE, (2, 50))
    positions = torch.arange(50).expand(2, 50)
    with torch.no_grad():
        assert torch.allclose(gm(input_ids, positions), module(input_ids, positions), atol=1e-6)
