"""``autodeploy quantize MODEL --out DIR``: a Hugging Face checkpoint folder whose linear layers hold the
quantize stage's weights, described by a ``quantization_config`` in the compressed-tensors format (what
llm-compressor writes and vLLM reads). ``autodeploy(DIR)`` serves it without quantizing again
(``models/prequantized.py``), so int4_gptq's calibration, say, runs once.

The pipeline runs up to and including ``load_weights`` (export on meta, match, quantize, weights streamed
in and quantized). Each quantized layer is written as compressed-tensors stores its scheme; the tensors
are packed and the config built with the ``compressed-tensors`` package:

Each scheme says how (``QuantMethod.compressed_tensors_args`` and ``to_compressed_tensors`` in
``custom_ops/quantization/``):

| our scheme | compressed-tensors group | tensors |
|---|---|---|
| ``fp8`` | float-quantized; weights fp8 per channel or tensor; input activations fp8, dynamic per token or static per tensor | ``weight`` (float8_e4m3fn), ``weight_scale`` (and ``input_scale`` when static) |
| ``int8_wo`` | pack-quantized; weights int8 per channel, symmetric | ``weight_packed``, ``weight_scale``, ``weight_shape`` |
| ``int4_wo``, ``int4_gptq`` | pack-quantized; weights int4 per group, asymmetric | ``weight_packed``, ``weight_scale``, ``weight_zero_point``, ``weight_shape`` |

``int4_awq`` and ``smoothquant`` are refused before any work: their per-input smoothing has no field in
the format; so is ``quantize.experts`` other than ``none``. A MoE model's dense layers (attention, shared
experts, gates the quantize stage takes) are written under their schemes, its experts as the model holds them.
Every other parameter is
written as the model holds it, under its Hugging Face name; the tokenizer and generation config are copied.
The folder is written beside ``DIR`` and renamed to it when complete: a run that fails or is killed leaves
no partial checkpoint there.

    quantize_checkpoint("path/to/llama", "llama-int4", quantize={"default": "int4_gptq"})
    llm = autodeploy("llama-int4")      # int4_wo layers, nothing recalibrated
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from autodeploy.errors import ConfigError
from autodeploy.export.causal_lm import GRAPH_PREFIX

logger = logging.getLogger(__name__)


def quantize_checkpoint(model: str, out: str | Path, config: Iterable[str | Path] = (), set_arguments: Iterable[str] = (),
                        **overrides: Any) -> Path:
    """Quantize ``model``'s checkpoint as the ``quantize`` settings say and write it to ``out`` (a new or
    empty folder). Returns ``out``."""
    from autodeploy.api import deployment_settings
    from autodeploy.custom_ops.quantized_linear import QuantScheme, parse_plan, scheme_names
    from autodeploy.models.factory import config_dtype
    from autodeploy.models.prequantized import require_compressed_tensors
    from autodeploy.pipeline import Pipeline
    from autodeploy.transforms.registry import TransformContext

    require_compressed_tensors()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; write the quantized checkpoint to a new or empty folder")
    settings, factory = deployment_settings(model, config, set_arguments, **overrides)
    if settings.weights != "checkpoint":
        raise ConfigError("autodeploy quantize writes a checkpoint's weights quantized; weights=random has none to write")
    if factory.prequantized is not None:
        raise ConfigError(f"{factory.source.name} is already quantized ({factory.prequantized.method}); quantize its float checkpoint")
    default, rules = parse_plan(settings.quantize)
    schemes = {scheme for scheme in [default, *(scheme for _, scheme in rules)] if scheme is not None}
    if settings.quantize.experts != "none":
        raise ConfigError("quantized MoE experts are not written to compressed-tensors yet; set quantize.experts: none "
                          "(the dense layers are written as their schemes say)")
    if settings.quantize.embedding != "none":
        raise ConfigError("an int8 embedding table has no compressed-tensors form (the format quantizes linear layers); "
                          "set quantize.embedding: none here, and quantize.embedding: int8 when deploying the written checkpoint")
    unwritable = sorted({s.name for s in schemes if s.method.compressed_tensors_args(s) is None})
    if unwritable:  # int4_awq and smoothquant: compressed-tensors has no field for their per-input smoothing
        writable = [name for name in scheme_names() if QuantScheme(name).method.compressed_tensors_args(QuantScheme(name))]
        raise ConfigError(f"{' and '.join(unwritable)} store tensors that compressed-tensors has no field for; write "
                          f"{', '.join(writable)} instead")
    nothing = ("the quantize settings quantize no layer (quantize.default is none and no quantize.layers rule names a "
               "scheme that matches one); nothing to write")
    if not schemes:
        raise ConfigError(nothing)
    pipeline = Pipeline.from_settings(settings)
    context = TransformContext(settings=settings, model_factory=factory)
    graph = pipeline.run(context, stop=pipeline.first_index_of_stage("fuse"))
    records = context.quantized_weights
    if not records:
        raise ConfigError(nothing)
    tensors = _float_tensors(graph, records, factory.meta_model, config_dtype(factory.hf_config))
    groups: dict[tuple, list[str]] = {}
    for record in records.values():
        stored = {role: graph.get_parameter(target).detach().cpu() for role, target in record.targets.items()}
        tensors.update({f"{record.path}.{leaf}": tensor
                        for leaf, tensor in record.scheme.method.to_compressed_tensors(record.scheme, stored).items()})
        groups.setdefault(_group_key(record.scheme), []).append(record.path)
    hf_config = factory.hf_config.to_dict()
    hf_config["quantization_config"] = _quantization_config(groups)
    tokenizer = factory.load_tokenizer(settings.tokenizer)
    with _moved_into_place_when_complete(out) as folder:
        _write_weights(tensors, folder)
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))
        if (factory.source.directory / "generation_config.json").is_file():
            shutil.copy2(factory.source.directory / "generation_config.json", folder / "generation_config.json")
    logger.info("wrote %s: %d quantized layers (%s)", out, len(records),
                ", ".join(f"{len(paths)} {fmt}" for (fmt, *_), paths in groups.items()))
    return out


def _float_tensors(graph, records: Mapping, meta_model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every other parameter under its Hugging Face name, in the checkpoint's ``dtype`` (the build may have
    computed in float32), with the model's fused layouts turned back into the checkpoint's (transformers'
    own conversion rules)."""
    from transformers.core_model_loading import revert_weight_conversion

    quantized = {target for record in records.values() for target in record.targets.values()}
    names_of: dict[int, list[str]] = {}
    for name, parameter in graph.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    tensors = {}
    for name, parameter in graph.named_parameters():
        if name in quantized:
            continue
        # Tied weights are stored once, under the embedding's name rather than the LM head's.
        aliases = sorted(names_of[id(parameter)], key=lambda alias: "lm_head" in alias)
        value = parameter.detach().cpu()
        tensors[aliases[0].removeprefix(GRAPH_PREFIX)] = (value.to(dtype) if value.is_floating_point() else value).contiguous()
    try:
        return {name: _owning_its_memory(tensor) for name, tensor in revert_weight_conversion(meta_model, tensors).items()}
    except Exception as error:  # a conversion transformers cannot revert: the model's own names then
        logger.warning("writing the model's own parameter names (transformers could not revert its conversions: %s)", error)
        return tensors


