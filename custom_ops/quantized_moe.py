"""MoE experts with quantized weights: ``moe_int8_wo`` and ``moe_int4_wo``, ``moe`` over experts stored as the
weight-only schemes store a projection (``quantized_linear.py``), expert by expert:

- ``moe_int8_wo``: ``gate_up_qweight`` int8 ``[E, 2I, H]`` with ``gate_up_scale`` float32 ``[E, 2I]``, and
  ``down_qweight`` int8 ``[E, H, I]`` with ``down_scale`` ``[E, H]``;
- ``moe_int4_wo``: packed ``[E, 2I, H/2]`` and ``[E, H, I/2]`` uint8 with a float32 scale and a uint8 zero
  point per group of inputs each (``[E, 2I, H/G]``, ``[E, H, I/G]``).

Activations stay in the model's dtype. The reference dequantizes every expert and runs ``moe``'s reference;
the ``torch`` backend dequantizes into ``x``'s dtype and runs ``moe``'s grouped GEMMs. Both read the whole
of every expert's weights each call: the memory an 8-expert model saves is real, the speed a fused kernel's.

``moe_expert_parallel_int8_wo`` and ``moe_expert_parallel_int4_wo`` are ``moe_expert_parallel``
(``moe_expert_parallel.py``) over this rank's experts stored so: the same tensors with ``E/N`` experts, then
``expert_order``. Each expert has its own scales (a row's, or a group's of a row), so a rank's share is exactly
those experts' part of one process's quantized tensors; the rank dequantizes its experts to float32 and
exchanges tokens as ``moe_expert_parallel`` does.

    stored = quantize_weight(QuantScheme("int8_wo"), gate_up)   # [E, 2I, H] → {"qweight", "scale"}
"""

from __future__ import annotations

import torch

from . import quantization  # noqa: F401  (registers the int8_wo and int4_wo schemes named below)
from .moe import moe_reference, moe_torch, _moe_torch_supports
from .moe_expert_parallel import moe_expert_parallel_reference
from .quantized_linear import QuantScheme, dequantize_weight, quantize_weight
from .registry import register_backend, register_op


