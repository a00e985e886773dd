"""Quantized projections: the weight schemes, their storage, and the canonical ops that read it.

A scheme turns a float weight ``w[N, K]`` (``nn.Linear`` layout) into the tensors its op stores:

- ``int8_wo``: ``qweight`` int8 ``[N, K]`` and ``scale`` float32 ``[N]``, symmetric per output channel:
  ``w ≈ qweight · scale``, ``scale = max|w[n]| / 127``. Activations stay in the model's dtype.
- ``int4_wo``: ``qweight`` uint8 ``[N, K/2]`` (two 4-bit values a byte, the even ``k`` in the low nibble),
  ``scale`` float32 and ``zero`` uint8 ``[N, K/group_size]``, asymmetric per group of ``group_size``
  inputs (128 by default): ``w ≈ (q − zero) · scale`` with ``q, zero ∈ [0, 15]``.
- ``int4_awq``: ``int4_wo``'s storage for ``w · diag(s)`` and ``smooth = 1 / s`` float32 ``[K]``, the op
  computing ``x · smooth`` first (activation-aware: AWQ). ``s = a^α`` from the mean ``|x|`` of each input
  channel over calibration text (``a``), normalised, with ``α`` searched over 0, 0.1, …, 1 for the least
  error ``Σ_k E[x_k²] · Σ_n (w − ŵ)²_nk``. ``α = 0`` is round-to-nearest, so it never does worse by that measure.
- ``int4_gptq``: ``int4_wo``'s storage and op, the values rounded by GPTQ: column by column, each
  rounding error is spread over the columns not yet rounded through the inverse of the layer's input
  Hessian ``H = E[x xᵀ]`` (1% damping), a group's scale and zero point taken from its columns as updated
  by then. Minimises ``‖(w − ŵ) x‖²`` over the calibration inputs far better than rounding each value.
- ``fp8``: ``qweight`` float8_e4m3fn ``[N, K]`` and ``scale`` float32 ``[N]`` (``per_channel``) or ``[1]``
  (per tensor), ``scale = max|w| / 448``. Activations are quantized the same way, per token, when the
  op runs (dynamic): ``x ≈ x_q · x_scale``, ``x_scale = max|x[t]| / 448``. With ``static_activations``
  one ``input_scale`` float32 ``[1]`` per layer serves every token instead: the largest input the layer
  took over calibration text, over 448 (``fp8_static_linear``; values past it saturate at ±448).
- ``smoothquant`` (W8A8): ``int8_wo``'s storage for ``w · diag(s)`` and ``smooth = 1 / s`` float32 ``[K]``,
  ``s_k = max|x_k|^α / max_n |w_nk|^(1−α)`` from the largest input each channel took over calibration
  text (``max_abs``; ``alpha`` 0.5 by default): outlier channels of the activations move into the
  weights. The op quantizes ``x · smooth`` to int8 per token as it runs (``max|·| / 127``) and sums
  int8 products in int32. Projections over one input share ``s`` (its ``max_n`` taken over all their
  weights: calibration's ``weight_max_abs``, combined by ``share_smoothing``), so the ``fold_smoothing``
  transform can move ``smooth`` into the norm or linear before them.

:func:`quantize_weight` and :func:`dequantize_weight` convert; each op's reference dequantizes and
computes in float32 (float64 for float64 inputs), so it is exact up to the scheme's declared rounding.

```python
import torch
from autodeploy.custom_ops.quantized_linear import QuantScheme, dequantize_weight, quantize_weight
scheme = QuantScheme("int4_wo", group_size=32)
w = torch.randn(8, 64)
stored = quantize_weight(scheme, w)                 # {"qweight": uint8 [8, 32], "scale": [8, 2], "zero": [8, 2]}
assert (dequantize_weight(scheme, stored) - w).abs().max() <= stored["scale"].max() / 2 + 1e-6
```
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .compute_dtype import compute_dtype
from .registry import register_backend, register_op

SCHEMES = ("int8_wo", "int4_wo", "int4_awq", "int4_gptq", "fp8", "smoothquant")
EXPERT_SCHEMES = ("int8_wo", "int4_wo")  # MoE experts' [E, N, K] weights: weight-only, expert by expert
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_INT8_MAX = 127.0
_UINT4_MAX = 15


@dataclass(frozen=True)
class QuantScheme:
    """A weight scheme and its options: ``group_size`` (``int4_wo``), ``per_channel`` and
    ``static_activations`` (``fp8``), ``alpha`` (``smoothquant``: how much of the activations' range moves
    into the weights)."""

    name: str
    group_size: int = 128
    per_channel: bool = True
    alpha: float = 0.5
    static_activations: bool = False

    def __post_init__(self):
        if self.name not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.name!r}; schemes: {', '.join(SCHEMES)}, none.")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"int4_wo group_size must be an even number ≥ 2; got {self.group_size}.")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"smoothquant alpha must lie in [0, 1]; got {self.alpha}.")

    @property
    def calibrated(self) -> bool:
        """Whether :func:`quantize_weight` takes the layer's input statistics (from calibration)."""
        return self.name in ("int4_awq", "int4_gptq", "smoothquant") or (self.name == "fp8" and self.static_activations)

    @property
    def op(self):
        """The canonical op that computes with this scheme's storage."""
        if self.name == "fp8" and self.static_activations:
            return torch.ops.autodeploy.fp8_static_linear.default
        return OPS[self.name]

    def check_shape(self, shape: tuple[int, ...]) -> str | None:
        """Why a ``[N, K]`` weight (or MoE experts' ``[E, N, K]``) cannot take this scheme, or None."""
        if len(shape) == 3 and self.name not in EXPERT_SCHEMES:
            return f"MoE experts take {' or '.join(EXPERT_SCHEMES)}, not {self.name}"
        if len(shape) not in (2, 3):
            return f"a {self.name} weight must be 2-D [N, K] (or MoE experts' [E, N, K]); got {tuple(shape)}"
        if self.name in ("int4_wo", "int4_awq", "int4_gptq") and shape[-1] % self.group_size:
            return f"{self.name} needs K ({shape[-1]}) to be a multiple of group_size {self.group_size}"
        return None


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero row or group quantizes to zeros with scale 1 instead of dividing by zero.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_weight(scheme: QuantScheme, weight: torch.Tensor, statistics: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The tensors ``scheme`` stores for ``weight[N, K]``, by role (see the module docstring); ``int4_awq``
    takes the layer's input ``statistics`` (``mean_abs`` and ``mean_square``, ``[K]`` each)."""
    problem = scheme.check_shape(tuple(weight.shape))
    if problem:
        raise ValueError(problem)
    if weight.dim() == 3:  # MoE experts: each expert's [N, K] as the rows of one [E·N, K] weight
        experts = weight.shape[0]
        stored = quantize_weight(scheme, weight.reshape(-1, weight.shape[-1]))
        return {role: tensor.reshape(experts, -1, *tensor.shape[1:]) for role, tensor in stored.items()}
    w = weight.detach().to(torch.float32)
    if scheme.name == "int4_awq":
        return _awq(scheme, w, statistics)
    if scheme.name == "int4_gptq":
        return _gptq(scheme, w, statistics)
    if scheme.name == "smoothquant":
        return _smoothquant(scheme, w, statistics)
    if scheme.name == "int8_wo":
        scale = _safe(w.abs().amax(dim=1) / _INT8_MAX)
        qweight = torch.round(w / scale[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        return {"qweight": qweight, "scale": scale}
    if scheme.name == "fp8":
        amax = w.abs().amax(dim=1) if scheme.per_channel else w.abs().amax().reshape(1)
        scale = _safe(amax / FP8_MAX)
        qweight = (w / (scale[:, None] if scheme.per_channel else scale)).clamp_(-FP8_MAX, FP8_MAX)
        stored = {"qweight": qweight.to(torch.float8_e4m3fn), "scale": scale}
        if scheme.static_activations:
            if statistics is None or "max_abs" not in statistics:
                raise ValueError("fp8 with static activation scales needs the layer's input statistics (max_abs, from calibration)")
            stored["input_scale"] = _safe(statistics["max_abs"].to(w.device, torch.float32).amax().reshape(1) / FP8_MAX)
        return stored
    rows, columns = w.shape
    groups = w.reshape(rows, columns // scheme.group_size, scheme.group_size)
    scale, zero = _group_grid(groups)
    q = torch.round(groups / scale[..., None] + zero[..., None]).clamp_(0, _UINT4_MAX).to(torch.uint8)
    return {"qweight": pack_int4(q.reshape(rows, columns)), "scale": scale, "zero": zero.to(torch.uint8)}


def dequantize_weight(scheme: QuantScheme, stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w[N, K]`` (MoE experts: ``[E, N, K]``) in ``dtype`` as the scheme's op sees it (``int4_awq``: with
    its smoothing folded back in)."""
    if stored["qweight"].dim() == 3:
        experts = stored["qweight"].shape[0]
        flat = dequantize_weight(scheme, {role: t.reshape(-1, *t.shape[2:]) for role, t in stored.items()}, dtype)
        return flat.reshape(experts, -1, flat.shape[-1])
    if scheme.name == "int4_awq":
        plain = QuantScheme("int4_wo", group_size=scheme.group_size)
        return dequantize_weight(plain, stored, dtype) * stored["smooth"].to(dtype)[None, :]
    if scheme.name == "int4_gptq":
        return dequantize_weight(QuantScheme("int4_wo", group_size=scheme.group_size), stored, dtype)
    if scheme.name == "smoothquant":
        return dequantize_weight(QuantScheme("int8_wo"), stored, dtype) * stored["smooth"].to(dtype)[None, :]
    qweight, scale = stored["qweight"], stored["scale"].to(dtype)
    if scheme.name == "int8_wo":
        return qweight.to(dtype) * scale[:, None]
    if scheme.name == "fp8":
        return qweight.to(dtype) * (scale[:, None] if scale.numel() > 1 else scale)
    q = unpack_int4(qweight).to(dtype)
    rows, columns = q.shape
    group_size = columns // scale.shape[1]
    groups = q.reshape(rows, -1, group_size) - stored["zero"].to(dtype)[..., None]
    return (groups * scale[..., None]).reshape(rows, columns)


def _awq(scheme: QuantScheme, w: torch.Tensor, statistics: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    if statistics is None:
        raise ValueError("int4_awq needs the layer's calibration statistics (mean_abs, mean_square)")
    plain = QuantScheme("int4_wo", group_size=scheme.group_size)
    if w.device.type == "meta":  # shapes only (the quantize stage, before weights exist)
        return {**quantize_weight(plain, w), "smooth": torch.empty(w.shape[1], device="meta")}
    mean_abs = statistics["mean_abs"].to(w.device, torch.float32).clamp(min=1e-8)
    weights = statistics["mean_square"].to(w.device, torch.float32)
    best = None
    for step in range(11):
        s = mean_abs.pow(step / 10)
        s = (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)
        stored = quantize_weight(plain, w * s[None, :])
        error = ((dequantize_weight(plain, stored, torch.float32) / s[None, :] - w).square().sum(0) * weights).sum()
        if best is None or error < best[0]:
            best = (error, stored, s)
    _, stored, s = best
    return {**stored, "smooth": (1.0 / s).contiguous()}


def _smoothquant(scheme: QuantScheme, w: torch.Tensor, statistics: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    if statistics is None or "max_abs" not in statistics:
        raise ValueError("smoothquant needs the layer's input statistics (max_abs, from calibration)")
    x_max = statistics["max_abs"].to(w.device, torch.float32)
    # Projections over one input take their group's largest weights (share_smoothing): one s for all of them.
    w_max = statistics["weight_max_abs"].to(w.device, torch.float32) if "weight_max_abs" in statistics else w.abs().amax(dim=0)
    # A channel that never carried a value (or whose weights are all zero) keeps s = 1.
    s = torch.where((x_max > 0) & (w_max > 0), x_max.pow(scheme.alpha) / w_max.pow(1.0 - scheme.alpha), torch.ones_like(x_max))
    s = s.clamp(min=1e-5)
    return {**quantize_weight(QuantScheme("int8_wo"), w * s[None, :]), "smooth": 1.0 / s}


def share_smoothing(statistics: dict[str, dict[str, torch.Tensor]], groups: list[tuple[str, ...]]
                    ) -> dict[str, dict[str, torch.Tensor]]:
    """``statistics`` (per module path) with each group of projections over one input (``groups``) given the
    group's largest inputs and weights (``max_abs``, ``weight_max_abs``: element-wise maxima over its
    members), so ``smoothquant`` finds one ``s`` for all of them. Paths without statistics are left out of
    their group; other entries are returned as they are."""
    shared = dict(statistics)
    for group in groups:
        members = [statistics[path] for path in group if path in statistics]
        if len(members) < 2:
            continue
        combined = {key: torch.stack([m[key] for m in members]).amax(0)
                    for key in ("max_abs", "weight_max_abs") if all(key in m for m in members)}
        for path in group:
            if path in statistics:
                shared[path] = {**statistics[path], **combined}
    return shared


def share_head_smoothing(statistics: dict[str, dict[str, torch.Tensor]], heads: list[tuple[str, int, int, int]]
                         ) -> dict[str, dict[str, torch.Tensor]]:
    """``statistics`` with each projection over attention's output (``heads``: ``(path, kv_heads, group,
    head_dim)``, its input channels ``[kv_heads, group, head_dim]``) given, per channel, the largest inputs and
    weights over the query heads that share a key-value head: ``smoothquant`` then finds one ``s`` for a value
    channel, which ``fold_smoothing`` can move into the value projection's rows."""
    shared = dict(statistics)
    for path, kv_heads, group, head_dim in heads:
        if path not in statistics:
            continue
        entry = dict(statistics[path])
        for key in ("max_abs", "weight_max_abs"):
            if key in entry and entry[key].numel() == kv_heads * group * head_dim:
                grouped = entry[key].reshape(kv_heads, group, head_dim).amax(1, keepdim=True)
                entry[key] = grouped.expand(kv_heads, group, head_dim).reshape(-1)
        shared[path] = entry
    return shared


def _group_grid(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of ``int4_wo``'s asymmetric grid over the last dim of ``groups`` (``[..., G]``); the grid
    spans 0, so zero stays exact."""
    low, high = groups.amin(dim=-1).clamp(max=0.0), groups.amax(dim=-1).clamp(min=0.0)
    scale = _safe((high - low) / _UINT4_MAX)
    return scale, torch.round(-low / scale).clamp_(0, _UINT4_MAX)


def _gptq(scheme: QuantScheme, w: torch.Tensor, statistics: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    plain = QuantScheme("int4_wo", group_size=scheme.group_size)
    if w.device.type == "meta":  # shapes only (the quantize stage, before weights exist)
        return quantize_weight(plain, w)
    if statistics is None or "hessian" not in statistics:
        raise ValueError("int4_gptq needs the layer's calibration Hessian (hessian)")
    rows, columns = w.shape
    group = scheme.group_size
    hessian = statistics["hessian"].to(w.device, torch.float64).clone()
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
        scale, zero = _group_grid(block)
        scales[:, first // group], zeros[:, first // group] = scale, zero
        errors = torch.zeros_like(block)
        for j in range(group):
            column = block[:, j]
            level = torch.round(column / scale + zero).clamp_(0, _UINT4_MAX)
            q[:, first + j] = level.to(torch.uint8)
            error = (column - (level - zero) * scale) / block_inverse[j, j]
            block[:, j:] -= error[:, None] * block_inverse[j, j:][None, :]
            errors[:, j] = error
        w[:, last:] -= errors @ inverse[first:last, last:]
    return {"qweight": pack_int4(q), "scale": scales.to(torch.float32), "zero": zeros.to(torch.uint8)}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values in [0, 15] → uint8 ``[N, K/2]``: ``k = 2j`` in the low nibble of byte ``j``."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 ``[N, K/2]`` → uint8 ``[N, K]``."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, x_scale)``: float8_e4m3fn values and one float32 scale per token (the last dim reduced)."""
    x32 = x.to(torch.float32)
    scale = _safe(x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX)
    return (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, x_scale)``: int8 values in [-127, 127] and one scale per token (the last dim reduced), in
    ``x``'s float dtype: ``x ≈ x_q · x_scale``, ``x_scale = max|x[t]| / 127``."""
    scale = _safe(x.abs().amax(dim=-1, keepdim=True) / _INT8_MAX)
    return torch.round(x / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8), scale


def fake_quantize_activations_int8(x: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """``x`` through the smoothquant op's rounding, in ``x``'s dtype, for a layer holding its effective weight
    ``w · diag(s) · diag(smooth)``: ``Q(x · smooth) / smooth`` (what verification's reference applies)."""
    smoothed = x.to(torch.float32) * smooth.to(x.device, torch.float32)
    x_q, scale = quantize_activations_int8(smoothed)
    return (x_q.to(torch.float32) * scale / smooth.to(x.device, torch.float32)).to(x.dtype)


def quantize_activations_fp8_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values of ``x / input_scale`` (one float32 scale ``[1]`` for every token), saturated at ±448."""
    return (x.to(torch.float32) / input_scale.to(x.device, torch.float32)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fake_quantize_activations_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` through the fp8 op's activation rounding, in ``x``'s dtype (what verification's reference applies):
    per token, or with the layer's static ``input_scale``."""
    if input_scale is not None:
        return (quantize_activations_fp8_static(x, input_scale).to(torch.float32) * input_scale.to(x.device)).to(x.dtype)
    x_q, scale = quantize_activations_fp8(x)
    return (x_q.to(torch.float32) * scale).to(x.dtype)


def _check_linear(name: str, x: torch.Tensor, rows: int, columns: int, bias: Optional[torch.Tensor]) -> None:
    if x.shape[-1] != columns or (bias is not None and bias.shape != (rows,)):
        raise ValueError(
            f"{name}: x {tuple(x.shape)} needs K={columns} and bias [N={rows}]; "
            f"got bias {None if bias is None else tuple(bias.shape)}."
        )


def int8_wo_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``F.linear(x, qweight · scale[:, None], bias)``: int8 weights ``[N, K]`` with a float32 scale per output
    channel ``[N]``; returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    _check_linear("int8_wo_linear", x, qweight.shape[0], qweight.shape[1], bias)
    dtype = compute_dtype(x.dtype)
    weight = dequantize_weight(QuantScheme("int8_wo"), {"qweight": qweight, "scale": scale}, dtype)
    return F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype)).to(x.dtype)


def int4_wo_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``F.linear(x, (q − zero) · scale, bias)`` over packed 4-bit weights: ``qweight`` uint8 ``[N, K/2]``,
    ``scale`` float32 and ``zero`` uint8 ``[N, K/G]`` for groups of ``G = K / scale.shape[1]`` inputs;
    returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    rows, columns = qweight.shape[0], 2 * qweight.shape[1]
    _check_linear("int4_wo_linear", x, rows, columns, bias)
    if scale.shape != zero.shape or scale.dim() != 2 or scale.shape[0] != rows or columns % scale.shape[1]:
        raise ValueError(
            f"int4_wo_linear: scale and zero must be [N={rows}, K/G] with G dividing K={columns}; "
            f"got {tuple(scale.shape)} and {tuple(zero.shape)}."
        )
    dtype = compute_dtype(x.dtype)
    stored = {"qweight": qweight, "scale": scale, "zero": zero}
    weight = dequantize_weight(QuantScheme("int4_wo", group_size=columns // scale.shape[1]), stored, dtype)
    return F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype)).to(x.dtype)


def int4_awq_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, smooth: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """``int4_wo_linear(x · smooth, …)``: AWQ's 4-bit weights of ``w · diag(1 / smooth)`` over inputs scaled by
    ``smooth`` float32 ``[K]``; returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    if smooth.shape != (x.shape[-1],):
        raise ValueError(f"int4_awq_linear: smooth must be [K={x.shape[-1]}]; got {tuple(smooth.shape)}.")
    dtype = compute_dtype(x.dtype)
    smoothed = x.to(dtype) * smooth.to(dtype)
    return int4_wo_linear_reference(smoothed, qweight, scale, zero, None if bias is None else bias.to(dtype)).to(x.dtype)


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``F.linear(x_q · x_scale, qweight · scale, bias)``: float8_e4m3fn weights ``[N, K]`` with float32 scales
    per output channel ``[N]`` or per tensor ``[1]``, activations quantized to float8_e4m3fn per token here;
    returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    _check_linear("fp8_linear", x, qweight.shape[0], qweight.shape[1], bias)
    dtype = compute_dtype(x.dtype)
    x_q, x_scale = quantize_activations_fp8(x)
    activations = x_q.to(dtype) * x_scale.to(dtype)
    weight = dequantize_weight(QuantScheme("fp8"), {"qweight": qweight, "scale": scale}, dtype)
    return F.linear(activations, weight, None if bias is None else bias.to(dtype)).to(x.dtype)


def fp8_static_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``fp8_linear`` with one static activation scale ``input_scale`` float32 ``[1]`` (from calibration) for
    every token: ``F.linear(fp8(x / input_scale) · input_scale, qweight · scale, bias)``; returns ``[..., N]``
    in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    _check_linear("fp8_static_linear", x, qweight.shape[0], qweight.shape[1], bias)
    if input_scale.numel() != 1:
        raise ValueError(f"fp8_static_linear: input_scale must hold one value; got shape {tuple(input_scale.shape)}.")
    dtype = compute_dtype(x.dtype)
    activations = quantize_activations_fp8_static(x, input_scale).to(dtype) * input_scale.to(dtype)
    weight = dequantize_weight(QuantScheme("fp8"), {"qweight": qweight, "scale": scale}, dtype)
    return F.linear(activations, weight, None if bias is None else bias.to(dtype)).to(x.dtype)


def int8_w8a8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, smooth: Optional[torch.Tensor], bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """SmoothQuant's W8A8 linear: ``x · smooth`` quantized to int8 per token (``quantize_activations_int8``),
    times the int8 weights ``[N, K]``, the int32 sums scaled by the token's and the output channel's scale
    ``[N]``; returns ``[..., N]`` in ``x``'s dtype. ``smooth`` None: ``x`` arrives smoothed (the
    ``fold_smoothing`` transform moved the factors into the op before, or a W8A8 checkpoint into its norms).
    The rounding is computed in float32 (float64 for float64 x), the sums exactly (float64 holds them)."""
    _check_linear("int8_w8a8_linear", x, qweight.shape[0], qweight.shape[1], bias)
    if smooth is not None and smooth.shape != (x.shape[-1],):
        raise ValueError(f"int8_w8a8_linear: smooth must be [K={x.shape[-1]}]; got {tuple(smooth.shape)}.")
    smoothed = x.to(compute_dtype(x.dtype))
    x_q, x_scale = quantize_activations_int8(smoothed if smooth is None else smoothed * smooth.to(smoothed.dtype))
    sums = F.linear(x_q.to(torch.float64), qweight.to(torch.float64))
    out = sums * x_scale.to(torch.float64) * scale.to(torch.float64)
    return (out if bias is None else out + bias.to(torch.float64)).to(x.dtype)


def _linear_fake(x, qweight, *rest):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def _int4_fake(x, qweight, scale, zero, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


_W = torch.linspace(-1.0, 1.0, 32).reshape(4, 8)  # the example inputs register_op checks the fake against
_STATISTICS = {"mean_abs": torch.linspace(0.5, 2.0, 8), "mean_square": torch.linspace(0.5, 4.0, 8),
               "max_abs": torch.linspace(1.0, 8.0, 8)}
_INT8, _INT4, _AWQ, _FP8, _SMOOTH = (quantize_weight(QuantScheme(name, group_size=4), _W, _STATISTICS)
                                     for name in ("int8_wo", "int4_wo", "int4_awq", "fp8", "smoothquant"))
_FP8_STATIC = quantize_weight(QuantScheme("fp8", static_activations=True), _W, _STATISTICS)
int8_wo_linear = register_op(
    "int8_wo_linear", int8_wo_linear_reference, _linear_fake,
    example_inputs=(torch.ones(2, 8), _INT8["qweight"], _INT8["scale"], torch.zeros(4)),
)
int4_wo_linear = register_op(
    "int4_wo_linear", int4_wo_linear_reference, _int4_fake,
    example_inputs=(torch.ones(2, 8), _INT4["qweight"], _INT4["scale"], _INT4["zero"], None),
)
int4_awq_linear = register_op(
    "int4_awq_linear", int4_awq_linear_reference, lambda x, qweight, scale, zero, smooth, bias: _int4_fake(x, qweight, scale, zero, bias),
    example_inputs=(torch.ones(2, 8), _AWQ["qweight"], _AWQ["scale"], _AWQ["zero"], _AWQ["smooth"], None),
)
fp8_linear = register_op(
    "fp8_linear", fp8_linear_reference, _linear_fake,
    example_inputs=(torch.ones(2, 8), _FP8["qweight"], _FP8["scale"], torch.zeros(4)),
)
fp8_static_linear = register_op(
    "fp8_static_linear", fp8_static_linear_reference, lambda x, qweight, scale, input_scale, bias: _linear_fake(x, qweight),
    example_inputs=(torch.ones(2, 8), _FP8_STATIC["qweight"], _FP8_STATIC["scale"], _FP8_STATIC["input_scale"], torch.zeros(4)),
)
int8_w8a8_linear = register_op(
    "int8_w8a8_linear", int8_w8a8_linear_reference, lambda x, qweight, scale, smooth, bias: _linear_fake(x, qweight),
    example_inputs=(torch.ones(2, 8), _SMOOTH["qweight"], _SMOOTH["scale"], _SMOOTH["smooth"], torch.zeros(4)),
)
OPS = {"int8_wo": torch.ops.autodeploy.int8_wo_linear.default, "int4_wo": torch.ops.autodeploy.int4_wo_linear.default,
       "int4_awq": torch.ops.autodeploy.int4_awq_linear.default, "int4_gptq": torch.ops.autodeploy.int4_wo_linear.default,
       "fp8": torch.ops.autodeploy.fp8_linear.default, "smoothquant": torch.ops.autodeploy.int8_w8a8_linear.default}


def int8_wo_linear_torch(x, qweight, scale, bias):
    """gpt-fast's int8 weight-only linear: ``F.linear(x, qweight.to(x.dtype)) * scale`` in ``x``'s dtype."""
    out = F.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


def _native_dtype_supports(x, qweight, *rest, device):
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"computes in x's own dtype, one of float32/float16/bfloat16 (x is {x.dtype})"
    bias = rest[-1]
    if bias is not None and bias.dtype != x.dtype:
        return f"bias dtype {bias.dtype} differs from x's {x.dtype}"
    return True


def int4_wo_linear_torch(x, qweight, scale, zero, bias):
    """The weight dequantized into ``x``'s dtype, then ``F.linear`` (cuBLAS on GPUs): a weight-sized temporary
    a call, the fallback for row counts past the dequantising GEMV's."""
    group_size = 2 * qweight.shape[1] // scale.shape[1]
    weight = dequantize_weight(QuantScheme("int4_wo", group_size=group_size), {"qweight": qweight, "scale": scale, "zero": zero}, x.dtype)
    return F.linear(x, weight, bias)


