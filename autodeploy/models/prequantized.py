"""Checkpoints that other tools quantized, served without quantizing again: their config read into our
schemes, their tensors into our layouts (``custom_ops/quantized_linear.py``).

| format | how it is recognised | weights → scheme |
|---|---|---|
| compressed-tensors (llm-compressor's, vLLM reads it) | ``quantization_config.quant_method: compressed-tensors`` | float-quantized fp8 per channel or tensor → ``fp8``; int-quantized or pack-quantized 8-bit per channel → ``int8_wo``, with int8 activations (W8A8) → ``smoothquant`` (its smoothing already folded into the weights); pack-quantized 4-bit per group → ``int4_wo`` |
| AutoAWQ (GEMM layout) | ``quant_method: awq`` | 4-bit per group with zero points → ``int4_wo`` |
| GPTQ (AutoGPTQ / GPTQModel) | ``quant_method: gptq`` | 4-bit per group, without act-order → ``int4_wo`` |
| NVIDIA ModelOpt (TensorRT-LLM's export) | ``hf_quant_config.json`` (or ``quant_method: modelopt``) | ``FP8`` → ``fp8`` per tensor, static activation scales; ``FP8_PER_CHANNEL_PER_TOKEN`` → ``fp8`` per channel |

The compressed-tensors config is parsed, and its targets and ignore list matched against the model's
modules, by the ``compressed-tensors`` package itself. The AWQ and GPTQ tools quantize every linear layer
of the decoder blocks, less ``modules_to_not_convert``; ModelOpt every linear layer less
``exclude_modules`` (globs). MoE routers and experts, and weights tied to the embedding, stay unquantized
here as everywhere (``transforms/quantize_linear.py``), so a checkpoint that quantized them is refused.

Activations: a layer's static ``input_scale`` (fp8 per tensor) is used as stored; a checkpoint whose fp8
layers leave activations unquantized, or quantize them in another way, is served with fp8 activations
per token, and a warning says so.

    found = detect_prequantized(hf_config, directory)        # None for a float checkpoint
    found.scheme_for("model.layers.0.mlp.down_proj", module)  # QuantScheme("int4_wo", group_size=128)
    stored = found.stored(path, scheme, {"qweight": …, "qzeros": …, "scales": …})  # our int4_wo tensors
"""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from autodeploy.custom_ops.quantized_linear import QuantScheme, pack_int4
from autodeploy.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

MODELOPT_CONFIG = "hf_quant_config.json"
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM layout: the nibble j of a word holds column _AWQ_ORDER[j]


@dataclass
class PrequantizedCheckpoint:
    """What a pre-quantized checkpoint holds. ``method`` names the format in messages; ``rules`` decide each
    linear layer's scheme (the first that matches; None keeps the layer unquantized); ``layouts`` name, per
    scheme, how the format stores it (``stored`` converts)."""

    method: str
    layouts: dict[str, str]
    rules: list[tuple[Callable[[str, nn.Module | None], bool], QuantScheme | None]]
    notes: list[str] = field(default_factory=list)  # what is served differently from the producer's intent

    def scheme_for(self, path: str, module: nn.Module | None) -> QuantScheme | None:
        """The scheme of the linear layer at ``path`` (an HF module path, e.g. ``model.layers.0.mlp.up_proj``)."""
        for matches, scheme in self.rules:
            if matches(path, module):
                return scheme
        return None

    def stored(self, path: str, scheme: QuantScheme, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
               ) -> dict[str, torch.Tensor]:
        """Our ``scheme``'s tensors (``quantize_weight``'s roles) for the layer at ``path`` of weight ``shape``
        ``[N, K]``, from the checkpoint's tensors of that layer by leaf name (``weight_packed``, ``qzeros``, …)."""
        converter = _CONVERTERS[self.layouts[scheme.name]]
        try:
            return converter(_Layer(path, dict(tensors), shape, scheme))
        except KeyError as missing:
            raise CheckpointError(f"{self.method} checkpoint: layer {path} has no tensor {path}.{missing.args[0]} "
                                  f"(it has {', '.join(sorted(tensors)) or 'none'})") from None


