"""``torch.ops.autodeploy.cached_attention_rope``: ``cached_attention`` that applies RoPE to q and k itself.

A decoder layer's serving graph computes ``cached_attention(rope(q, cos, sin), rope(k, cos, sin), v, …)``.
This op takes q and k un-rotated, with the angles (``cos``/``sin [1, T or 1, R]``, ``rope``'s contract),
so a kernel can rotate k on its way into the paged cache and q in the same pass, instead of two rope
launches and a second read of the rotated keys. Everything else (caches, metadata, options) is
``cached_attention``'s, in its order. The ``fuse_rope_into_cached_attention`` transform puts it in graphs.

A separate op rather than optional angles on ``cached_attention``: a backend registered for
``cached_attention`` (a user's included) takes that op's arguments and would not know to rotate.

Backends: ``triton`` (``triton/paged_attention_rope.py``: one kernel rotates q and k and writes K/V,
then ``cached_attention``'s attention kernels; for decodes alone, the decode kernel does both) and
``sdpa`` (``rope``'s torch backend on q and k, then ``cached_attention``'s SDPA backend).

Example (the reference; the metadata layout is ``cached_attention``'s)::

    import torch
    import autodeploy.custom_ops  # noqa: F401  (registers the ops)

    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    angles = torch.rand(1, 3, 4).repeat(1, 1, 2)  # [1, T, R=8], rotate-half layout
    k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    metadata = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                torch.tensor([[1]], dtype=torch.int32), torch.tensor([4, 5, 6]),
                torch.tensor([1, 0, 3, 3], dtype=torch.int32))
    out = torch.ops.autodeploy.cached_attention_rope(q, k, v, angles.cos(), angles.sin(), False,
                                                     k_cache, v_cache, *metadata, 8**-0.5)  # [1, 3, 4, 8]
"""

from __future__ import annotations

import inspect

import torch

from .cached_attention import SIGNATURE, CachedAttentionArgs, cached_attention_reference
from .cached_attention_sdpa import cached_attention_sdpa
from .registry import arguments_tuple, register_backend, register_op
from .rope import rope_reference, rope_torch


# cached_attention's arguments with rope's angles and layout after v: the signature derives from cached_attention's
# one declaration (custom_ops/cached_attention.py), so the two cannot drift apart.
_PARAMETERS = list(SIGNATURE.parameters.values())
_ROPE = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)
         for name, annotation in (("cos", torch.Tensor), ("sin", torch.Tensor), ("interleaved", bool))]
ROPE_SIGNATURE = SIGNATURE.replace(parameters=[*_PARAMETERS[:3], *_ROPE, *_PARAMETERS[3:]])
CachedAttentionRopeArgs = arguments_tuple("CachedAttentionRopeArgs", ROPE_SIGNATURE)


def _attention_call(call: tuple, q: torch.Tensor, k: torch.Tensor) -> tuple:
    """The ``cached_attention`` call this one stands for, given q and k rotated."""
    return CachedAttentionArgs(**{**{name: getattr(call, name) for name in CachedAttentionArgs._fields}, "q": q, "k": k})


def cached_attention_rope_reference(*args, **kwargs) -> torch.Tensor:
    """``cached_attention(rope(q, cos, sin, interleaved), rope(k, cos, sin, interleaved), v, …)`` with
    both ops' references: rotates q ``[1, T, Hq, D]`` and k ``[1, T, Hkv, D]``, writes the rotated keys and
    the values into the caches, and attends. Returns ``[1, T, Hq, Dv]`` in ``q``'s dtype."""
    call = CachedAttentionRopeArgs(*args, **kwargs)
    rotated = (rope_reference(x, call.cos, call.sin, call.interleaved) for x in (call.q, call.k))
    return cached_attention_reference(*_attention_call(call, *rotated))


cached_attention_rope_reference.__signature__ = ROPE_SIGNATURE  # the op's schema is inferred from it


