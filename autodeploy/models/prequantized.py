"""Checkpoints that other tools quantized, served without quantizing again: their config read into our
schemes, their tensors into our layouts (``custom_ops/quantized_linear.py``). compressed-tensors groups are
read by the schemes themselves (``QuantMethod.from_compressed_tensors`` / ``read_compressed_tensors`` in
``custom_ops/quantization/``): a new scheme with a compressed-tensors form is read without an edit here.

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

from autodeploy.custom_ops.quantization.fp8 import read_float8
from autodeploy.custom_ops.quantized_linear import QuantScheme, pack_int4, scheme_names
from autodeploy.custom_ops.quantized_tensors import (
    FLOAT_SCALES,
    CheckpointLayer,
    checkpoint_scheme,
    nibbles,
    require_compressed_tensors,
)
from autodeploy.errors import CheckpointError

logger = logging.getLogger(__name__)

MODELOPT_CONFIG = "hf_quant_config.json"
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM layout: the nibble j of a word holds column _AWQ_ORDER[j]


@dataclass
class PrequantizedCheckpoint:
    """What a pre-quantized checkpoint holds. ``method`` names the format in messages; ``rules`` decide each
    linear layer's scheme (the first that matches; None keeps the layer unquantized); ``readers`` convert, per
    scheme name, a layer's tensors as the format stores them into ours (``stored`` calls them)."""

    method: str
    readers: dict[str, Callable[[CheckpointLayer], dict[str, torch.Tensor]]]
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
        read = self.readers[scheme.name]
        try:
            return read(CheckpointLayer(path, dict(tensors), shape, scheme))
        except KeyError as missing:
            raise CheckpointError(f"{self.method} checkpoint: layer {path} has no tensor {path}.{missing.args[0]} "
                                  f"(it has {', '.join(sorted(tensors)) or 'none'})") from None


def _check_trivial_g_idx(layer: CheckpointLayer) -> None:
    g_idx = layer.tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(layer.shape[1]) // layer.scheme.group_size):
        raise CheckpointError(
            f"checkpoint tensor {layer.path}.g_idx reorders the input channels (GPTQ act-order, desc_act=true): "
            f"autodeploy's int4 layout needs contiguous groups; quantize without desc_act, or deploy the float "
            f"checkpoint with quantize.default=int4_gptq"
        )


def _awq(layer: CheckpointLayer) -> dict[str, torch.Tensor]:
    rows, columns = layer.shape
    qweight = layer.tensor("qweight", (torch.int32,), ((columns, rows // 8),))
    qzeros = layer.tensor("qzeros", (torch.int32,), ((layer.groups, rows // 8),))
    scales = layer.tensor("scales", FLOAT_SCALES, ((layer.groups, rows),))
    order = torch.argsort(torch.tensor(_AWQ_ORDER))  # nibble index of each of a word's 8 columns

    def unpacked(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] → [R, N] in column order
        return nibbles(words)[..., order].reshape(words.shape[0], -1)

    return {"qweight": pack_int4(unpacked(qweight).t()), "scale": scales.to(torch.float32).t().contiguous(),
            "zero": unpacked(qzeros).t().contiguous()}


def _gptq(layer: CheckpointLayer, zero_offset: int) -> dict[str, torch.Tensor]:
    rows, columns = layer.shape
    qweight = layer.tensor("qweight", (torch.int32,), ((columns // 8, rows),))
    qzeros = layer.tensor("qzeros", (torch.int32,), ((layer.groups, rows // 8),))
    scales = layer.tensor("scales", FLOAT_SCALES, ((layer.groups, rows),))
    _check_trivial_g_idx(layer)
    q = nibbles(qweight.t()).reshape(rows, columns)  # packed along the inputs: [N, K/8, 8] → [N, K]
    zero = nibbles(qzeros).reshape(layer.groups, rows).t().to(torch.int16) + zero_offset
    if zero.min() < 0 or zero.max() > 15:
        raise CheckpointError(f"checkpoint tensor {layer.path}.qzeros holds zero points outside 0 … 15 once decoded: "
                              f"is quantization_config.checkpoint_format right (gptq stores them minus one, gptq_v2 as they are)?")
    return {"qweight": pack_int4(q), "scale": scales.to(torch.float32).t().contiguous(), "zero": zero.to(torch.uint8)}


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
    readers = {name: QuantScheme(name).method.read_compressed_tensors for name in {ours.name for _, ours in rules}}
    return PrequantizedCheckpoint(f"compressed-tensors ({parsed.format})", readers, rules, notes)


def _compressed_tensors_scheme(scheme, fmt: str, where: str) -> tuple[QuantScheme, str | None]:
    """Our scheme for a compressed-tensors group: the first registered scheme that reads it
    (``QuantMethod.from_compressed_tensors``), with a note on what is served differently."""
    weights, inputs = scheme.weights, scheme.input_activations
    described = f"{where} (format {fmt}, weights {weights}, input activations {inputs})"
    if weights is None or scheme.output_activations is not None:
        raise CheckpointError(f"{described}: autodeploy serves weight quantization (with or without input activations); "
                              f"this group has {'no weights' if weights is None else 'output activations'}")
    for name in scheme_names():
        found = QuantScheme(name).method.from_compressed_tensors(weights, inputs, fmt, where)
        if found is not None:
            return found
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
    return checkpoint_scheme("int4_wo", where, group_size=group)


def _awq_config(config: dict) -> PrequantizedCheckpoint:
    where = "quantization_config (awq)"
    scheme = _int4_group(config, where)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm" or config.get("zero_point", True) is not True:
        raise CheckpointError(f"{where}: version {version!r}, zero_point {config.get('zero_point')!r}; autodeploy reads "
                              f"AutoAWQ's GEMM layout with zero points (version: gemm, zero_point: true)")
    excluded = list(config.get("modules_to_not_convert") or [])
    return PrequantizedCheckpoint("AutoAWQ (gemm)", {"int4_wo": _awq}, [(_within_decoder_blocks(excluded), scheme)])


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
    return PrequantizedCheckpoint(f"GPTQ ({layout})", {"int4_wo": lambda layer: _gptq(layer, 1 if layout == "gptq" else 0)}, [(_within_decoder_blocks(excluded), scheme)])


def _modelopt(config: dict) -> PrequantizedCheckpoint:
    where = f"NVIDIA ModelOpt quantization ({MODELOPT_CONFIG} or quant_method modelopt)"
    algorithm = str(config.get("quant_algo"))
    schemes = {"FP8": checkpoint_scheme("fp8", where, per_channel=False, static_activations=True),
               "FP8_PER_CHANNEL_PER_TOKEN": checkpoint_scheme("fp8", where)}
    if algorithm not in schemes:
        raise CheckpointError(f"{where}: quant_algo {algorithm!r}; autodeploy reads {', '.join(schemes)}")
    excluded = [str(glob) for glob in config.get("exclude_modules") or []]
    notes = []
    if config.get("kv_cache_quant_algo"):
        notes.append(f"kv_cache_quant_algo {config['kv_cache_quant_algo']} applies only with quantize.kv_cache: fp8 (which "
                     f"then takes its k_scale / v_scale)")

    def matches(path: str, module: nn.Module | None) -> bool:
        return isinstance(module, nn.Linear) and not any(fnmatch.fnmatchcase(path, glob) for glob in excluded)

    return PrequantizedCheckpoint(f"ModelOpt ({algorithm})", {"fp8": read_float8}, [(matches, schemes[algorithm])], notes)

