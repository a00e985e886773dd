"""RoPE family: every rotary-embedding spelling of HF models → ``torch.ops.autodeploy.rope``.

HF models rotate q and k in the ``[B, H, S, D]`` layout, with ``cos``/``sin`` of shape ``[B, S, R]``
unsqueezed at dim 1 (``apply_rotary_pos_emb(..., unsqueeze_dim=1)``). What Hugging Face (5.17) exports
after the cleanup stage, per spelling (``c = unsqueeze(cos, 1)``, ``s = unsqueeze(sin, 1)``)::

    rotate-half (Llama, Mistral, Qwen2/3, Mixtral, Gemma-2/3):
        x * c + cat(-x[..., D/2:], x[..., :D/2]) * s
    partial rotate-half (Phi-3 with partial_rotary_factor, GPT-NeoX, StableLM): R = cos.shape[-1] < D
        cat(rotate_half_rope(x[..., :R]), x[..., R:])
    interleaved (Cohere): pairs (2i, 2i+1); cos/sin repeat-interleaved; x.float() … .to(dtype) around it
        x * c + flatten(stack(-x[..., 1::2], x[..., ::2]), -2) * s
    split halves (GPT-OSS): cos/sin hold one angle per pair, [B, S, D/2]
        x1, x2 = chunk(x, 2, -1);  cat(x1 * c - x2 * s, x2 * c + x1 * s)

Each becomes ``rope(x.transpose(1, 2), cos, sin, interleaved).transpose(1, 2)``: the op works on
``[B, S, H, D]``; ``cleanup_transposes`` later folds the transposes into the ones HF put around it.
Partial rotary needs no extra arguments (the op rotates the first ``cos.shape[-1]`` dims), GPT-OSS's
half-width cos/sin are duplicated into the op's rotate-half layout. RoPE scaling (llama3, linear,
dynamic, yarn) lives in cos/sin and is untouched.

The slice bounds (``D/2``, ``R``, ``R/2``) are scalar parameters, so one pattern serves every head size;
``extra_check`` then proves them against the shapes: the halves split exactly the rotated dims and
cos/sin cover exactly those. The search functions take the unsqueezed cos/sin (q and k share them, and
a pattern's inner values may not be used elsewhere), so the check also requires HF's ``[B, 1, S, R]``
layout; models that rotate in ``[B, S, H, D]`` (``unsqueeze_dim=2``) are left alone. Every other literal
(slice dim, concatenation dim, the step of the interleaved slices) must match exactly. The replacements
squeeze cos/sin back to ``[B, S, R]``; ``rope_angle_views`` then hands the op HF's own cos/sin.

The partial spelling contains the full one, so it is registered (and applied) first.
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import Match
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.rope)
from autodeploy.patterns.graph_walk import same_size
from autodeploy.patterns.registry import register_pattern, register_rewrite

aten = torch.ops.aten


def _angles_fit(match: Match) -> bool:
    """cos/sin are ``[B or 1, 1, S, R]`` against x ``[B, H, S, D]``: HF's ``unsqueeze(1)`` layout."""
    x, cos, sin = (match.kwargs[name].meta["val"] for name in ("x", "cos", "sin"))
    return (
        x.dim() == cos.dim() == sin.dim() == 4
        and all(same_size(a, b) for a, b in zip(cos.shape, sin.shape))
        and same_size(cos.shape[1], 1)
        and same_size(cos.shape[2], x.shape[2])
        and (same_size(cos.shape[0], 1) or same_size(cos.shape[0], x.shape[0]))
    )


def _rotates_halves(match: Match) -> bool:
    """The slices split the rotated dims in half, and cos/sin cover exactly those dims."""
    x, cos = match.kwargs["x"].meta["val"], match.kwargs["cos"].meta["val"]
    rotary_dim = match.kwargs.get("rotary_dim", x.shape[-1])
    return (
        _angles_fit(match)
        and same_size(2 * match.kwargs["half"], rotary_dim)
        and same_size(cos.shape[-1], rotary_dim)
        and statically_known_true(rotary_dim <= x.shape[-1])
    )


def _rotates_pairs(match: Match) -> bool:
    x, cos = match.kwargs["x"].meta["val"], match.kwargs["cos"].meta["val"]
    return _angles_fit(match) and same_size(cos.shape[-1], x.shape[-1])


def _rotates_split_halves(match: Match) -> bool:
    x, cos = match.kwargs["x"].meta["val"], match.kwargs["cos"].meta["val"]
    return _angles_fit(match) and same_size(2 * cos.shape[-1], x.shape[-1])


