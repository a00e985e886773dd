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
from autodeploy.deployment import MODEL, VISION, Deployment, as_deployment
from autodeploy.errors import ConfigError
from autodeploy.runtime.speculative import HIDDEN_STATE_LAYERS

from .layout import (BUILD_REPORT, GRAPH, IMAGE_PROCESSOR, SERVING, SETTINGS, TOKENIZER, TUNING, VISION_GRAPH, VISION_WEIGHTS,
                     WEIGHTS, is_whole_saved_deployment)
from .graph_archive import export_served_graph, export_vision_graph
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
    if not signature.kv_caches:
        raise ConfigError("this graph has no KV cache (insert_cached_attention is disabled), so it cannot serve; enable it to save")
    unsaved = sorted(set(deployment.graphs) - {MODEL, VISION})
    if unsaved:
        named = " and ".join(f"{'an' if role[0] in 'aeiou' else 'a'} {role}" for role in unsaved)
        raise ConfigError(f"this deployment has {named} graph beside its model graph, which saved "
                          f"deployments do not hold yet; build it from its checkpoint (autodeploy(model)) instead")
    directory = Path(directory)
    check_save_destination(directory)
    staging = directory.with_name(f".{directory.name}.saving-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        saved = export_served_graph(deployment.graph, signature.inputs, signature.kv_caches, int(settings.kv_cache.block_size),
                                    torch.device(str(settings.device)))
        (staging / GRAPH).write_bytes(saved.archive)
        keys = save_tensors(saved.tensors, staging / WEIGHTS)
        _write_json(staging / SERVING, {
            "graph_inputs": list(signature.inputs),
            "tensors": {name: {"key": keys[name], "device": str(tensor.device)} for name, tensor in saved.tensors.items()},
            "kv_caches": [{**dataclasses.asdict(spec), "dtype": str(spec.dtype).removeprefix("torch.")} for spec in signature.kv_caches],
            "decode_graph_batch_sizes": list(signature.decode_graph_batch_sizes),
            "prefill_graph_token_sizes": list(signature.prefill_graph_token_sizes),
            "eos_token_ids": list(deployment.eos_token_ids),
            # eagle3 / mtp: which hidden states the graph copies out (transforms/expose_hidden_states.py)
            **({"hidden_state_layers": _listed(deployment.graph.meta[HIDDEN_STATE_LAYERS])}
               if HIDDEN_STATE_LAYERS in getattr(deployment.graph, "meta", {}) else {}),
            **({"image_token_id": int(deployment.image_token_id)} if VISION in deployment.graphs else {}),
            **({"image_boundaries": dataclasses.asdict(deployment.image_boundaries)}
               if deployment.image_boundaries else {}),
        })
        tuning = {"kernels": saved.kernels, "dispatches": saved.dispatches}
        if VISION in deployment.graphs:
            tuning[VISION] = _save_vision(deployment, staging, torch.device(str(settings.device)))
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


def _save_vision(deployment: Deployment, staging: Path, device: torch.device) -> dict:
    """Write the vision graph, its tensors and the image processor; the vision graph's tuning (its tensors'
    placements, kernels and dispatches)."""
    saved = export_vision_graph(deployment.graphs[VISION], device)
    (staging / VISION_GRAPH).write_bytes(saved.archive)
    keys = save_tensors(saved.tensors, staging / VISION_WEIGHTS)
    deployment.image_processor.save_pretrained(str(staging / IMAGE_PROCESSOR))
    inputs = [node.name for node in deployment.graphs[VISION].graph.nodes if node.op == "placeholder"]
    return {"graph_inputs": inputs, "kernels": saved.kernels, "dispatches": saved.dispatches,
            "tensors": {name: {"key": keys[name], "device": str(tensor.device)} for name, tensor in saved.tensors.items()}}


def _listed(exposed) -> list:
    layers, num_layers, width = exposed
    return [list(layers), int(num_layers), int(width)]
