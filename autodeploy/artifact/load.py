"""Serve a saved deployment as it was built: no export, no transforms, no verification (it was verified at build).

Every file is checked against the manifest's digest before it is used (the weights are hashed while the
engine captures its CUDA graphs on them, whose values a capture does not read, and checked before anything
is served);
the graph archive is checked for anything it must not hold before ``torch.export.load`` reads it; tensors
come from safetensors. Nothing is unpickled. Whether this process may serve the deployment as saved (same
library versions and device kind) is the caller's question (``Manifest.environment_mismatches``);
``autodeploy()`` rebuilds from the source when not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from autodeploy.build_report import BuildReport, TransformRecord, VerificationReport
from autodeploy.config import load_yaml
from autodeploy.custom_ops.serving_signature import CROSS_METADATA, KVCacheSpec, ServingSignature
from autodeploy.deployment import EMBED, ENCODER, MODEL, PACKED_TEXTS, VISION, Deployment, EmbeddingHead, ImageBoundaries
from autodeploy.errors import CheckpointError, ConfigError, error_summary
from autodeploy.models.vision_language import load_image_processor
from autodeploy.runtime.speculative import HIDDEN_STATE_LAYERS, hidden_state_buffer

from .graph_archive import load_program, served_graph
from .layout import BUILD_REPORT, GRAPH, IMAGE_PROCESSOR, SERVING, SETTINGS, SIDE_GRAPHS, TOKENIZER, TUNING, WEIGHTS
from .manifest import Manifest, incomplete
from .rebuild import rebuild_command
from .reload_settings import reload_settings
from .weights_file import load_tensors, start_reading

logger = logging.getLogger(__name__)

Served = TypeVar("Served")


# Every file the reload reads: the manifest must list them all (with the tokenizer files it holds).
_READ = (GRAPH, WEIGHTS, SERVING, TUNING, SETTINGS, BUILD_REPORT)


def _refuse_unlisted_tokenizer_files(directory: Path, manifest: Manifest) -> None:
    """The tokenizer loader reads what it finds in its folder, so that folder holds only what was saved."""
    for path in sorted((directory / TOKENIZER).rglob("*")):
        name = path.relative_to(directory).as_posix()
        if path.is_file() and name not in manifest.files:
            raise CheckpointError(f"{path} was not saved with the deployment (its manifest does not list it); remove it")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); save the deployment again") from error


def _kv_cache_spec(fields: Mapping[str, Any]) -> KVCacheSpec:
    dtype = getattr(torch, str(fields.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"serving.json: KV cache dtype {fields.get('dtype')!r} is not a torch dtype; save the deployment again")
    return KVCacheSpec(**{**fields, "dtype": dtype})


def _load_tokenizer(directory: Path, settings):
    from transformers import AutoTokenizer

    location = settings.tokenizer or (str(directory / TOKENIZER) if (directory / TOKENIZER).is_dir() else None)
    if location is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=settings.trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as error:
        if settings.tokenizer:
            raise ConfigError(f"cannot load tokenizer {settings.tokenizer!r}: {error_summary(error)}") from error
        raise CheckpointError(f"the saved tokenizer in {location} cannot be loaded: {error_summary(error)}") from error


@contextlib.contextmanager
def _short_gil_turns(seconds: float = 2e-4):
    """While the graph deserializes (pure Python, holding the GIL) the weight readers come back from each
    read, hash and copy wanting the GIL, and by default wait up to 5 ms for the deserializer to yield it."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(default)


