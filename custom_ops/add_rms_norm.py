"""``torch.ops.autodeploy.add_rms_norm``: a pre-norm decoder's residual add and the RMSNorm of its sum in one op.

A decoder layer adds each sublayer's output to the residual stream and normalises the sum for the next
sublayer; the sum itself feeds the next residual add. Unfused, that is one pass that writes the sum and
a second that reads it back; fused, a kernel reads ``x`` and ``residual`` once and writes both outputs.
The ``fuse_add_rms_norm`` transform rewrites ``rms_norm(add(x, residual))`` to this op.
"""

import torch

from .compute_dtype import compute_dtype
from .registry import register_backend, register_op
from .rms_norm import rms_norm_reference, rms_norm_torch


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s, weight, eps, weight_offset), s)`` with ``s = x + residual``, both contiguous, like ``x``.

    ``s`` is rounded to ``x``'s dtype before it is normalised, as the unfused graph's add in the model's
    dtype rounds it; the norm is then exactly ``rms_norm_reference`` (float32 statistics and scaling, one
    rounding). So the normed output is bit-equal to the unfused ops' in every dtype. ``x`` and
    ``residual`` must have one shape and dtype (no broadcasting, no promotion); ``weight`` is ``[H]``.

    Example::

        x, residual = torch.randn(2, 8), torch.randn(2, 8)
        normed, total = torch.ops.autodeploy.add_rms_norm(x, residual, torch.ones(8), 1e-6)
        assert torch.equal(total, x + residual)
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm: residual must have x's shape and dtype {tuple(x.shape)} {x.dtype}; "
            f"got {tuple(residual.shape)} {residual.dtype}."
        )
    # An add in float32 rounded to bfloat16 or float16 equals the add in that dtype: float32 carries more
    # than twice their precision, so rounding twice cannot differ from rounding the exact sum once.
    dtype = compute_dtype(x.dtype)
    total = (x.to(dtype) + residual.to(dtype)).to(x.dtype)
    return rms_norm_reference(total, weight, eps, weight_offset), total.contiguous()


def add_rms_norm_fake(x, residual, weight, eps, weight_offset=0.0):
    return x.new_empty(x.shape), x.new_empty(x.shape)


add_rms_norm = register_op(
    "add_rms_norm",
    add_rms_norm_reference,
    add_rms_norm_fake,
    example_inputs=(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-6),
)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The add in ``x``'s dtype, then the ``rms_norm`` ``torch`` backend: what the unfused graph runs, in
    one op (two kernels); same arguments and result as the reference."""
    total = x + residual
    return rms_norm_torch(total, weight, eps, weight_offset), total.contiguous()


def _add_rms_norm_torch_supports(x, residual, weight, eps, weight_offset=0.0, *, device):
    if weight.dtype != x.dtype:  # torch.rms_norm then falls back to an unfused, upcasting formula
        return f"weight dtype {weight.dtype} differs from x's {x.dtype}"
    return True


register_backend("add_rms_norm", "torch", add_rms_norm_torch, supports=_add_rms_norm_torch_supports)