register_backend("int8_wo_linear", "torch", int8_wo_linear_torch, supports=_native_dtype_supports)
register_backend("int4_wo_linear", "torch", int4_wo_linear_torch, supports=_native_dtype_supports)
register_backend("int4_awq_linear", "torch", lambda x, qweight, scale, zero, smooth, bias: int4_wo_linear_torch(
    x * smooth.to(x.dtype), qweight, scale, zero, bias), supports=_native_dtype_supports)


def scaled_mm_rows(x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The fp8 linears' product once the activations' rows are quantized (``x_q [..., K]`` e4m3, ``x_scale``
    one float32 scale a row): ``torch._scaled_mm`` with row-wise scales, the bias added; ``[..., N]`` in ``dtype``."""
    out_features = qweight.shape[0]
    weight_scale = scale.reshape(1, -1).expand(1, out_features).contiguous()
    out = torch._scaled_mm(x_q.reshape(-1, x_q.shape[-1]), qweight.t(), scale_a=x_scale.reshape(-1, 1),
                           scale_b=weight_scale, out_dtype=dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x_q.shape[:-1], out_features)


def fp8_linear_torch(x, qweight, scale, bias):
    """``fp8_linear`` with ``torch._scaled_mm`` (CUTLASS/cuBLASLt on Hopper): activations quantized per token
    here, the product scaled by the token's and the output channel's scales (row-wise scaling)."""
    x_q, x_scale = quantize_activations_fp8(x)
    return scaled_mm_rows(x_q, x_scale, qweight, scale, bias, x.dtype)


@functools.cache
def _cpu_takes_row_wise_scales() -> bool:
    """Whether this PyTorch's CPU ``torch._scaled_mm`` takes per-row scales (2.11's oneDNN path takes
    per-tensor scales only): a 16×16 product tried once."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def scaled_mm_supports(dtype: torch.dtype, qweight: torch.Tensor, bias: Optional[torch.Tensor], device: torch.device):
    """Whether ``torch._scaled_mm`` with row-wise scales computes an fp8 linear writing ``dtype`` on
    ``device``: True, or why not."""
    if device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 9):
            return "float8 matmuls need compute capability 8.9 or later (Ada, Hopper)"
        if dtype != torch.bfloat16:
            return f"row-wise scaled fp8 matmuls on CUDA write bfloat16 (the output is {dtype})"
        if qweight.shape[0] % 16 or qweight.shape[1] % 16:
            return f"needs N and K multiples of 16 (weight {tuple(qweight.shape)})"
    elif dtype not in (torch.float32, torch.bfloat16):
        return f"computes in float32 or bfloat16 (the output is {dtype})"
    elif not _cpu_takes_row_wise_scales():
        return f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only, not per-token"
    if bias is not None and bias.dtype != dtype:
        return f"bias dtype {bias.dtype} differs from the output's {dtype}"
    return True


