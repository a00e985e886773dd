"""``autodeploy(model)``: the one call from a checkpoint to a generating model."""

from __future__ import annotations

import logging
from dataclasses import replace
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from autodeploy.artifact import SETTINGS, Manifest, is_saved_deployment, load_deployment, rebuild_source
from autodeploy.auto_settings import resolve_auto_settings
from autodeploy.planning.check import model_shape
from autodeploy.config import load_settings
from autodeploy.build_report import BuildReport
from autodeploy.deployment import EMBED, ENCODER, VISION, Deployment, EmbeddingHead, ImageBoundaries
from autodeploy.errors import AutoDeployError, ConfigError
from autodeploy.distributed import (check_no_live_deployment, check_parallelism, hold, init_distributed, should_spawn,
                                    spawn_workers, world_size)
from autodeploy.models.checkpoint import CheckpointReader
from autodeploy.models.factory import ModelFactory
from autodeploy.models.source import resolve_model_source
from autodeploy.pipeline import Pipeline
from autodeploy.preflight import check_deployment
from autodeploy.frontend.llm import LLM
from autodeploy.runtime import draft_model, eagle3, mtp  # noqa: F401  (register the "draft", "eagle3" and "mtp" drafters)
from autodeploy.runtime.speculative import hidden_state_layers, registered_drafters
from autodeploy.transforms.registry import TransformContext
from autodeploy.export.encoder_only import max_text_tokens
from autodeploy.verification import build_verified, build_verified_embedder

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
    return resolve_auto_settings(settings, factory.hf_config, lambda: model_shape(factory)), factory


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
    if factory.vision_language is not None and world_size(settings) > 1:
        raise ConfigError("vision-language models run on one rank so far (their images are encoded on rank 0's engine); "
                          "deploy without tensor, expert or pipeline parallelism")
    if factory.encoder_decoder is not None:
        if int(settings.distributed.pipeline_parallel) > 1:
            raise ConfigError("encoder-decoder models are not cut into pipeline stages yet (the encoder graph is not cut, and "
                              "each stage would need its own decoder layers' cross keys and values from it); deploy with "
                              "tensor_parallel alone")
        if settings.speculative.method is not None:
            raise ConfigError(f"speculative decoding (speculative.method={settings.speculative.method!r}) drafts for decoder-only "
                              f"models; an encoder-decoder's decoder is not served with it yet: deploy without speculative")
    if factory.embedding is not None:
        if world_size(settings) > 1:
            raise ConfigError("embedding models and cross-encoders run on one rank (an encoder of their size fits one GPU); "
                              "deploy without tensor, expert or pipeline parallelism")
        if settings.speculative.method is not None:
            raise ConfigError(f"speculative decoding (speculative.method={settings.speculative.method!r}) drafts tokens to "
                              f"generate; an embedding model generates none: deploy without speculative")
    check_no_live_deployment(settings)
    _check_speculative(settings)
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


def _check_speculative(settings) -> None:
    """Refuse a speculative setting the runtime cannot serve, before anything is built."""
    method = settings.speculative.method
    if method is None:
        return
    if method not in registered_drafters():
        raise ConfigError(f"speculative.method is {method!r}; the registered drafters are "
                          f"{', '.join(registered_drafters())} (register your own with register_drafter)")
    if world_size(settings) > 1:
        raise ConfigError(f"speculative decoding (speculative.method={method!r}) runs on one rank; deploy without "
                          f"tensor, expert or pipeline parallelism, or without speculative")
    hidden_state_layers(settings, 1)  # a hidden-state drafter reads its head's config now (or refuses)


def _build(settings, factory: ModelFactory, store=None, workers=None) -> LLM:
    init_distributed(settings, store)
    llm = LLM(_with_draft(_deploy(settings, factory)))
    llm.workers = workers
    if world_size(settings) > 1:
        hold(llm, workers)
    # Sizing the KV cache and the warm-up forward belong to the build: their errors are the build's.
    return _with_engine(llm)


def _deploy(settings, factory: ModelFactory) -> Deployment:
    """``factory``'s model through the pipeline (verified on a reduced twin when ``verify.enabled``)."""
    if settings.weights == "checkpoint" and settings.device != "meta":
        CheckpointReader(factory.source.directory)  # fail on a folder without weights before exporting
    pipeline = Pipeline.from_settings(settings)
    if factory.embedding is not None:
        return _deploy_encoder_only(settings, factory, pipeline)
    context = TransformContext(settings=settings, model_factory=factory)
    pipeline.validate(context)
    check_deployment(settings, factory.hf_config, factory.build_meta_model(getattr(torch, settings.dtype)))
    if settings.verify.enabled:
        graph, verification = build_verified(pipeline, context, settings.dump_graphs)
    else:
        graph, verification = pipeline.run(context, dump_dir=settings.dump_graphs), None
    records = pipeline.records
    deployment = pipeline.deployment(graph, context, factory.load_tokenizer(settings.tokenizer), _eos_token_ids(factory),
                                     verification, str(factory.source.directory))
    if factory.encoder_decoder is not None:
        encoder = TransformContext(settings=settings, model_factory=factory, role=ENCODER)
        deployment.graphs[ENCODER] = pipeline.run(encoder)
        deployment.report.records = [*records, *(replace(record, name=f"{record.name} ({ENCODER})") for record in pipeline.records)]
        deployment.decoder_start_token_id = factory.encoder_decoder.decoder_start_token_id
    if factory.vision_language is not None:
        vision = TransformContext(settings=settings, model_factory=factory, role=VISION)
        deployment.graphs[VISION] = pipeline.run(vision)
        deployment.report.records = [*records, *(replace(record, name=f"{record.name} ({VISION})") for record in pipeline.records)]
        deployment.image_processor = factory.load_image_processor()
        spec = factory.vision_language
        deployment.image_token_id = spec.image_token_id
        if spec.boundary_token_ids is not None:
            deployment.image_boundaries = ImageBoundaries(*spec.boundary_token_ids, spec.separator)
    return deployment