def _rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _canonical_rope(x, cos, sin, interleaved=False):
    """The op on HF's layout: x ``[B, H, S, D]`` → ``[B, S, H, D]``, cos/sin ``[B, 1, S, R]`` → ``[B, S, R]``."""
    return torch.ops.autodeploy.rope(x.transpose(1, 2), cos.squeeze(1), sin.squeeze(1), interleaved).transpose(1, 2)


def rope_partial_rotate_half(x, cos, sin, rotary_dim, half):
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = x_rot * cos + _rotate_half(x_rot, half) * sin
    return torch.cat((rotated, x_pass), dim=-1)


def rope_partial_rotate_half_replacement(x, cos, sin, rotary_dim, half):
    return _canonical_rope(x, cos, sin)


def rope_rotate_half(x, cos, sin, half):
    return x * cos + _rotate_half(x, half) * sin


def rope_rotate_half_replacement(x, cos, sin, half):
    return _canonical_rope(x, cos, sin)


def rope_interleaved_float(x, cos, sin):
    """Cohere: computes in float32 and rounds back (the casts vanish in a float32 model)."""
    dtype = x.dtype
    x = x.float()
    out = x * cos + _rotate_pairs(x) * sin
    return out.to(dtype)


def rope_interleaved(x, cos, sin):
    return x * cos + _rotate_pairs(x) * sin


def rope_interleaved_replacement(x, cos, sin):
    return _canonical_rope(x, cos, sin, interleaved=True)


def rope_split_halves(x, cos, sin):
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def rope_split_halves_replacement(x, cos, sin):
    return _canonical_rope(x, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))


# x [B, H, S, D], cos/sin [B, 1, S, R]. The slice bounds are scalar parameters (any head size matches),
# traced with example values no other literal of the search graphs has.
_ROTARY_DIM, _HALF = 10, 5
_x, _x_partial = torch.empty(2, 4, 3, 2 * _HALF), torch.empty(2, 4, 3, 16)
_angles, _half_angles = torch.empty(2, 1, 3, 2 * _HALF), torch.empty(2, 1, 3, _HALF)

register_pattern("rope_partial_rotate_half", rope_partial_rotate_half, rope_partial_rotate_half_replacement,
                 [_x_partial, _angles, _angles], family="rope", extra_check=_rotates_halves,
                 scalar_workaround={"rotary_dim": _ROTARY_DIM, "half": _HALF})
register_pattern("rope_rotate_half", rope_rotate_half, rope_rotate_half_replacement, [_x, _angles, _angles],
                 family="rope", extra_check=_rotates_halves, scalar_workaround={"half": _HALF})
# In float32 the casts are no-ops and this is rope_interleaved, so it is traced for half dtypes only.
register_pattern("rope_interleaved_float", rope_interleaved_float, rope_interleaved_replacement, [_x, _angles, _angles],
                 family="rope", extra_check=_rotates_pairs, dtypes=(torch.bfloat16, torch.float16))
register_pattern("rope_interleaved", rope_interleaved, rope_interleaved_replacement, [_x, _angles, _angles],
                 family="rope", extra_check=_rotates_pairs)
register_pattern("rope_split_halves", rope_split_halves, rope_split_halves_replacement,
                 [_x, _half_angles, _half_angles], family="rope", extra_check=_rotates_split_halves)


def _unsqueezed_source(node) -> Node | None:
    """``c`` when ``node`` is ``squeeze(unsqueeze(c, 1), 1)``, else None."""
    if not (isinstance(node, Node) and node.target is aten.squeeze.dim and node.args[1] == 1):
        return None
    inner = node.args[0]
    if isinstance(inner, Node) and inner.target is aten.unsqueeze.default and inner.args[1] == 1:
        return inner.args[0]
    return None


def fold_angle_views(gm: GraphModule) -> int:
    """Hand each rope HF's ``[B, S, R]`` cos/sin instead of ``squeeze(unsqueeze(cos, 1), 1)``; returns how many.

    The pair is the replacements' own doing (their inputs are the unsqueezed angles); it is the identity.
    """
    folded = 0
    for rope in gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.rope.default):
        for index in (1, 2):
            squeeze = rope.args[index]
            source = _unsqueezed_source(squeeze)
            if source is not None:
                rope.replace_input_with(squeeze, source)
                if not squeeze.users:
                    gm.graph.erase_node(squeeze)
                folded += 1
    if folded:
        gm.recompile()
    return folded


register_rewrite("rope_angle_views", fold_angle_views, family="rope")
