"""The ``invariant`` backends: kernels whose result for a token does not depend on the rest of its step.

``batch_invariant: true`` in the settings selects them for every node (``transforms/select_kernels.py``); a node
of an op with no such backend is refused by name. With them, a token's logits are the same bits in a one-token
decode step, in a step verifying drafted tokens, alone or beside 255 other sequences, in a prompt chunk of any
length — so greedy decoding with speculation is token-identical to decoding without it, in bfloat16 too, and a
request's output does not depend on what else the server was running. The kernels (``triton/batch_invariant.py``)
fix the reduction order per row; the cost is the fast kernels' shape-dependent choices (see there).

Ops and what serves them:

- ``linear``, ``fused_gated_mlp``, ``gated_mlp``, ``mlp``: :func:`invariant_linear` for every GEMM, the
  activations element-wise between them (``gated_activation``'s Triton kernel, torch for ``mlp``'s biased up
  projection's activation).
- ``rms_norm``, ``add_rms_norm``, ``layer_norm``: ``norms.py``'s kernels at one row a program.
- ``cached_attention``, ``cached_attention_rope``: :func:`invariant_attention` (the rope variant rotates q and
  k element-wise first); no sinks, ALiBi or tree drafts.
- Element-wise and copying ops (``ROW_LOCAL_OPS``) keep whatever backend they get: a token's values there never
  meet another's.

The backends are ``opt_in``: only ``batch_invariant`` or an explicit ``backends`` preference selects them, never
the autotuner or the first-supported rule.
"""

from __future__ import annotations

import torch

from . import add_rms_norm, cached_attention, cached_attention_rope, fused_gated_mlp, gated_mlp, layer_norm, linear, mlp, rms_norm  # noqa: F401  (the ops first)
from .activations import activation_fn, unsupported_activation
from .cached_attention import CachedAttentionArgs
from .cached_attention_rope import CachedAttentionRopeArgs, _attention_call
from .registry import register_backend
from .triton import triton_unavailable

BACKEND = "invariant"  # the name of every batch-invariant backend

# Ops whose every backend computes a token's outputs from that token's inputs alone, by element-wise arithmetic
# or copies: any backend of theirs is batch-invariant. Every other op needs an ``invariant`` backend.
ROW_LOCAL_OPS = frozenset({"rope", "gated_activation", "embedding_rows", "embedding_int8", "save_hidden_states",
                           "all_gather", "pipeline_send", "pipeline_recv"})

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unavailable(device: torch.device) -> str | None:
    """Why the batch-invariant kernels cannot run on ``device`` (they are Triton kernels), or None."""
    return triton_unavailable(device)


def _unsupported(device, *tensors) -> str | None:
    reason = unavailable(device)
    if reason:
        return reason
    for tensor in tensors:
        if tensor is not None and tensor.dtype not in _DTYPES:
            return f"the batch-invariant kernels take {', '.join(map(str, _DTYPES))}; got {tensor.dtype}"
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) > 1:
        return f"needs one dtype for activations and weights; got {', '.join(sorted(map(str, dtypes)))}"
    return None


# ---- GEMMs ----------------------------------------------------------------------------------------------
def _linear(x, weight, bias):
    from .triton.batch_invariant import invariant_linear  # on first call: Triton decides then whether to interpret

    return invariant_linear(x, weight, bias)


def _linear_supports(x, weight, bias, *, device):
    return _unsupported(device, x, weight, bias) or True


def _fused_gated_mlp(x, gate_up_weight, down_weight, activation):
    from .triton.batch_invariant import invariant_linear
    from .triton.gated_activation import gated_activation

    gate, up = invariant_linear(x, gate_up_weight, None).chunk(2, dim=-1)
    return invariant_linear(gated_activation(gate, up, activation), down_weight, None)


def _fused_gated_mlp_supports(x, gate_up_weight, down_weight, activation, *, device):
    return _unsupported(device, x, gate_up_weight, down_weight) or unsupported_activation(activation) or True


