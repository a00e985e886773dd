"""``int4_gptq``: ``int4_wo``'s storage and op (``int4_wo_linear``), the values rounded by GPTQ.

Column by column, each rounding error is spread over the columns not yet rounded through the inverse of the
layer's input Hessian ``H = E[x xᵀ]`` (1% damping), a group's scale and zero point taken from its columns as
updated by then. Minimises ``‖(w − ŵ) x‖²`` over the calibration inputs far better than rounding each value.
A checkpoint written with it is an ``int4_wo`` one (the same layout): nothing is recalibrated when it is served.
"""

from __future__ import annotations

import torch

from ..quantized_linear import UINT4_MAX, QuantMethod, pack_int4, register_scheme
from .int4_wo import (
    check_groups,
    dequantize_int4_groups,
    group_grid,
    int4_compressed_tensors_args,
    int4_to_compressed_tensors,
    quantize_int4_groups,
)


@register_scheme
class Int4Gptq(QuantMethod):
    name = "int4_gptq"

    def statistics(self, scheme):
        return frozenset({"hessian"})

    def check_shape(self, scheme, shape):
        return check_groups(scheme, shape)

    def quantize(self, scheme, w, statistics):
        if w.device.type == "meta":  # shapes only (the quantize stage, before weights exist)
            return quantize_int4_groups(w, scheme.group_size)
        if statistics is None or "hessian" not in statistics:
            raise ValueError("int4_gptq needs the layer's calibration Hessian (hessian)")
        return _gptq(w, statistics["hessian"], scheme.group_size)

    def dequantize(self, scheme, stored, dtype):
        return dequantize_int4_groups(stored, dtype)

    def op(self, scheme):
        return torch.ops.autodeploy.int4_wo_linear.default

    def compressed_tensors_args(self, scheme):
        return int4_compressed_tensors_args(scheme)

    def to_compressed_tensors(self, scheme, stored):
        return int4_to_compressed_tensors(stored)


def _gptq(w: torch.Tensor, hessian: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    rows, columns = w.shape
    hessian = hessian.to(w.device, torch.float64).clone()
    w = w.to(torch.float64).clone()
    dead = hessian.diagonal() == 0  # inputs that were always zero: their weights do not matter
    hessian[dead, dead] = 1.0
    w[:, dead] = 0.0
    hessian.diagonal().add_(0.01 * hessian.diagonal().mean())
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    q = torch.zeros(rows, columns, dtype=torch.uint8, device=w.device)
    scales = torch.zeros(rows, columns // group, dtype=torch.float64, device=w.device)
    zeros = torch.zeros_like(scales)
    for first in range(0, columns, group):  # one group a block: its grid from its columns as updated so far
        last = first + group
        block, block_inverse = w[:, first:last].clone(), inverse[first:last, first:last]
        scale, zero = group_grid(block)
        scales[:, first // group], zeros[:, first // group] = scale, zero
        errors = torch.zeros_like(block)
        for j in range(group):
            column = block[:, j]
            level = torch.round(column / scale + zero).clamp_(0, UINT4_MAX)
            q[:, first + j] = level.to(torch.uint8)
            error = (column - (level - zero) * scale) / block_inverse[j, j]
            block[:, j:] -= error[:, None] * block_inverse[j, j:][None, :]
            errors[:, j] = error
        w[:, last:] -= errors @ inverse[first:last, last:]
    return {"qweight": pack_int4(q), "scale": scales.to(torch.float32), "zero": zeros.to(torch.uint8)}