def cached_attention_rope_fake(*args, **kwargs):
    call = CachedAttentionRopeArgs(*args, **kwargs)
    return call.q.new_empty((*call.q.shape[:-1], call.v.shape[-1]))


def _example_inputs():
    """Two sequences, block size 2: a 3-token prompt and a one-token decode at position 2; partial rotary."""
    q, k, v = torch.ones(1, 4, 4, 8), torch.ones(1, 4, 2, 8), torch.ones(1, 4, 2, 6)
    angles = torch.ones(1, 4, 4), torch.zeros(1, 4, 4)
    caches = torch.zeros(5, 2, 2, 8), torch.zeros(5, 2, 2, 6)
    metadata = (
        torch.tensor([0, 3, 4], dtype=torch.int32),
        torch.tensor([3, 3], dtype=torch.int32),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([0, 1, 2, 6]),
        torch.tensor([1, 1, 3, 3], dtype=torch.int32),
    )
    return (q, k, v, *angles, False, *caches, *metadata, 8**-0.5)


cached_attention_rope = register_op(
    "cached_attention_rope",
    cached_attention_rope_reference,
    cached_attention_rope_fake,
    example_inputs=_example_inputs(),
    mutates_args=("k_cache", "v_cache"),
    capturable=False,  # cached_attention's reference: one sequence at a time, from kv_lens read on the host
)


def _triton_backend(*args, **kwargs):
    # Imported on first use (Triton decides at kernel definition whether to interpret); the arguments
    # were checked at build by _triton_supports, so the launch skips the checks.
    from .triton.paged_attention_rope import cached_attention_rope_triton

    return cached_attention_rope_triton(*args, **kwargs, check=False)


def _triton_supports(*args, device, **kwargs):
    from .triton import triton_unavailable

    reason = triton_unavailable(device)
    if reason:
        return reason
    from .triton.paged_attention_rope import check_rope_supported  # Triton is usable here: its kernels may be defined

    call = CachedAttentionRopeArgs(*args, **kwargs)
    try:
        check_rope_supported(
            call.q, call.k, call.v, call.cos, call.sin, call.k_cache, call.v_cache, call.block_tables,
            call.sliding_window, call.logit_cap, call.sinks, call.alibi_slopes, tree_mask=call.tree_mask,
            attend_until=call.attend_until, distance_bias=call.distance_bias, device=device,
        )
    except ValueError as error:
        return str(error).split(": ", 1)[-1]  # without the kernel's name, which the report shows already
    return True


def cached_attention_rope_sdpa(*args, **kwargs):
    """``rope``'s torch backend on q and k, then ``cached_attention``'s SDPA backend: what the unfused graph
    runs on a CPU, in one node. q and k are rotated as one tensor (their heads side by side): the same
    element-wise arithmetic, so the same values, in one pass of ``rope_torch``'s dozen small ops instead of
    two (a CPU decode step is mostly such per-op overhead)."""
    call = CachedAttentionRopeArgs(*args, **kwargs)
    q, k, angles = call.q, call.k, (call.cos, call.sin, call.interleaved)
    if q.shape[-1] == k.shape[-1] and q.dtype == k.dtype:
        heads = q.shape[2]
        rotated = rope_torch(torch.cat((q, k), dim=2), *angles)
        q, k = rotated[:, :, :heads], rotated[:, :, heads:]
    else:
        q, k = rope_torch(q, *angles), rope_torch(k, *angles)
    return cached_attention_sdpa(*_attention_call(call, q, k))


def _sdpa_supports(*args, device, **kwargs):
    call = CachedAttentionRopeArgs(*args, **kwargs)
    if call.logit_cap is not None or call.sinks is not None:
        return "SDPA has no soft-capping or sinks"
    return True


register_backend("cached_attention_rope", "triton", _triton_backend, supports=_triton_supports)
# Like cached_attention's SDPA backend, it reads seq_start and kv_lens on the host: no CUDA graph can hold it.
register_backend(
    "cached_attention_rope", "sdpa", cached_attention_rope_sdpa, supports=_sdpa_supports, capturable=False
)