def _deploy_encoder_only(settings, factory: ModelFactory, pipeline: Pipeline) -> Deployment:
    """An encoder-only checkpoint (an embedder or a cross-encoder, ``models/embedding.py``) as one ``"embed"`` graph
    through the pipeline, verified on a twin when ``verify.enabled``."""
    context = TransformContext(settings=settings, model_factory=factory, role=EMBED)
    pipeline.validate(context)
    meta_model = factory.build_meta_model(getattr(torch, settings.dtype))
    if settings.verify.enabled:
        graph, verification = build_verified_embedder(pipeline, context, settings.dump_graphs)
    else:
        graph, verification = pipeline.run(context, dump_dir=settings.dump_graphs), None
    spec = factory.embedding
    head = EmbeddingHead(spec.task, spec.pooling, spec.normalize, min(max_text_tokens(meta_model), int(settings.max_seq_len)),
                         int(factory.hf_config.vocab_size), int(factory.hf_config.hidden_size), dict(spec.prompts),
                         spec.default_prompt_name, spec.include_prompt)
    logger.info("%s: %s (%s)", factory.source.name, "a cross-encoder" if spec.task == "score" else "an embedding model", spec.source)
    return Deployment({EMBED: graph}, context.serving_signature(), settings, factory.load_tokenizer(settings.tokenizer), (),
                      BuildReport(pipeline.records, verification), str(factory.source.directory), embedding=head)


# What a draft model takes from the model's settings: where and how it runs, never what it is.
DRAFT_INHERITS = ("device", "dtype", "weights", "max_seq_len", "max_batch_size", "seed", "trust_remote_code", "backends",
                  "autotuner", "compile", "verify", "scheduler")


def _with_draft(deployment: Deployment) -> Deployment:
    """``deployment`` with its draft model built beside it when ``speculative.method`` is ``draft``: the checkpoint
    ``speculative.model`` through the same pipeline, on the model's device, dtype and limits, with
    ``speculative.options`` as its own settings (``{quantize: {default: fp8}}``, say), and a KV pool that holds
    every sequence's whole context."""
    settings = deployment.settings
    speculative = settings.speculative
    if speculative.method != "draft" or deployment.draft is not None:
        return deployment
    inherited = OmegaConf.to_container(OmegaConf.masked_copy(settings, list(DRAFT_INHERITS)), resolve=True)
    blocks_per_sequence = -(-(settings.max_seq_len + speculative.num_tokens) // settings.kv_cache.block_size)
    inherited["kv_cache"] = {"block_size": settings.kv_cache.block_size, "prefix_caching": False,
                             "num_blocks": settings.max_batch_size * blocks_per_sequence}
    overrides = OmegaConf.to_container(OmegaConf.merge(inherited, speculative.options), resolve=True)
    try:
        draft_settings, draft_factory = deployment_settings(speculative.model, **overrides)
    except AutoDeployError as error:
        raise type(error)(f"the draft model (speculative.model={speculative.model!r}): {error}") from error
    draft = _deploy(draft_settings, draft_factory)
    _check_draft_fits(deployment, draft, speculative.model)
    deployment.draft = draft
    return deployment


def _check_draft_fits(model: Deployment, draft: Deployment, name: str) -> None:
    """A draft must spell tokens as the model does: the same tokenizer vocabulary (or, without tokenizers, logits
    as wide)."""
    if model.tokenizer is not None and draft.tokenizer is not None:
        ours, theirs = model.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        if ours != theirs:
            differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
            raise ConfigError(f"the draft model {name!r} has another tokenizer than the model ({len(theirs)} against "
                              f"{len(ours)} tokens; e.g. {differing}): its tokens would mean other text. Pick a draft "
                              f"of the same family (the same tokenizer), or speculative.method=ngram")
    elif draft.vocab_size != model.vocab_size:
        raise ConfigError(f"the draft model {name!r} has {draft.vocab_size} logits against the model's {model.vocab_size}: "
                          f"pick a draft with the model's vocabulary")


def _with_engine(llm: LLM) -> LLM:
    if llm.can_serve:
        llm.engine  # noqa: B018  (sizes the KV cache and runs the warm-up forward)
    elif llm.deployment.embedding is not None and llm.device.type != "meta":
        llm.embedder  # noqa: B018  (checks the graph serves packed texts)
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
                           serve=lambda deployment: _with_engine(LLM(_with_draft(deployment))))