def _int4_scheme(qweight: torch.Tensor, scale: torch.Tensor) -> QuantScheme:
    return QuantScheme("int4_wo", group_size=2 * qweight.shape[-1] // scale.shape[-1])


def _experts_int8(qweight, scale, dtype):
    return dequantize_weight(QuantScheme("int8_wo"), {"qweight": qweight, "scale": scale}, dtype)


def _experts_int4(qweight, scale, zero, dtype):
    return dequantize_weight(_int4_scheme(qweight, scale), {"qweight": qweight, "scale": scale, "zero": zero}, dtype)


def moe_int8_wo_reference(
    x: torch.Tensor, router_logits: torch.Tensor, gate_up_qweight: torch.Tensor, gate_up_scale: torch.Tensor,
    down_qweight: torch.Tensor, down_scale: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
    activation: str = "silu",
) -> torch.Tensor:
    """``moe`` over int8 experts (see the module docstring), computed as its reference computes."""
    return moe_reference(x, router_logits, _experts_int8(gate_up_qweight, gate_up_scale, torch.float32),
                         _experts_int8(down_qweight, down_scale, torch.float32), top_k, scoring, renormalize, activation)


def moe_int4_wo_reference(
    x: torch.Tensor, router_logits: torch.Tensor, gate_up_qweight: torch.Tensor, gate_up_scale: torch.Tensor,
    gate_up_zero: torch.Tensor, down_qweight: torch.Tensor, down_scale: torch.Tensor, down_zero: torch.Tensor, top_k: int,
    scoring: str = "softmax", renormalize: bool = True, activation: str = "silu",
) -> torch.Tensor:
    """``moe`` over 4-bit experts (see the module docstring), computed as its reference computes."""
    return moe_reference(x, router_logits, _experts_int4(gate_up_qweight, gate_up_scale, gate_up_zero, torch.float32),
                         _experts_int4(down_qweight, down_scale, down_zero, torch.float32), top_k, scoring, renormalize,
                         activation)


def _fake(x, *rest):
    return x.new_empty(x.shape)


# Examples register_op checks the fake against: 5 experts, hidden 8, inner 6, top 2.
_GATE_UP, _DOWN = torch.linspace(-1.0, 1.0, 5 * 12 * 8).reshape(5, 12, 8), torch.linspace(-1.0, 1.0, 5 * 8 * 6).reshape(5, 8, 6)
_EXAMPLE = (torch.ones(3, 8), torch.zeros(3, 5))
_INT8_UP, _INT8_DOWN = (quantize_weight(QuantScheme("int8_wo"), w) for w in (_GATE_UP, _DOWN))
_INT4_UP, _INT4_DOWN = (quantize_weight(QuantScheme("int4_wo", group_size=2), w) for w in (_GATE_UP, _DOWN))
moe_int8_wo = register_op(
    "moe_int8_wo", moe_int8_wo_reference, _fake, capturable=False,
    example_inputs=(*_EXAMPLE, _INT8_UP["qweight"], _INT8_UP["scale"], _INT8_DOWN["qweight"], _INT8_DOWN["scale"], 2),
)
moe_int4_wo = register_op(
    "moe_int4_wo", moe_int4_wo_reference, _fake, capturable=False,
    example_inputs=(*_EXAMPLE, _INT4_UP["qweight"], _INT4_UP["scale"], _INT4_UP["zero"], _INT4_DOWN["qweight"],
                    _INT4_DOWN["scale"], _INT4_DOWN["zero"], 2),
)


def moe_expert_parallel_int8_wo_reference(
    x: torch.Tensor, router_logits: torch.Tensor, gate_up_qweight: torch.Tensor, gate_up_scale: torch.Tensor,
    down_qweight: torch.Tensor, down_scale: torch.Tensor, expert_order: list[int], top_k: int, scoring: str = "softmax",
    renormalize: bool = True, activation: str = "silu",
) -> torch.Tensor:
    """``moe_expert_parallel`` over this rank's int8 experts (``[E/N, …]``, placed by ``expert_order``)."""
    return moe_expert_parallel_reference(x, router_logits, _experts_int8(gate_up_qweight, gate_up_scale, torch.float32),
                                         _experts_int8(down_qweight, down_scale, torch.float32), expert_order, top_k,
                                         scoring, renormalize, activation)


def moe_expert_parallel_int4_wo_reference(
    x: torch.Tensor, router_logits: torch.Tensor, gate_up_qweight: torch.Tensor, gate_up_scale: torch.Tensor,
    gate_up_zero: torch.Tensor, down_qweight: torch.Tensor, down_scale: torch.Tensor, down_zero: torch.Tensor,
    expert_order: list[int], top_k: int, scoring: str = "softmax", renormalize: bool = True, activation: str = "silu",
) -> torch.Tensor:
    """``moe_expert_parallel`` over this rank's 4-bit experts (``[E/N, …]``, placed by ``expert_order``)."""
    return moe_expert_parallel_reference(
        x, router_logits, _experts_int4(gate_up_qweight, gate_up_scale, gate_up_zero, torch.float32),
        _experts_int4(down_qweight, down_scale, down_zero, torch.float32), expert_order, top_k, scoring, renormalize,
        activation)


_ORDER = [4, 3, 2, 1, 0]  # one rank (no process group) holds all 5 example experts, placed in reverse
moe_expert_parallel_int8_wo = register_op(
    "moe_expert_parallel_int8_wo", moe_expert_parallel_int8_wo_reference, _fake, capturable=False,
    example_inputs=(*_EXAMPLE, _INT8_UP["qweight"], _INT8_UP["scale"], _INT8_DOWN["qweight"], _INT8_DOWN["scale"],
                    _ORDER, 2),
)
moe_expert_parallel_int4_wo = register_op(
    "moe_expert_parallel_int4_wo", moe_expert_parallel_int4_wo_reference, _fake, capturable=False,
    example_inputs=(*_EXAMPLE, _INT4_UP["qweight"], _INT4_UP["scale"], _INT4_UP["zero"], _INT4_DOWN["qweight"],
                    _INT4_DOWN["scale"], _INT4_DOWN["zero"], _ORDER, 2),
)


def moe_int8_wo_torch(x, router_logits, gate_up_qweight, gate_up_scale, down_qweight, down_scale, top_k, scoring="softmax",
                      renormalize=True, activation="silu"):
    """The experts dequantized into ``x``'s dtype, then ``moe``'s grouped GEMMs."""
    return moe_torch(x, router_logits, _experts_int8(gate_up_qweight, gate_up_scale, x.dtype),
                     _experts_int8(down_qweight, down_scale, x.dtype), top_k, scoring, renormalize, activation)


def moe_int4_wo_torch(x, router_logits, gate_up_qweight, gate_up_scale, gate_up_zero, down_qweight, down_scale, down_zero,
                      top_k, scoring="softmax", renormalize=True, activation="silu"):
    """The experts dequantized into ``x``'s dtype, then ``moe``'s grouped GEMMs."""
    return moe_torch(x, router_logits, _experts_int4(gate_up_qweight, gate_up_scale, gate_up_zero, x.dtype),
                     _experts_int4(down_qweight, down_scale, down_zero, x.dtype), top_k, scoring, renormalize, activation)


def _supports(x, router_logits, gate_up_shape, down_shape, *, device):
    """``moe``'s torch backend's verdict on the dequantized experts' shapes in ``x``'s dtype."""
    gate_up, down = (torch.empty(shape, dtype=x.dtype, device="meta") for shape in (gate_up_shape, down_shape))
    return _moe_torch_supports(x, router_logits, gate_up, down, 1, device=device)


def _int8_supports(x, router_logits, gate_up_qweight, gate_up_scale, down_qweight, down_scale, *rest, device):
    return _supports(x, router_logits, gate_up_qweight.shape, down_qweight.shape, device=device)


def _int4_supports(x, router_logits, gate_up_qweight, gate_up_scale, gate_up_zero, down_qweight, down_scale, down_zero, *rest,
                   device):
    unpacked = [(*q.shape[:2], 2 * q.shape[2]) for q in (gate_up_qweight, down_qweight)]
    return _supports(x, router_logits, *unpacked, device=device)


register_backend("moe_int8_wo", "torch", moe_int8_wo_torch, supports=_int8_supports)
register_backend("moe_int4_wo", "torch", moe_int4_wo_torch, supports=_int4_supports)
