"""``torch.ops.autodeploy.fused_gated_mlp``: ``gated_mlp`` over one concatenated gate/up weight.

``gate_up_weight[2I, H]`` holds the gate projection's rows, then the up projection's
(``torch.cat([gate_weight, up_weight])``, the layout of Phi-3's ``gate_up_proj`` and of ``moe``'s experts),
so ``x`` is read by one GEMM of width ``2I`` instead of two of width ``I``. The ``fuse_gate_up`` transform
(stage ``fuse``) rewrites ``gated_mlp`` nodes into this op; its ``triton`` backend computes
``act(gate) * up`` over the two halves of that GEMM's output in one kernel (``triton_backends.py``).

Example::

    import torch
    import autodeploy.custom_ops  # noqa: F401  (registers the ops)

    x = torch.randn(3, 16)
    gate, up, down = torch.randn(40, 16), torch.randn(40, 16), torch.randn(16, 40)
    fused = torch.ops.autodeploy.fused_gated_mlp(x, torch.cat([gate, up]), down, "silu")
    torch.testing.assert_close(fused, torch.ops.autodeploy.gated_mlp(x, gate, up, down, "silu"))
"""

import torch
import torch.nn.functional as F

from .activations import activation_fn
from .gated_mlp import gated_mlp_reference
from .registry import register_backend, register_op


def fused_gated_mlp_inner_size(
    caller: str, x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor
) -> int:
    """The inner size ``I`` of ``gate_up_weight[2I, H]`` and ``down_weight[H, I]`` for ``x[..., H]``; a
    ``ValueError`` naming ``caller`` when the shapes disagree."""
    hidden, inner = x.shape[-1], down_weight.shape[-1]
    if gate_up_weight.shape != (2 * inner, hidden) or down_weight.shape != (hidden, inner):
        raise ValueError(
            f"{caller}: expected gate_up [2I, H={hidden}] and down [H, I]; got gate_up "
            f"{tuple(gate_up_weight.shape)}, down {tuple(down_weight.shape)}."
        )
    return inner


def fused_gated_mlp_reference(
    x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, activation: str
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` for ``x[..., H]`` with ``gate, up = gate_up_weight.chunk(2)``.

    Weights in ``nn.Linear`` layout: ``gate_up_weight[2I, H]`` (gate rows first), ``down_weight[H, I]``;
    ``activation`` is one of "silu", "gelu_tanh", "gelu" (erf), "relu". Exactly ``gated_mlp``'s reference
    over the two halves: computed in float32 (float64 for float64 inputs); returns ``x``'s shape and dtype.
    """
    fused_gated_mlp_inner_size("fused_gated_mlp", x, gate_up_weight, down_weight)
    gate_weight, up_weight = gate_up_weight.chunk(2)
    return gated_mlp_reference(x, gate_weight, up_weight, down_weight, activation)


def fused_gated_mlp_fake(x, gate_up_weight, down_weight, activation):
    return x.new_empty(x.shape)


fused_gated_mlp = register_op(
    "fused_gated_mlp",
    fused_gated_mlp_reference,
    fused_gated_mlp_fake,
    example_inputs=(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(12, 4), torch.ones(4, 6), "silu"),
)


def fused_gated_mlp_torch(
    x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, activation: str
) -> torch.Tensor:
    """``fused_gated_mlp`` in the inputs' own dtype: one GEMM for gate and up, the gated activation over its
    two halves, the down GEMM (cuBLAS on GPUs); same arguments and result as the reference."""
    inner = fused_gated_mlp_inner_size("fused_gated_mlp_torch", x, gate_up_weight, down_weight)
    gate_up = F.linear(x, gate_up_weight)
    return F.linear(activation_fn(activation)(gate_up[..., :inner]) * gate_up[..., inner:], down_weight)


def _fused_gated_mlp_torch_supports(x, gate_up_weight, down_weight, activation, *, device):
    if not x.dtype == gate_up_weight.dtype == down_weight.dtype:
        return f"a weight dtype differs from x's {x.dtype} (computes in one native dtype)"
    return True


register_backend("fused_gated_mlp", "torch", fused_gated_mlp_torch, supports=_fused_gated_mlp_torch_supports)
