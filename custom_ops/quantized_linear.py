"""Quantized projections: the scheme interface, its registry, and what every scheme shares.

A quantization scheme is one class in one file of ``custom_ops/quantization/`` (``int8_wo.py``,
``int4_wo.py``, ``int4_awq.py``, ``int4_gptq.py``, ``fp8.py``, ``smoothquant.py``): a :class:`QuantMethod`
registered by name with :func:`register_scheme`, beside the canonical ops and kernels it computes with.
It says everything the pipeline asks of a scheme, so no pass, loader or writer branches on a scheme's name:

- :meth:`~QuantMethod.quantize` / :meth:`~QuantMethod.dequantize`: a float weight ``w[N, K]`` (``nn.Linear``
  layout) to the tensors the scheme stores, by role (``qweight``, ``scale``, …), and back;
- :meth:`~QuantMethod.op`: the canonical op computing with them (``expert_ops``: MoE experts' ops, if any);
- :meth:`~QuantMethod.statistics`: the calibration statistics ``quantize`` takes (none: not calibrated);
- :meth:`~QuantMethod.row_wise_ops` / :meth:`~QuantMethod.row_scaled_ops`: which of its ops ``fuse_gemms``
  may concatenate along output rows and ``fold_smoothing`` may scale per row;
- :meth:`~QuantMethod.round_input`: the rounding its op applies to a layer's input (what verification's
  reference applies: fake quantization), or None for weight-only schemes;
- :meth:`~QuantMethod.compressed_tensors_args`, :meth:`~QuantMethod.to_compressed_tensors`,
  :meth:`~QuantMethod.from_compressed_tensors`, :meth:`~QuantMethod.read_compressed_tensors`: its
  compressed-tensors form (``autodeploy quantize`` writes it, ``models/prequantized.py`` reads it).

:class:`QuantScheme` is a scheme's name with its options (``group_size``, ``per_channel``, ``alpha``,
``static_activations``): the value settings, records and checkpoints carry; ``scheme.method`` is the
registered class. :func:`quantize_weight` and :func:`dequantize_weight` convert (MoE experts' ``[E, N, K]``
weights expert by expert); each op's reference dequantizes and computes in float32 (float64 for float64
inputs), so it is exact up to the scheme's declared rounding.

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

import abc
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from autodeploy.errors import ConfigError

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127.0
UINT4_MAX = 15


class QuantMethod(abc.ABC):
    """One quantization scheme's behaviour; subclasses set ``name`` and register with :func:`register_scheme`.
    Every method takes the :class:`QuantScheme` (the name and its options) it serves."""

    name: str = ""
    # MoE experts' [E, N, K] weights: the names of the ``moe`` and ``moe_expert_parallel`` ops over the scheme's
    # storage (``custom_ops/quantized_moe.py``); None when experts cannot take the scheme.
    expert_ops: tuple[str, str] | None = None

    def statistics(self, scheme: QuantScheme) -> frozenset[str]:
        """The calibration statistics of the layer's input that :meth:`quantize` takes (``mean_abs``,
        ``mean_square``, ``max_abs``, ``weight_max_abs``, ``hessian``: ``transforms/calibration.py``); empty when
        the scheme does not calibrate."""
        return frozenset()

    def check_shape(self, scheme: QuantScheme, shape: tuple[int, ...]) -> str | None:
        """Why a weight of ``shape`` (2-D, or MoE experts' 3-D) cannot take this scheme, or None."""
        return None

    def check_device(self, scheme: QuantScheme, device: torch.device) -> str | None:
        """Why ``device`` cannot run this scheme's op, or None."""
        return None

    @abc.abstractmethod
    def quantize(self, scheme: QuantScheme, w: torch.Tensor, statistics: dict[str, torch.Tensor] | None
                 ) -> dict[str, torch.Tensor]:
        """The tensors stored for a float32 ``w[N, K]`` (on the meta device: shapes only), by role."""

    @abc.abstractmethod
    def dequantize(self, scheme: QuantScheme, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``w[N, K]`` in ``dtype`` as the scheme's op sees it."""

    @abc.abstractmethod
    def op(self, scheme: QuantScheme):
        """The canonical op computing ``op(x, *stored tensors in quantize's order, bias)``."""

    def row_wise_ops(self) -> dict[Any, tuple[int, ...]]:
        """Ops of this scheme whose every tensor after ``x`` holds a row per output feature (so projections
        over one input fuse by concatenating them: ``fuse_gemms``), with the argument indices that hold a
        per-input tensor instead and must be None for that."""
        return {}

    def row_scaled_ops(self) -> dict[Any, int]:
        """Ops of this scheme whose output rows carry one scale each: the argument index of that ``[N]``
        tensor (``fold_smoothing`` scales it to absorb a factor per output)."""
        return {}

    def round_input(self, scheme: QuantScheme, stored: dict[str, torch.Tensor]
                    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``x`` → ``x`` through the op's own rounding of its input, in ``x``'s dtype (fake quantization, which
        verification's reference applies), for a layer holding ``stored``; None when the op computes with the
        input as it is (weight-only schemes)."""
        return None

    def compressed_tensors_args(self, scheme: QuantScheme) -> tuple[Any, Any, str] | None:
        """``(weights, input_activations, format)`` of the compressed-tensors group that stores this scheme
        (``QuantizationArgs``, ``QuantizationArgs`` or None, a format name), or None when the format has no form
        for it (``autodeploy quantize`` then refuses it)."""
        return None

    def to_compressed_tensors(self, scheme: QuantScheme, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's tensors as compressed-tensors stores them, by leaf name (``weight_packed``, …). Asked only of
        a scheme whose ``compressed_tensors_args`` is not None: ``autodeploy quantize`` refuses the others first."""
        raise TypeError(f"{self.name} has no compressed-tensors form (compressed_tensors_args is None); refuse it before writing")

    def from_compressed_tensors(self, weights, inputs, fmt: str, where: str) -> tuple[QuantScheme, str | None] | None:
        """``(scheme, note)`` when a compressed-tensors group of ``weights`` / ``inputs`` (``QuantizationArgs``)
        in format ``fmt`` is this scheme (``note``: what is served differently from the checkpoint's intent);
        else None. ``where`` names the group in errors."""
        return None

    def read_compressed_tensors(self, layer) -> dict[str, torch.Tensor]:
        """Our stored tensors from a compressed-tensors layer's (``quantized_tensors.CheckpointLayer``). Asked only of
        a scheme whose ``from_compressed_tensors`` recognised the layer's group."""
        raise TypeError(f"{self.name} reads no compressed-tensors group (from_compressed_tensors recognises none)")


_METHODS: dict[str, QuantMethod] = {}


def register_scheme(cls: type[QuantMethod]) -> type[QuantMethod]:
    """Class decorator: register a :class:`QuantMethod` under its ``name`` (``quantize.default: <name>``)."""
    if not cls.name or cls.name == "none" or cls.name in _METHODS:
        raise ValueError(f"quantization scheme name {cls.name!r} is empty, reserved or taken; choose another")
    _METHODS[cls.name] = cls()
    return cls


def scheme_names() -> tuple[str, ...]:
    """The registered schemes' names, in registration order."""
    return tuple(_METHODS)


@dataclass(frozen=True)
class QuantScheme:
    """A weight scheme and its options: ``group_size`` (``int4_*``), ``per_channel`` and
    ``static_activations`` (``fp8``), ``alpha`` (``smoothquant``: how much of the activations' range moves
    into the weights)."""

    name: str
    group_size: int = 128
    per_channel: bool = True
    alpha: float = 0.5
    static_activations: bool = False

    def __post_init__(self):
        if self.name not in _METHODS:
            raise ValueError(f"unknown quantization scheme {self.name!r}; schemes: {', '.join(_METHODS)}, none.")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"int4_wo group_size must be an even number ≥ 2; got {self.group_size}.")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"smoothquant alpha must lie in [0, 1]; got {self.alpha}.")

    @property
    def method(self) -> QuantMethod:
        """The registered class of this scheme."""
        return _METHODS[self.name]

    @property
    def statistics(self) -> frozenset[str]:
        """The calibration statistics :func:`quantize_weight` takes for this scheme (empty: none)."""
        return self.method.statistics(self)

    @property
    def calibrated(self) -> bool:
        """Whether :func:`quantize_weight` takes the layer's input statistics (from calibration)."""
        return bool(self.statistics)

    @property
    def op(self):
        """The canonical op that computes with this scheme's storage."""
        return self.method.op(self)

    def expert_op(self, expert_parallel: bool = False):
        """The MoE op over experts stored in this scheme (``moe_expert_parallel``'s variant when ``expert_parallel``)."""
        names = self.method.expert_ops
        if names is None:
            raise ValueError(f"MoE experts take {' or '.join(expert_scheme_names())}, not {self.name}")
        return getattr(torch.ops.autodeploy, names[expert_parallel]).default

    def check_shape(self, shape: tuple[int, ...]) -> str | None:
        """Why a ``[N, K]`` weight (or MoE experts' ``[E, N, K]``) cannot take this scheme, or None."""
        if len(shape) == 3 and self.method.expert_ops is None:
            return f"MoE experts take {' or '.join(expert_scheme_names())}, not {self.name}"
        if len(shape) not in (2, 3):
            return f"a {self.name} weight must be 2-D [N, K] (or MoE experts' [E, N, K]); got {tuple(shape)}"
        return self.method.check_shape(self, tuple(shape))


def expert_scheme_names() -> tuple[str, ...]:
    """The schemes MoE experts' ``[E, N, K]`` weights can take (weight-only, expert by expert)."""
    return tuple(name for name, method in _METHODS.items() if method.expert_ops is not None)


def row_wise_ops() -> dict[Any, tuple[int, ...]]:
    """Every registered scheme's :meth:`QuantMethod.row_wise_ops`."""
    return {op: columns for method in _METHODS.values() for op, columns in method.row_wise_ops().items()}


def row_scaled_ops() -> dict[Any, int]:
    """Every registered scheme's :meth:`QuantMethod.row_scaled_ops`."""
    return {op: index for method in _METHODS.values() for op, index in method.row_scaled_ops().items()}


def safe_scale(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero row or group quantizes to zeros with scale 1 instead of dividing by zero.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_weight(scheme: QuantScheme, weight: torch.Tensor, statistics: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The tensors ``scheme`` stores for ``weight[N, K]`` (MoE experts: ``[E, N, K]``), by role; a calibrated
    scheme takes the layer's input ``statistics`` (:attr:`QuantScheme.statistics` names them, ``[K]`` each)."""
    problem = scheme.check_shape(tuple(weight.shape))
    if problem:
        raise ValueError(problem)
    if weight.dim() == 3:  # MoE experts: each expert's [N, K] as the rows of one [E·N, K] weight
        experts = weight.shape[0]
        stored = quantize_weight(scheme, weight.reshape(-1, weight.shape[-1]))
        return {role: tensor.reshape(experts, -1, *tensor.shape[1:]) for role, tensor in stored.items()}
    return scheme.method.quantize(scheme, weight.detach().to(torch.float32), statistics)


def dequantize_weight(scheme: QuantScheme, stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w[N, K]`` (MoE experts: ``[E, N, K]``) in ``dtype`` as the scheme's op sees it (``int4_awq``: with
    its smoothing folded back in)."""
    if stored["qweight"].dim() == 3:
        experts = stored["qweight"].shape[0]
        flat = dequantize_weight(scheme, {role: t.reshape(-1, *t.shape[2:]) for role, t in stored.items()}, dtype)
        return flat.reshape(experts, -1, flat.shape[-1])
    return scheme.method.dequantize(scheme, stored, dtype)


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
    scale = safe_scale(x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX)
    return (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, x_scale)``: int8 values in [-127, 127] and one scale per token (the last dim reduced), in
    ``x``'s float dtype: ``x ≈ x_q · x_scale``, ``x_scale = max|x[t]| / 127``."""
    scale = safe_scale(x.abs().amax(dim=-1, keepdim=True) / INT8_MAX)
    return torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_activations_fp8_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values of ``x / input_scale`` (one float32 scale ``[1]`` for every token), saturated at ±448."""
    return (x.to(torch.float32) / input_scale.to(x.device, torch.float32)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def check_linear(name: str, x: torch.Tensor, rows: int, columns: int, bias: Optional[torch.Tensor]) -> None:
    if x.shape[-1] != columns or (bias is not None and bias.shape != (rows,)):
        raise ValueError(
            f"{name}: x {tuple(x.shape)} needs K={columns} and bias [N={rows}]; "
            f"got bias {None if bias is None else tuple(bias.shape)}."
        )


def native_dtype_supports(x, qweight, *rest, device):
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"computes in x's own dtype, one of float32/float16/bfloat16 (x is {x.dtype})"
    bias = rest[-1]
    if bias is not None and bias.dtype != x.dtype:
        return f"bias dtype {bias.dtype} differs from x's {x.dtype}"
    return True



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


def parse_plan(settings) -> tuple[QuantScheme | None, list[tuple[str, QuantScheme | None]]]:
    """(default scheme, [(glob, scheme)]) from the ``quantize`` settings; ``None`` is ``none``. Unknown scheme
    names and bad options are ``ConfigError``s naming the key."""

    def scheme(name, where: str) -> QuantScheme | None:
        if not isinstance(name, str):
            raise ConfigError(f"{where} must be a scheme name; got {name!r}")
        if name == "none":
            return None
        try:
            return QuantScheme(name, group_size=int(settings.int4_group_size), per_channel=settings.fp8_weight_scale == "channel",
                               alpha=float(settings.smoothquant_alpha), static_activations=settings.fp8_activations == "static")
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from error

    if settings.fp8_weight_scale not in ("channel", "tensor"):
        raise ConfigError(f"quantize.fp8_weight_scale must be 'channel' or 'tensor'; got {settings.fp8_weight_scale!r}")
    if settings.fp8_activations not in ("dynamic", "static"):
        raise ConfigError(f"quantize.fp8_activations must be 'dynamic' (a scale per token) or 'static' (one per layer, from "
                          f"calibration); got {settings.fp8_activations!r}")
    rules = [(str(glob), scheme(name, f"quantize.layers[{glob!r}]")) for glob, name in dict(settings.layers).items()]
    return scheme(settings.default, "quantize.default"), rules