def _owning_its_memory(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor that shares memory it does not cover, else the tensor: transformers reverts a MoE's
    stacked experts to one view per expert, and safetensors refuses views."""
    tensor = tensor.contiguous()
    return tensor if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size() else tensor.clone()


@contextlib.contextmanager
def _moved_into_place_when_complete(out: Path) -> Iterator[Path]:
    """A folder beside ``out`` to write the checkpoint into, renamed to ``out`` once it is complete and removed
    when the writing fails: a failed or killed run leaves no partial checkpoint under ``out``, and the empty
    ``out`` it found stays as it was (a killed run leaves its hidden ``.NAME.partial-PID`` folder beside)."""
    out = out.resolve()  # a name to put the staging folder beside, also for "."
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        try:
            staging.replace(out)  # atomic, over an empty folder too
        except OSError as error:
            raise ConfigError(f"cannot move the written checkpoint into {out} ({error.strerror}); write it to a new or "
                              f"empty folder") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _group_key(scheme) -> tuple[str, str, str]:
    """The compressed-tensors group a layer of ``scheme`` is written in: its format and its weights' and input
    activations' arguments (as JSON, so layers of equal arguments share a group: int4_gptq's with int4_wo's)."""
    weights, inputs, fmt = scheme.method.compressed_tensors_args(scheme)
    return fmt, weights.model_dump_json(), "" if inputs is None else inputs.model_dump_json()


def _quantization_config(groups: dict[tuple[str, str, str], list[str]]) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    schemes, formats = {}, set()
    for index, ((fmt, weights, inputs), paths) in enumerate(sorted(groups.items())):
        formats.add(fmt)
        schemes[f"group_{index}"] = QuantizationScheme(
            targets=sorted(paths), weights=QuantizationArgs.model_validate_json(weights),
            input_activations=QuantizationArgs.model_validate_json(inputs) if inputs else None, format=fmt)
    config = QuantizationConfig(config_groups=schemes, format=formats.pop() if len(formats) == 1 else "mixed-precision",
                                quantization_status="compressed")
    return config.model_dump(mode="json", exclude_none=True)


def _write_weights(tensors: dict[str, torch.Tensor], out: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(tensors, str(out), max_shard_size="5GB", safe_serialization=True)