@dataclass
class _Layer:
    path: str
    tensors: dict[str, torch.Tensor]
    shape: tuple[int, int]
    scheme: QuantScheme

    def tensor(self, leaf: str, dtypes: tuple[torch.dtype, ...], shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        """``leaf``'s tensor, checked against the dtypes and shapes the format allows here."""
        tensor = self.tensors[leaf]
        if tensor.dtype not in dtypes or tuple(tensor.shape) not in shapes:
            wanted = " or ".join(str(tuple(s)) for s in shapes)
            raise CheckpointError(
                f"checkpoint tensor {self.path}.{leaf} is {str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}, "
                f"but a {self.scheme.name} layer of weight {self.shape} needs {'/'.join(str(d).removeprefix('torch.') for d in dtypes)} "
                f"{wanted}: the quantization_config disagrees with the tensors"
            )
        return tensor

    @property
    def groups(self) -> int:
        return self.shape[1] // self.scheme.group_size


_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)


def require_compressed_tensors() -> None:
    """A clear error where the ``compressed-tensors`` package (a dependency on Python 3.11 and later) is missing."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as error:
        raise ConfigError("compressed-tensors checkpoints are read and written with the compressed-tensors package, "
                          "which is not installed: pip install compressed-tensors (it needs Python 3.11 or later)") from error


def _float8(layer: _Layer) -> dict[str, torch.Tensor]:
    rows, columns = layer.shape
    qweight = layer.tensor("weight", (torch.float8_e4m3fn,), ((rows, columns),))
    scale_shapes = ((rows, 1), (rows,)) if layer.scheme.per_channel else ((), (1,), (1, 1))
    scale = layer.tensor("weight_scale", _FLOAT_SCALES, scale_shapes)
    stored = {"qweight": qweight, "scale": scale.to(torch.float32).reshape(-1)}
    if layer.scheme.static_activations:
        stored["input_scale"] = layer.tensor("input_scale", _FLOAT_SCALES, ((), (1,), (1, 1))).to(torch.float32).reshape(1)
    return stored


def _int8(layer: _Layer) -> dict[str, torch.Tensor]:
    rows, columns = layer.shape
    if "weight_packed" in layer.tensors:  # pack-quantized: four int8 values a word
        require_compressed_tensors()
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        packed = layer.tensor("weight_packed", (torch.int32,), ((rows, -(-columns // 4)),))
        qweight = unpack_from_int32(packed, 8, torch.Size((rows, columns)))
    else:
        qweight = layer.tensor("weight", (torch.int8,), ((rows, columns),))
    scale = layer.tensor("weight_scale", _FLOAT_SCALES, ((rows, 1), (rows,)))
    return {"qweight": qweight, "scale": scale.to(torch.float32).reshape(-1)}


def _int8_w8a8(layer: _Layer) -> dict[str, torch.Tensor]:
    """W8A8: int8 weights, activations quantized per token by the op; llm-compressor folds SmoothQuant's
    smoothing into the preceding weights, so the op's own smoothing is one."""
    return {**_int8(layer), "smooth": torch.ones(layer.shape[1])}