def _gated_mlp(x, gate_weight, up_weight, down_weight, activation):
    from .triton.batch_invariant import invariant_linear
    from .triton.gated_activation import gated_activation

    gate, up = invariant_linear(x, gate_weight, None), invariant_linear(x, up_weight, None)
    return invariant_linear(gated_activation(gate, up, activation), down_weight, None)


def _gated_mlp_supports(x, gate_weight, up_weight, down_weight, activation, *, device):
    return _unsupported(device, x, gate_weight, up_weight, down_weight) or unsupported_activation(activation) or True


def _mlp(x, up_weight, up_bias, down_weight, down_bias, activation):
    from .triton.batch_invariant import invariant_linear

    hidden = activation_fn(activation)(invariant_linear(x, up_weight, up_bias).float()).to(x.dtype)  # element-wise
    return invariant_linear(hidden, down_weight, down_bias)


def _mlp_supports(x, up_weight, up_bias, down_weight, down_bias, activation, *, device):
    return _unsupported(device, x, up_weight, up_bias, down_weight, down_bias) or unsupported_activation(activation) or True


# ---- norms ----------------------------------------------------------------------------------------------
def _rms_norm(x, weight, eps, weight_offset=0.0):
    from .triton.batch_invariant import NORM_CONFIG
    from .triton.norms import rms_norm_triton

    return rms_norm_triton(x, weight, eps, weight_offset, config=NORM_CONFIG)


def _add_rms_norm(x, residual, weight, eps, weight_offset=0.0):
    from .triton.batch_invariant import NORM_CONFIG
    from .triton.norms import add_rms_norm_triton

    return add_rms_norm_triton(x, residual, weight, eps, weight_offset, config=NORM_CONFIG)


def _layer_norm(x, weight, bias, eps):
    from .triton.batch_invariant import NORM_CONFIG
    from .triton.norms import layer_norm_triton

    return layer_norm_triton(x, weight, bias, eps, config=NORM_CONFIG)


def _norm_supports(x, *tensors, device, **_):
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if x.shape[-1] > 32768:  # norms.MAX_HIDDEN: a whole row is one tile
        return f"rows of {x.shape[-1]} > 32768 values"
    return _unsupported(device, x, *tensors) or True


# ---- attention ------------------------------------------------------------------------------------------
def _attention_unsupported(call, device) -> str | None:
    from .triton.batch_invariant import unsupported_attention

    return _unsupported(device, call.q, call.k, call.v) or unsupported_attention(call)


def _cached_attention(*args, **kwargs):
    from .triton.batch_invariant import invariant_attention

    return invariant_attention(*args, **kwargs)


def _cached_attention_supports(*args, device, **kwargs):
    return _attention_unsupported(CachedAttentionArgs(*args, **kwargs), device) or True


def _cached_attention_rope(*args, **kwargs):
    from .triton.batch_invariant import attend
    from .triton.rope import rope_triton  # element-wise: a token's rotation is its own

    call = CachedAttentionRopeArgs(*args, **kwargs)
    q, k = (rope_triton(x, call.cos, call.sin, call.interleaved) for x in (call.q, call.k))
    return attend(_attention_call(call, q, k))


def _cached_attention_rope_supports(*args, device, **kwargs):
    call = CachedAttentionRopeArgs(*args, **kwargs)
    return _attention_unsupported(_attention_call(call, call.q, call.k), device) or True


for _op, _fn, _supports in (
    ("linear", _linear, _linear_supports),
    ("fused_gated_mlp", _fused_gated_mlp, _fused_gated_mlp_supports),
    ("gated_mlp", _gated_mlp, _gated_mlp_supports),
    ("mlp", _mlp, _mlp_supports),
    ("rms_norm", _rms_norm, _norm_supports),
    ("add_rms_norm", _add_rms_norm, _norm_supports),
    ("layer_norm", _layer_norm, _norm_supports),
    ("cached_attention", _cached_attention, _cached_attention_supports),
    ("cached_attention_rope", _cached_attention_rope, _cached_attention_rope_supports),
):
    register_backend(_op, BACKEND, _fn, supports=_supports, opt_in=True)