def load_deployment(
    directory: str | Path,
    manifest: Manifest,
    config_files: Iterable[str | Path] = (),
    overrides: Mapping[str, Any] | None = None,
    set_arguments: Iterable[str] = (),
    serve: Callable[[Deployment], Served] | None = None,
) -> Served | Deployment:
    """The ``Deployment`` saved in ``directory``, with the overrides a reload allows (``reload_settings.py``).

    ``serve`` (``autodeploy()`` passes one that makes the ``LLM`` and its engine) runs on the deployment while
    the weights' digest is computed, and its result is returned once the digest matches; without it, the
    deployment itself is."""
    directory = Path(directory)
    began = time.perf_counter()
    seconds: dict[str, float] = {}

    def timed(phase: str, work, *arguments):
        start = time.perf_counter()
        result = work(*arguments)
        seconds[phase] = time.perf_counter() - start
        return result

    manifest.verify_files(directory, tuple(sorted({*manifest.files, *_READ} - {WEIGHTS})))
    _refuse_unlisted_tokenizer_files(directory, manifest)
    settings = reload_settings(load_yaml(directory / SETTINGS), config_files, overrides, set_arguments,
                               rebuild_command(manifest, directory))
    serving, tuning = _read_json(directory / SERVING), _read_json(directory / TUNING)
    try:
        placements = serving["tensors"]
        devices = {entry["key"]: entry["device"] for entry in placements.values()}
    except (KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{directory / SERVING} lacks its tensors' placements ({type(error).__name__}: {error}); "
                              f"save the deployment again") from error
    if not (directory / WEIGHTS).is_file():
        raise incomplete(directory, WEIGHTS)
    # The weights are read onto their devices on background threads while the graph deserializes, and
    # hashed while the engine captures its CUDA graphs on them (values do not matter to a capture); the
    # digest is checked before anything is returned, so nothing is served from a file that does not match.
    with _short_gil_turns():
        reading = start_reading(directory / WEIGHTS, devices)
        try:
            program = timed("graph (torch.export.load)", load_program, (directory / GRAPH).read_bytes(), str(directory / GRAPH))
            _check_tensors_fit_the_graph(program, placements, reading.layout(), directory / WEIGHTS)
            tensors_by_key = timed("waiting for the weights' copies", reading.tensors)
            deployment = _assemble(directory, manifest, settings, program, tensors_by_key, placements, serving, tuning, timed)
            if "image_token_id" in serving:
                timed("vision graph", _add_vision, deployment, directory, serving, tuning)
            if CROSS_METADATA[0] in deployment.signature.inputs:  # the decoder reads an encoder's keys and values
                timed("encoder graph", _add_encoder, deployment, directory, serving, tuning)
            served = deployment if serve is None else timed("engine", serve, deployment)
            timed("waiting for the weights' digest", lambda: manifest.check_digest(directory, WEIGHTS, reading.digest()))
        except Exception as error:
            # A corrupted file can fail the engine (non-finite logits, say) before its digest is known: say so.
            if not isinstance(error, CheckpointError):
                manifest.check_digest(directory, WEIGHTS, reading.digest())
            raise
        finally:
            reading.close()
    logger.info("reloaded the deployment in %s in %.2f s (%s; built from %s; verification %s)", directory,
                time.perf_counter() - began, ", ".join(f"{phase} {value:.2f} s" for phase, value in seconds.items()),
                manifest.source.get("model") or "the demo model", manifest.reload_verification)
    return served


