"""``autodeploy(model)``: the one call from a checkpoint to a generating model."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from autodeploy.artifact import SETTINGS, Manifest, is_saved_deployment, load_deployment, rebuild_source
from autodeploy.auto_settings import resolve_auto_settings
from autodeploy.config import load_settings
from autodeploy.errors import AutoDeployError
from autodeploy.distributed import (check_no_live_deployment, check_parallelism, hold, init_distributed, should_spawn,
                                    spawn_workers, world_size)
from autodeploy.models.checkpoint import CheckpointReader
from autodeploy.models.factory import ModelFactory
from autodeploy.models.source import resolve_model_source
from autodeploy.pipeline import Pipeline
from autodeploy.preflight import check_deployment
from autodeploy.frontend.llm import LLM
from autodeploy.transforms.registry import TransformContext
from autodeploy.verification import build_verified

logger = logging.getLogger(__name__)


def deployment_settings(
    model: str | None = None,
    config: str | Path | Iterable[str | Path] | None = None,
    set_arguments: Iterable[str] = (),
    **overrides: Any,
) -> tuple[DictConfig, ModelFactory]:
    """Merged, validated and auto-resolved settings for ``model`` (what ``autodeploy config show`` prints)."""
    config_files = [config] if isinstance(config, (str, Path)) else list(config or [])
    if model is not None:
        overrides["model"] = str(model)
    overrides = {key: value for key, value in overrides.items() if value is not None}
    settings = load_settings(config_files, overrides, set_arguments)
    source = resolve_model_source(settings.model, settings.weights)
    factory = ModelFactory.from_source(source, settings.trust_remote_code)
    return resolve_auto_settings(settings, factory.hf_config), factory


def _eos_token_ids(factory: ModelFactory) -> list[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(factory.source.directory).eos_token_id
    except OSError:  # no generation_config.json: fall back to the model config
        eos = getattr(factory.hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def autodeploy(
    model: str | None = None,
    *,
    config: str | Path | Iterable[str | Path] | None = None,
    set_arguments: Iterable[str] = (),
    tensor_parallel: int | None = None,
    pipeline_parallel: int | None = None,
    expert_parallel: int | None = None,
    **overrides: Any,
) -> LLM:
    """Build a generating model from a checkpoint folder, hub id, shipped config name or config.json,
    or serve a deployment that ``LLM.save`` / ``autodeploy build`` wrote (see ``autodeploy/artifact``).

    ``config`` names YAML files merged over ``configs/default.yaml``; keyword ``overrides`` (any
    setting, e.g. ``weights="random"``, ``device="cpu"``, ``transforms={"cleanup_noop": {"enabled": False}}``)
    win over YAML; ``set_arguments`` are ``key=value`` strings as on the CLI and win over everything.
    With no model, the embedded demo model is used. A saved deployment takes only the overrides its graph
    does not depend on (``autodeploy/artifact/reload_settings.py``).

    ``tensor_parallel`` / ``pipeline_parallel`` / ``expert_parallel`` (the ``distributed`` settings) over
    more than one rank: in a plain process, the other ranks are spawned here as worker processes and the
    returned ``LLM`` drives them all (``LLM.shutdown()``, or its garbage collection, stops them; until then a
    second deployment over several ranks in this process is a ``ConfigError``, a one-process one is not); under
    ``torchrun`` every process calls this alike (``autodeploy/distributed.py``).

    >>> from autodeploy import autodeploy, SamplingParams
    >>> llm = autodeploy()
    >>> out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0))
    """
    parallelism = {name: size for name, size in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel),
                                                 ("expert_parallel", expert_parallel)) if size is not None}
    if parallelism:
        overrides["distributed"] = {**dict(overrides.get("distributed") or {}), **parallelism}
    if model is not None and is_saved_deployment(model):
        return _serve_saved(Path(model), config, set_arguments, overrides)
    settings, factory = deployment_settings(model, config, set_arguments, **overrides)
    check_parallelism(settings, factory.hf_config)
    check_no_live_deployment(settings)
    if should_spawn(settings):
        workers, store = spawn_workers(settings, model, config, set_arguments, overrides)
        try:
            llm = _build(settings, factory, store, workers)
            workers.wait_ready()
        except BaseException as error:
            # A worker's death shows on rank 0 as a failed collective; rank 0's own errors stay as they are.
            failure = workers.failure(error) if isinstance(error, Exception) and not isinstance(error, AutoDeployError) else error
            workers.stop()
            if failure is error:
                raise
            raise failure from error
        return llm
    return _build(settings, factory)


def _build(settings, factory: ModelFactory, store=None, workers=None) -> LLM:
    init_distributed(settings, store)
    if settings.weights == "checkpoint" and settings.device != "meta":
        CheckpointReader(factory.source.directory)  # fail on a folder without weights before exporting
    pipeline = Pipeline.from_settings(settings)
    context = TransformContext(settings=settings, model_factory=factory)
    pipeline.validate(context)
    check_deployment(settings, factory.hf_config, factory.build_meta_model(getattr(torch, settings.dtype)))
    if settings.verify.enabled:
        graph, verification = build_verified(pipeline, context, settings.dump_graphs)
    else:
        graph, verification = pipeline.run(context, dump_dir=settings.dump_graphs), None
    llm = LLM(pipeline.deployment(graph, context, factory.load_tokenizer(settings.tokenizer), _eos_token_ids(factory),
                                  verification, str(factory.source.directory)))
    llm.workers = workers
    if world_size(settings) > 1:
        hold(llm, workers)
    # Sizing the KV cache and the warm-up forward belong to the build: their errors are the build's.
    return _with_engine(llm)


def _with_engine(llm: LLM) -> LLM:
    if llm.can_serve:
        llm.engine  # noqa: B018  (sizes the KV cache and runs the warm-up forward)
    return llm


def _serve_saved(directory: Path, config, set_arguments: Iterable[str], overrides: dict[str, Any]) -> LLM:
    """The deployment saved in ``directory``, served as saved; rebuilt from its source, with a warning, when
    this process has other library versions or another device kind than the one that built it."""
    config_files = [config] if isinstance(config, (str, Path)) else list(config or [])
    manifest = Manifest.read(directory)
    mismatches = manifest.environment_mismatches()
    if mismatches:
        manifest.verify_files(directory, only=(SETTINGS,))
        source = rebuild_source(manifest, directory, mismatches)
        logger.warning("%s was built with %s; rebuilding it from its source %s (save it again to skip this next time)",
                       directory, "; ".join(mismatches), source or "(the demo model)")
        return autodeploy(source, config=[directory / SETTINGS, *config_files], set_arguments=set_arguments, **overrides)
    # The engine is built as a build builds it, while the loader checks the weights' digest.
    return load_deployment(directory, manifest, config_files, overrides, set_arguments,
                           serve=lambda deployment: _with_engine(LLM(deployment)))