def _packed_int4(layer: _Layer) -> dict[str, torch.Tensor]:
    require_compressed_tensors()
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    rows, columns = layer.shape
    if "weight_shape" in layer.tensors and tuple(int(d) for d in layer.tensors["weight_shape"].tolist()) != layer.shape:
        raise CheckpointError(f"checkpoint tensor {layer.path}.weight_shape says {layer.tensors['weight_shape'].tolist()}, "
                              f"but the model's layer is {list(layer.shape)}: does config.json match these weights?")
    packed = layer.tensor("weight_packed", (torch.int32,), ((rows, -(-columns // 8)),))
    signed = unpack_from_int32(packed, 4, torch.Size((rows, columns)))  # in [-8, 7]
    scale = layer.tensor("weight_scale", _FLOAT_SCALES, ((rows, layer.groups),))
    if "weight_zero_point" in layer.tensors:  # asymmetric: zero points packed along the output dim
        zero_points = layer.tensor("weight_zero_point", (torch.int32,), ((-(-rows // 8), layer.groups),))
        # Unpacked here: compressed-tensors' unpack_from_int32 cannot read one packed row (a gate of fewer than 9
        # outputs, as Qwen2-MoE's shared-expert gate), whose transpose it cannot view as bytes. Nibbles hold value + 8.
        zero = _nibbles(zero_points).transpose(1, 2).reshape(-1, layer.groups)[:rows].to(torch.int16)
    else:
        zero = torch.full((rows, layer.groups), 8, dtype=torch.int16)
    return {"qweight": pack_int4((signed.to(torch.int16) + 8).to(torch.uint8)), "scale": scale.to(torch.float32),
            "zero": zero.to(torch.uint8)}


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` → uint8 ``[R, C, 8]``: nibble ``j`` of each word (bits ``4j … 4j+3``)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _check_trivial_g_idx(layer: _Layer) -> None:
    g_idx = layer.tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(layer.shape[1]) // layer.scheme.group_size):
        raise CheckpointError(
            f"checkpoint tensor {layer.path}.g_idx reorders the input channels (GPTQ act-order, desc_act=true): "
            f"autodeploy's int4 layout needs contiguous groups; quantize without desc_act, or deploy the float "
            f"checkpoint with quantize.default=int4_gptq"
        )


def _awq(layer: _Layer) -> dict[str, torch.Tensor]:
    rows, columns = layer.shape
    qweight = layer.tensor("qweight", (torch.int32,), ((columns, rows // 8),))
    qzeros = layer.tensor("qzeros", (torch.int32,), ((layer.groups, rows // 8),))
    scales = layer.tensor("scales", _FLOAT_SCALES, ((layer.groups, rows),))
    order = torch.argsort(torch.tensor(_AWQ_ORDER))  # nibble index of each of a word's 8 columns

    def unpacked(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] → [R, N] in column order
        return _nibbles(words)[..., order].reshape(words.shape[0], -1)

    return {"qweight": pack_int4(unpacked(qweight).t()), "scale": scales.to(torch.float32).t().contiguous(),
            "zero": unpacked(qzeros).t().contiguous()}


def _gptq(layer: _Layer, zero_offset: int) -> dict[str, torch.Tensor]:
    rows, columns = layer.shape
    qweight = layer.tensor("qweight", (torch.int32,), ((columns // 8, rows),))
    qzeros = layer.tensor("qzeros", (torch.int32,), ((layer.groups, rows // 8),))
    scales = layer.tensor("scales", _FLOAT_SCALES, ((layer.groups, rows),))
    _check_trivial_g_idx(layer)
    q = _nibbles(qweight.t()).reshape(rows, columns)  # packed along the inputs: [N, K/8, 8] → [N, K]
    zero = _nibbles(qzeros).reshape(layer.groups, rows).t().to(torch.int16) + zero_offset
    if zero.min() < 0 or zero.max() > 15:
        raise CheckpointError(f"checkpoint tensor {layer.path}.qzeros holds zero points outside 0 … 15 once decoded: "
                              f"is quantization_config.checkpoint_format right (gptq stores them minus one, gptq_v2 as they are)?")
    return {"qweight": pack_int4(q), "scale": scales.to(torch.float32).t().contiguous(), "zero": zero.to(torch.uint8)}


_CONVERTERS: dict[str, Callable[[_Layer], dict[str, torch.Tensor]]] = {
    "float8": _float8,
    "int8": _int8,
    "int8_w8a8": _int8_w8a8,
    "packed_int4": _packed_int4,
    "awq": _awq,
    "gptq": lambda layer: _gptq(layer, 1),
    "gptq_v2": lambda layer: _gptq(layer, 0),
}


def detect_prequantized(hf_config, directory: Path | None) -> PrequantizedCheckpoint | None:
    """The checkpoint's quantization (see the module docstring), or None for a float checkpoint. A config
    that is malformed, or that names a format or scheme autodeploy does not serve, is a ``CheckpointError``."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    modelopt = Path(directory) / MODELOPT_CONFIG if directory is not None else None
    if config is None and modelopt is not None and modelopt.is_file():
        try:
            config = {"quant_method": "modelopt", **json.loads(modelopt.read_text()).get("quantization", {})}
        except (ValueError, AttributeError) as error:
            raise CheckpointError(f"{modelopt} is not valid JSON with a 'quantization' section ({error})") from error
    if config is None:
        return None
    method = str(config.get("quant_method", "")).lower()
    readers = {"compressed-tensors": _compressed_tensors, "awq": _awq_config, "gptq": _gptq_config, "modelopt": _modelopt}
    if method not in readers:
        raise CheckpointError(
            f"the checkpoint is quantized with quant_method {method or '(none given)'!r}, which autodeploy cannot "
            f"read; it reads {', '.join(readers)}. Deploy the float checkpoint and quantize it here "
            f"(quantize.default: fp8 / int8_wo / int4_wo / int4_awq / int4_gptq)"
        )
    found = readers[method](config)
    for note in found.notes:
        logger.warning("%s checkpoint: %s", found.method, note)
    return found


def _scheme(name: str, where: str, **options) -> QuantScheme:
    try:
        return QuantScheme(name, **options)
    except ValueError as error:
        raise CheckpointError(f"{where}: {error}") from error


def _compressed_tensors(config: dict) -> PrequantizedCheckpoint:
    require_compressed_tensors()
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.utils.match import is_match

    try:
        parsed = QuantizationConfig.model_validate(config)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        raise CheckpointError(f"quantization_config is not a valid compressed-tensors config: {error}") from error
    rules, notes = [], []
    ignore = list(parsed.ignore or [])
    for name, scheme in parsed.config_groups.items():
        if not isinstance(scheme, QuantizationScheme):
            raise CheckpointError(f"quantization_config.config_groups.{name} names a preset ({scheme!r}); autodeploy reads "
                                  f"groups that spell out their weights' quantization")
        fmt = str(scheme.format or parsed.format)
        ours, note = _compressed_tensors_scheme(scheme, fmt, f"quantization_config.config_groups.{name}")
        notes += [note] if note else []
        rules.append((lambda path, module, targets=list(scheme.targets): module is not None and is_match(path, module, targets, ignore),
                      ours))
    if parsed.kv_cache_scheme is not None:
        notes.append("its KV cache scheme applies only with quantize.kv_cache: fp8 (which then takes its k_scale / v_scale)")
    layouts = {"fp8": "float8", "int8_wo": "int8", "int4_wo": "packed_int4", "smoothquant": "int8_w8a8"}
    return PrequantizedCheckpoint(f"compressed-tensors ({parsed.format})", layouts, rules, notes)


def _compressed_tensors_scheme(scheme, fmt: str, where: str) -> tuple[QuantScheme, str | None]:
    weights, inputs = scheme.weights, scheme.input_activations
    described = f"{where} (format {fmt}, weights {weights}, input activations {inputs})"
    if weights is None or scheme.output_activations is not None:
        raise CheckpointError(f"{described}: autodeploy serves weight quantization (with or without input activations); "
                              f"this group has {'no weights' if weights is None else 'output activations'}")
    kind, bits, strategy = str(weights.type), int(weights.num_bits), str(weights.strategy)
    note = None
    if kind == "float" and bits == 8 and strategy in ("channel", "tensor") and fmt in ("float-quantized", "naive-quantized"):
        static = inputs is not None and not inputs.dynamic and str(inputs.strategy) == "tensor"
        if inputs is None or not (static or str(inputs.strategy) == "token"):
            note = f"{where}: activations {'unquantized' if inputs is None else inputs.strategy} in the checkpoint are quantized to fp8 per token at run time"
        return _scheme("fp8", described, per_channel=strategy == "channel", static_activations=static), note
    if kind == "int" and bits == 8 and strategy == "channel" and weights.symmetric and fmt in ("int-quantized", "pack-quantized", "naive-quantized"):
        if inputs is None:
            return _scheme("int8_wo", described), None
        if str(inputs.type) != "int" or int(inputs.num_bits) != 8:
            raise CheckpointError(f"{described}: int8 weights with {inputs.type}{inputs.num_bits} activations; autodeploy "
                                  f"serves int8 weights with int8 activations (W8A8) or unquantized ones")
        if not inputs.dynamic or str(inputs.strategy) != "token":
            note = f"{where}: int8 activations with static scales in the checkpoint are quantized per token at run time"
        return _scheme("smoothquant", described), note  # W8A8; its smoothing is folded into the checkpoint's norms
    if kind == "int" and bits == 4 and strategy == "group" and fmt == "pack-quantized" and inputs is None:
        return _scheme("int4_wo", described, group_size=int(weights.group_size)), None
    raise CheckpointError(
        f"{described}: not a scheme autodeploy serves. It reads fp8 weights per channel or tensor (float-quantized), "
        f"int8 weights per channel (int-quantized, pack-quantized) and int4 weights per group (pack-quantized, no "
        f"activation quantization)"
    )


def _within_decoder_blocks(excluded: list[str]) -> Callable[[str, nn.Module | None], bool]:
    """The linear layers AutoAWQ and GPTQ quantize: every one inside the decoder's repeated blocks (not the LM
    head), less those whose name contains an entry of ``excluded`` (transformers' ``modules_to_not_convert``)."""

    def matches(path: str, module: nn.Module | None) -> bool:
        in_block = any(part.isdigit() for part in path.split("."))
        return in_block and isinstance(module, nn.Linear) and not any(name in path for name in excluded)

    return matches


def _int4_group(config: dict, where: str) -> QuantScheme:
    bits, group = config.get("bits", config.get("w_bit")), config.get("group_size", config.get("q_group_size"))
    if bits != 4:
        raise CheckpointError(f"{where}: bits is {bits!r}; autodeploy reads 4-bit checkpoints of this format")
    if not isinstance(group, int) or group <= 0:
        raise CheckpointError(f"{where}: group_size is {group!r}; autodeploy reads 4-bit checkpoints quantized per group "
                              f"(group_size > 0, e.g. 128)")
    return _scheme("int4_wo", where, group_size=group)


def _awq_config(config: dict) -> PrequantizedCheckpoint:
    where = "quantization_config (awq)"
    scheme = _int4_group(config, where)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm" or config.get("zero_point", True) is not True:
        raise CheckpointError(f"{where}: version {version!r}, zero_point {config.get('zero_point')!r}; autodeploy reads "
                              f"AutoAWQ's GEMM layout with zero points (version: gemm, zero_point: true)")
    excluded = list(config.get("modules_to_not_convert") or [])
    return PrequantizedCheckpoint("AutoAWQ (gemm)", {"int4_wo": "awq"}, [(_within_decoder_blocks(excluded), scheme)])


def _gptq_config(config: dict) -> PrequantizedCheckpoint:
    where = "quantization_config (gptq)"
    scheme = _int4_group(config, where)
    if config.get("desc_act"):
        raise CheckpointError(f"{where}: desc_act is true (act-order reorders the input channels); autodeploy's int4 "
                              f"layout needs contiguous groups. Quantize without desc_act, or deploy the float checkpoint "
                              f"with quantize.default=int4_gptq")
    layout = str(config.get("checkpoint_format", "gptq")).lower()
    if layout not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{where}: checkpoint_format {layout!r}; autodeploy reads gptq and gptq_v2")
    excluded = list(config.get("modules_to_not_convert") or [])
    return PrequantizedCheckpoint(f"GPTQ ({layout})", {"int4_wo": layout}, [(_within_decoder_blocks(excluded), scheme)])


def _modelopt(config: dict) -> PrequantizedCheckpoint:
    where = f"NVIDIA ModelOpt quantization ({MODELOPT_CONFIG} or quant_method modelopt)"
    algorithm = str(config.get("quant_algo"))
    schemes = {"FP8": _scheme("fp8", where, per_channel=False, static_activations=True),
               "FP8_PER_CHANNEL_PER_TOKEN": _scheme("fp8", where)}
    if algorithm not in schemes:
        raise CheckpointError(f"{where}: quant_algo {algorithm!r}; autodeploy reads {', '.join(schemes)}")
    excluded = [str(glob) for glob in config.get("exclude_modules") or []]
    notes = []
    if config.get("kv_cache_quant_algo"):
        notes.append(f"kv_cache_quant_algo {config['kv_cache_quant_algo']} applies only with quantize.kv_cache: fp8 (which "
                     f"then takes its k_scale / v_scale)")

    def matches(path: str, module: nn.Module | None) -> bool:
        return isinstance(module, nn.Linear) and not any(fnmatch.fnmatchcase(path, glob) for glob in excluded)

    return PrequantizedCheckpoint(f"ModelOpt ({algorithm})", {"fp8": "float8"}, [(matches, schemes[algorithm])], notes)