def _fp8_scaled_mm_supports(x, qweight, scale, bias, *, device):
    return scaled_mm_supports(x.dtype, qweight, bias, device)


register_backend("fp8_linear", "torch", fp8_linear_torch, supports=_fp8_scaled_mm_supports)


def fp8_static_linear_torch(x, qweight, scale, input_scale, bias):
    """``fp8_static_linear`` with ``torch._scaled_mm``: activations quantized with the layer's one scale, passed
    row-wise (every row the same) beside the weight's row-wise scales."""
    rows = x.reshape(-1, qweight.shape[1])
    x_scale = input_scale.reshape(1, 1).to(torch.float32).expand(rows.shape[0], 1).contiguous()
    return scaled_mm_rows(quantize_activations_fp8_static(x, input_scale), x_scale, qweight, scale, bias, x.dtype)


register_backend("fp8_static_linear", "torch", fp8_static_linear_torch,
                 supports=lambda x, qweight, scale, input_scale, bias, *, device: _fp8_scaled_mm_supports(x, qweight, scale, bias, device=device))


# cuBLASLt's int8 GEMM takes more than 16 rows, and K and N multiples of 8: decode rows are padded up.
_INT_MM_MIN_ROWS = 17


def int8_w8a8_linear_torch(x, qweight, scale, smooth, bias):
    """``int8_w8a8_linear`` with ``torch._int_mm`` (int8 × int8 → int32: cuBLASLt on GPUs, oneDNN on CPUs): the
    activations quantized per token here, the sums scaled in float32."""
    out_features, in_features = qweight.shape
    rows = x.reshape(-1, in_features)
    x_q, x_scale = quantize_activations_int8(rows.to(torch.float32) if smooth is None else rows.to(torch.float32) * smooth)
    padding = _INT_MM_MIN_ROWS - x_q.shape[0] if x.device.type == "cuda" else 0
    if padding > 0:
        x_q = F.pad(x_q, (0, 0, 0, padding))
    sums = torch._int_mm(x_q, qweight.t())[: rows.shape[0]]
    out = (sums.to(torch.float32) * x_scale * scale).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out_features)


def _int_mm_supports(x, qweight, scale, smooth, bias, *, device):
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"writes float32/float16/bfloat16 (x is {x.dtype})"
    if device.type == "cuda" and (qweight.shape[0] % 8 or qweight.shape[1] % 8):
        return f"cuBLASLt's int8 GEMM needs N and K multiples of 8 (weight {tuple(qweight.shape)})"
    if bias is not None and bias.dtype != x.dtype:
        return f"bias dtype {bias.dtype} differs from x's {x.dtype}"
    return True


register_backend("int8_w8a8_linear", "torch", int8_w8a8_linear_torch, supports=_int_mm_supports)
