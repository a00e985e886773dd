"""Write a deployed model to a folder that ``autodeploy(DIR)`` serves without export, transforms or verification.

The folder is written beside its destination and moved into place when complete, so a failed or
interrupted save leaves no half-written deployment; saving over an earlier deployment replaces it. Any
other non-empty folder is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from autodeploy.config import settings_to_yaml
from autodeploy.deployment import EMBED, ENCODER, MODEL, PACKED_TEXTS, VISION, Deployment, as_deployment
from autodeploy.errors import ConfigError
from autodeploy.runtime.speculative import HIDDEN_STATE_LAYERS

from .layout import (BUILD_REPORT, GRAPH, IMAGE_PROCESSOR, SERVING, SETTINGS, SIDE_GRAPHS, TOKENIZER, TUNING, WEIGHTS,
                     is_whole_saved_deployment)
from .graph_archive import SavedGraph, export_embed_graph, export_encoder_graph, export_served_graph, export_vision_graph
from .manifest import Manifest, device_kind, package_versions, file_digest
from .weights_file import save_tensors

logger = logging.getLogger(__name__)


def check_save_destination(directory: Path) -> None:
    """``ConfigError`` unless ``directory`` may receive a deployment (new, empty, or an earlier deployment)."""
    if directory.exists() and (not directory.is_dir() or (any(directory.iterdir()) and not is_whole_saved_deployment(directory))):
        raise ConfigError(f"{directory} exists and is not a saved deployment; save to a new or empty folder")


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def save_deployment(directory: str | Path, deployment: Deployment, *legacy_arguments, **legacy_keywords) -> Path:
    """Write ``deployment`` to ``directory``; returns it. See ``LLM.save``. The form before ``Deployment``
    (``save_deployment(directory, graph, graph_inputs, settings, ...)``, the loose parts of an ``LLM``)
    still works and warns."""
    deployment = as_deployment("save_deployment()", deployment, legacy_arguments, legacy_keywords)
    settings, signature, verification = deployment.settings, deployment.signature, deployment.report.verification
    if str(settings.device) == "meta":
        raise ConfigError("a deploy on the meta device has no weights to save; deploy with device=cpu or cuda, then save")
    embedding = deployment.embedding  # an embedding model's "embed" graph stands where a language model's "model" graph does
    if embedding is None and not signature.kv_caches:
        raise ConfigError("this graph has no KV cache (insert_cached_attention is disabled), so it cannot serve; enable it to save")
    if embedding is not None and not deployment.graphs[EMBED].meta.get(PACKED_TEXTS, False):
        raise ConfigError("this embed graph's attention does not keep packed texts apart (pack_bidirectional_attention is "
                          "disabled), so it cannot serve; enable it to save")
    unsaved = sorted(set(deployment.graphs) - {MODEL, EMBED, *SIDE_GRAPHS})
    if unsaved:
        named = " and ".join(f"{'an' if role[0] in 'aeiou' else 'a'} {role}" for role in unsaved)
        raise ConfigError(f"this deployment has {named} graph beside its model graph, which saved "
                          f"deployments do not hold yet; build it from its checkpoint (autodeploy(model)) instead")
    directory = Path(directory)
    check_save_destination(directory)
    staging = directory.with_name(f".{directory.name}.saving-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    device = torch.device(str(settings.device))
    try:
        if embedding is not None:
            saved = export_embed_graph(deployment.graphs[EMBED], device)
        else:
            saved = export_served_graph(deployment.graph, signature.inputs, signature.kv_caches, int(settings.kv_cache.block_size),
                                        device, signature.cross_kv_caches)
        _write_json(staging / SERVING, {
            "graph_inputs": list(signature.inputs),
            "tensors": _write_graph(saved, staging / GRAPH, staging / WEIGHTS),
            "kv_caches": _cache_specs(signature.kv_caches),
            "decode_graph_batch_sizes": list(signature.decode_graph_batch_sizes),
            "prefill_graph_token_sizes": list(signature.prefill_graph_token_sizes),
            "eos_token_ids": list(deployment.eos_token_ids),
            # eagle3 / mtp: which hidden states the graph copies out (transforms/expose_hidden_states.py)
            **({"hidden_state_layers": _listed(deployment.graph.meta[HIDDEN_STATE_LAYERS])}
               if embedding is None and HIDDEN_STATE_LAYERS in getattr(deployment.graph, "meta", {}) else {}),
            **({"embedding": dataclasses.asdict(embedding)} if embedding is not None else {}),
            **({"image_token_id": int(deployment.image_token_id)} if VISION in deployment.graphs else {}),
            **({"image_boundaries": dataclasses.asdict(deployment.image_boundaries)}
               if deployment.image_boundaries else {}),
            # an encoder–decoder: the decoder's first token, and the cross-KV caches its encoder pass writes
            **({"decoder_start_token_id": int(deployment.decoder_start_token_id),
                "cross_kv_caches": _cache_specs(signature.cross_kv_caches)} if ENCODER in deployment.graphs else {}),
        })
        tuning = {"kernels": saved.kernels, "dispatches": saved.dispatches}
        if VISION in deployment.graphs:
            tuning[VISION] = _save_side_graph(deployment, VISION, export_vision_graph(deployment.graphs[VISION], device), staging)
            deployment.image_processor.save_pretrained(str(staging / IMAGE_PROCESSOR))
        if ENCODER in deployment.graphs:
            tuning[ENCODER] = _save_side_graph(deployment, ENCODER, export_encoder_graph(deployment.graphs[ENCODER], device), staging)
        _write_json(staging / TUNING, tuning)
        _write_json(staging / BUILD_REPORT, [dataclasses.asdict(record) for record in deployment.report.records])
        (staging / SETTINGS).write_text(settings_to_yaml(settings))
        if deployment.tokenizer is not None:
            deployment.tokenizer.save_pretrained(str(staging / TOKENIZER))
        files = {path.relative_to(staging).as_posix(): file_digest(path) for path in sorted(staging.rglob("*")) if path.is_file()}
        Manifest(
            versions=package_versions(),
            device=device_kind(str(settings.device)),
            dtype=str(settings.dtype),
            source={"model": settings.model,
                    "directory": str(Path(deployment.model_directory).resolve()) if deployment.model_directory else None,
                    "weights": str(settings.weights)},
            files=files,
            verification=dataclasses.asdict(verification) if verification is not None else None,
        ).write(staging)
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("saved the deployment to %s", directory)
    return directory


def _write_graph(saved: SavedGraph, archive: Path, weights: Path) -> dict[str, dict[str, str]]:
    """Write a graph's archive and its tensors; each tensor input's key in the tensors file and its device."""
    archive.write_bytes(saved.archive)
    keys = save_tensors(saved.tensors, weights)
    return {name: {"key": keys[name], "device": str(tensor.device)} for name, tensor in saved.tensors.items()}


def _cache_specs(specs) -> list[dict]:
    return [{**dataclasses.asdict(spec), "dtype": str(spec.dtype).removeprefix("torch.")} for spec in specs]


def _save_side_graph(deployment: Deployment, role: str, saved: SavedGraph, staging: Path) -> dict:
    """Write the ``role`` graph beside the model graph (``layout.SIDE_GRAPHS``) and its tensors; its tuning (its
    inputs, its tensors' placements, kernels and dispatches)."""
    archive, weights = SIDE_GRAPHS[role]
    inputs = [node.name for node in deployment.graphs[role].graph.nodes if node.op == "placeholder"]
    return {"graph_inputs": inputs, "kernels": saved.kernels, "dispatches": saved.dispatches,
            "tensors": _write_graph(saved, staging / archive, staging / weights)}


def _listed(exposed) -> list:
    layers, num_layers, width = exposed
    return [list(layers), int(num_layers), int(width)]
