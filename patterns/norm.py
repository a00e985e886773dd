"""Norm family: RMSNorm and LayerNorm spellings → ``autodeploy.rms_norm`` / ``autodeploy.layer_norm``.

What Hugging Face (5.17) norms export to after the cleanup stage; ``?`` marks casts that exist only
in bfloat16/float16 models (in float32 they are no-ops and cleanup removes them)::

    Llama, Mistral, Qwen2, Qwen3 (also its per-head q/k norms on [B, S, H, D]), Mixtral, Phi-3:
        h = to(x, f32)?;  h = h * rsqrt(mean(pow(h, 2), [-1], True) + eps);  out = weight * to(h, x.dtype)?
    T5 (T5LayerNorm: x itself times the float32 rsqrt, which promotes it):
        h = x * rsqrt(mean(pow(to(x, f32)?, 2), [-1], True) + eps);  out = weight * to(h, weight.dtype)?
    Gemma, Gemma-2 (the weight is stored as w - 1):
        h = to(x, f32)?;  h = h * rsqrt(mean(pow(h, 2), [-1], True) + eps);  out = type_as(h * (to(weight, f32)? + 1.0), x)
    nn.LayerNorm (GPT-NeoX, ...):   layer_norm(x, [H], weight?, bias?, eps, False)   (one pattern per None)
    decomposed graphs:              getitem(native_layer_norm(x, [H], weight, bias, eps), 0)

``rms_norm`` multiplies by the weight in float32 and rounds once (Gemma's order); Llama rounds the
normalised value to x's dtype first, so in bfloat16 the two may differ by one ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match
from torch.fx.experimental.symbolic_shapes import statically_known_true

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.*)
from autodeploy.patterns.registry import register_pattern

# Example values of the scalar parameters, distinct from every other literal in the traced graphs so
# the matcher can tell them apart; any eps and hidden size then match.
_EPS = {"eps": 1.2345e-7}
_EPS_AND_WIDTH = {"eps": 1.2345e-7, "hidden_size": 8}


def _weight_fits(match: Match) -> bool:
    """The norm weight is a vector over x's last dim (the ops' ``weight[H]`` contract)."""
    x, weight = match.kwargs["x"].meta["val"], match.kwargs["weight"].meta["val"]
    return weight.dim() == 1 and statically_known_true(weight.shape[0] == x.shape[-1])


def rms_norm_gemma(x, weight, eps):
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + weight.float())
    return out.type_as(x)


def rms_norm_gemma_replacement(x, weight, eps):
    return torch.ops.autodeploy.rms_norm(x, weight, eps, 1.0)


def rms_norm_llama(x, weight, eps):
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(input_dtype)


def rms_norm_replacement(x, weight, eps):
    return torch.ops.autodeploy.rms_norm(x, weight, eps)


def rms_norm_t5(x, weight, eps):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(weight.dtype)


def layer_norm(x, weight, bias, eps, hidden_size):
    return F.layer_norm(x, [hidden_size], weight, bias, eps)


def layer_norm_replacement(x, weight, bias, eps, hidden_size):
    return torch.ops.autodeploy.layer_norm(x, weight, bias, eps)


def layer_norm_no_bias(x, weight, eps, hidden_size):
    return F.layer_norm(x, [hidden_size], weight, None, eps)


def layer_norm_no_bias_replacement(x, weight, eps, hidden_size):
    return torch.ops.autodeploy.layer_norm(x, weight, None, eps)


def layer_norm_no_affine(x, eps, hidden_size):
    return F.layer_norm(x, [hidden_size], None, None, eps)


def layer_norm_no_affine_replacement(x, eps, hidden_size):
    return torch.ops.autodeploy.layer_norm(x, None, None, eps)


def native_layer_norm(x, weight, bias, eps, hidden_size):
    return torch.native_layer_norm(x, [hidden_size], weight, bias, eps)[0]


_x, _vector = torch.empty(2, 3, 8), torch.empty(8)  # 8: the example hidden size in _EPS_AND_WIDTH

# Gemma's spelling first: its last multiply also fits Llama's `weight * h` with weight := (w + 1).
register_pattern("rms_norm_gemma", rms_norm_gemma, rms_norm_gemma_replacement, [_x, _vector],
                 family="norm", scalar_workaround=_EPS, extra_check=_weight_fits)
register_pattern("rms_norm_llama", rms_norm_llama, rms_norm_replacement, [_x, _vector],
                 family="norm", scalar_workaround=_EPS, extra_check=_weight_fits)
# In float32 T5's spelling is Llama's (no casts), which matches it first.
register_pattern("rms_norm_t5", rms_norm_t5, rms_norm_replacement, [_x, _vector],
                 family="norm", scalar_workaround=_EPS, extra_check=_weight_fits)
register_pattern("layer_norm", layer_norm, layer_norm_replacement, [_x, _vector, _vector],
                 family="norm", scalar_workaround=_EPS_AND_WIDTH)
register_pattern("layer_norm_no_bias", layer_norm_no_bias, layer_norm_no_bias_replacement, [_x, _vector],
                 family="norm", scalar_workaround=_EPS_AND_WIDTH)
register_pattern("layer_norm_no_affine", layer_norm_no_affine, layer_norm_no_affine_replacement, [_x],
                 family="norm", scalar_workaround=_EPS_AND_WIDTH)
register_pattern("native_layer_norm", native_layer_norm, layer_norm_replacement, [_x, _vector, _vector],
                 family="norm", scalar_workaround=_EPS_AND_WIDTH)