@contextlib.contextmanager
def _side_graph_entries(directory: Path, role: str):
    """Turns a missing or malformed entry of the ``role`` graph's (in serving.json or tuning.json) into a ``CheckpointError``."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{directory}: the {role} graph's entries are missing or malformed ({type(error).__name__}: "
                              f"{error}); save the deployment again") from error


def _side_graph(directory: Path, role: str, tuning: Mapping[str, Any]):
    """The ``role`` graph saved beside the model graph (``layout.SIDE_GRAPHS``), on its tensors, read whole (the
    manifest's digest of its files was checked with the others)."""
    archive, weights = SIDE_GRAPHS[role]
    for name in (archive, weights):
        if not (directory / name).is_file():
            raise incomplete(directory, name)
    with _side_graph_entries(directory, role):
        saved = tuning[role]
        placements = saved["tensors"]
        tensors_by_key, _ = load_tensors(directory / weights, {entry["key"]: entry["device"] for entry in placements.values()})
        program = load_program((directory / archive).read_bytes(), str(directory / archive))
        tensors = {name: tensors_by_key[entry["key"]] for name, entry in placements.items()}
        return served_graph(program, str(directory / archive), tensors, saved["graph_inputs"], saved["dispatches"], saved["kernels"])


def _add_vision(deployment: Deployment, directory: Path, serving: Mapping[str, Any], tuning: Mapping[str, Any]) -> None:
    """A vision-language deployment's vision graph, its image processor and its image token."""
    deployment.graphs[VISION] = _side_graph(directory, VISION, tuning)
    with _side_graph_entries(directory, VISION):
        deployment.image_token_id = int(serving["image_token_id"])
        if "image_boundaries" in serving:
            deployment.image_boundaries = ImageBoundaries(**serving["image_boundaries"])
    deployment.image_processor = load_image_processor(directory / IMAGE_PROCESSOR, str(directory))


def _add_encoder(deployment: Deployment, directory: Path, serving: Mapping[str, Any], tuning: Mapping[str, Any]) -> None:
    """An encoder–decoder's encoder graph, the decoder's start token and the cross-KV caches the encoder pass writes."""
    deployment.graphs[ENCODER] = _side_graph(directory, ENCODER, tuning)
    with _side_graph_entries(directory, ENCODER):
        deployment.decoder_start_token_id = int(serving["decoder_start_token_id"])
        cross = tuple(_kv_cache_spec(fields) for fields in serving["cross_kv_caches"])
    deployment.signature = dataclasses.replace(deployment.signature, cross_kv_caches=cross)


def _described(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


def _check_tensors_fit_the_graph(program, placements: Mapping[str, Any], layout: Mapping[str, tuple], path: Path) -> None:
    """Each tensor has the dtype and shape of the graph input it fills, as the weights file's header gives them: a
    header edited with its digest fixed up would otherwise fail the first op that reads the tensor."""
    for node in program.graph.nodes:
        entry, expected = placements.get(node.name) if node.op == "placeholder" else None, node.meta.get("val")
        if entry is None or not isinstance(expected, torch.Tensor):
            continue
        dtype, shape = layout[entry["key"]]
        if dtype != expected.dtype or tuple(shape) != tuple(expected.shape):
            raise CheckpointError(f"{path} holds {entry['key']} as {_described(dtype, shape)}, but the graph takes "
                                  f"{_described(expected.dtype, expected.shape)}; the file was edited since it was saved, or "
                                  f"does not belong to this graph: save the deployment again")


def _assemble(directory: Path, manifest: Manifest, settings, program, tensors_by_key, placements, serving, tuning,
              timed) -> Deployment:
    """The served graph on the loaded tensors, and the ``Deployment`` around it."""
    try:
        tensors = {name: tensors_by_key[entry["key"]] for name, entry in placements.items()}
        graph_inputs = tuple(serving["graph_inputs"])
        kv_caches = tuple(_kv_cache_spec(fields) for fields in serving["kv_caches"])
        graph = timed("graph assembly", served_graph, program, str(directory / GRAPH), tensors, graph_inputs,
                      tuning["dispatches"], tuning["kernels"])
        records = [TransformRecord(**fields) for fields in _read_json(directory / BUILD_REPORT)]
        eos_token_ids = tuple(int(token) for token in serving["eos_token_ids"])
        # Captured sizes above a smaller max_batch_size would never be replayed; cap them as the compile stage does.
        decode_sizes = sorted({min(int(size), settings.max_batch_size) for size in serving["decode_graph_batch_sizes"]})
        max_tokens = min(int(settings.scheduler.max_num_tokens), int(settings.max_seq_len))  # likewise for the prefill pieces
        token_sizes = sorted({min(int(size), max_tokens) for size in serving["prefill_graph_token_sizes"]})
        verification = VerificationReport(**manifest.verification) if manifest.verification else None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{directory}: a deployment file lacks an entry or has the wrong shape ({type(error).__name__}: "
                              f"{error}); save the deployment again") from error
    if "hidden_state_layers" in serving:  # eagle3 / mtp: the graph copies hidden states out
        layers, num_layers, width = serving["hidden_state_layers"]
        graph.meta[HIDDEN_STATE_LAYERS] = (tuple(layers), num_layers, width)
        rows = hidden_state_buffer(graph).shape[0]
        if rows < max_tokens:
            raise ConfigError(f"this deployment copies out the hidden states of at most {rows} tokens a step; "
                              f"scheduler.max_num_tokens {max_tokens} is more: keep it at most {rows}, or build again")
    signature = ServingSignature(graph_inputs, kv_caches, tuple(decode_sizes), tuple(token_sizes))
    if "embedding" in serving:  # an embedding model: its "embed" graph, saved only with its attention packing texts
        try:
            embedding = EmbeddingHead(**serving["embedding"])
        except TypeError as error:
            raise CheckpointError(f"{directory}: the embedding entry of {SERVING} is malformed ({error}); save the deployment "
                                  f"again") from error
        graph.meta[PACKED_TEXTS] = True
        return Deployment({EMBED: graph}, signature, settings, _load_tokenizer(directory, settings), (),
                          BuildReport(records, verification), manifest.source.get("directory"), embedding=embedding)
    return Deployment({MODEL: graph}, signature, settings, _load_tokenizer(directory, settings), eos_token_ids,
                      BuildReport(records, verification), manifest.source.get("directory"))
