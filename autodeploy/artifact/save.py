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
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import fx

from autodeploy.build_report import TransformRecord, VerificationReport
from autodeploy.config import settings_to_yaml
from autodeploy.custom_ops.serving_signature import KVCacheSpec
from autodeploy.errors import ConfigError

from .layout import BUILD_REPORT, GRAPH, SERVING, SETTINGS, TOKENIZER, TUNING, WEIGHTS, is_whole_saved_deployment
from .graph_archive import export_served_graph
from .manifest import Manifest, device_kind, package_versions, file_digest
from .weights_file import save_tensors

logger = logging.getLogger(__name__)


def check_save_destination(directory: Path) -> None:
    """``ConfigError`` unless ``directory`` may receive a deployment (new, empty, or an earlier deployment)."""
    if directory.exists() and (not directory.is_dir() or (any(directory.iterdir()) and not is_whole_saved_deployment(directory))):
        raise ConfigError(f"{directory} exists and is not a saved deployment; save to a new or empty folder")


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def save_deployment(
    directory: str | Path,
    graph: fx.GraphModule,
    graph_inputs: Sequence[str],
    settings,
    tokenizer=None,
    eos_token_ids: Sequence[int] = (),
    records: Sequence[TransformRecord] = (),
    kv_caches: Sequence[KVCacheSpec] = (),
    model_directory: str | None = None,
    verification: VerificationReport | None = None,
    decode_graph_batch_sizes: Sequence[int] = (),
    prefill_graph_token_sizes: Sequence[int] = (),
) -> Path:
    """Write the deployment (the parts of an ``LLM``) to ``directory``; returns it. See ``LLM.save``."""
    if str(settings.device) == "meta":
        raise ConfigError("a deploy on the meta device has no weights to save; deploy with device=cpu or cuda, then save")
    if not kv_caches:
        raise ConfigError("this graph has no KV cache (insert_cached_attention is disabled), so it cannot serve; enable it to save")
    directory = Path(directory)
    check_save_destination(directory)
    staging = directory.with_name(f".{directory.name}.saving-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        saved = export_served_graph(graph, graph_inputs, kv_caches, int(settings.kv_cache.block_size), torch.device(str(settings.device)))
        (staging / GRAPH).write_bytes(saved.archive)
        keys = save_tensors(saved.tensors, staging / WEIGHTS)
        _write_json(staging / SERVING, {
            "graph_inputs": list(graph_inputs),
            "tensors": {name: {"key": keys[name], "device": str(tensor.device)} for name, tensor in saved.tensors.items()},
            "kv_caches": [{**dataclasses.asdict(spec), "dtype": str(spec.dtype).removeprefix("torch.")} for spec in kv_caches],
            "decode_graph_batch_sizes": list(decode_graph_batch_sizes),
            "prefill_graph_token_sizes": list(prefill_graph_token_sizes),
            "eos_token_ids": list(eos_token_ids),
        })
        _write_json(staging / TUNING, {"kernels": saved.kernels, "dispatches": saved.dispatches})
        _write_json(staging / BUILD_REPORT, [dataclasses.asdict(record) for record in records])
        (staging / SETTINGS).write_text(settings_to_yaml(settings))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging / TOKENIZER))
        files = {path.relative_to(staging).as_posix(): file_digest(path) for path in sorted(staging.rglob("*")) if path.is_file()}
        Manifest(
            versions=package_versions(),
            device=device_kind(str(settings.device)),
            dtype=str(settings.dtype),
            source={"model": settings.model, "directory": str(Path(model_directory).resolve()) if model_directory else None,
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
