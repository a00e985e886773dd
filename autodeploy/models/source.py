"""Resolve what the user named (local folder, config.json, shipped config, hub id) to a local folder."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from autodeploy.errors import ModelNotFoundError, error_summary

logger = logging.getLogger(__name__)

DEMO_MODEL = "tiny-code-llama"
_CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
_CONFIG_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class ModelSource:
    """A local folder holding ``config.json`` (and, for real checkpoints, weights and tokenizer files)."""

    name: str
    directory: Path
    config_file: Path


def demo_model_directory() -> Path:
    return Path(str(resources.files("autodeploy").joinpath("assets", DEMO_MODEL)))


def shipped_model_configs() -> dict[str, Path]:
    """Model configs shipped under ``configs/models/`` for random-weight benchmarking."""
    root = Path(str(resources.files("autodeploy.configs").joinpath("models")))
    return {p.parent.name: p.parent for p in sorted(root.glob("*/config.json"))}


def resolve_model_source(model: str | None, weights: str = "checkpoint") -> ModelSource:
    """Find the model's folder; hub ids are fetched with ``huggingface_hub`` (honours HF_HUB_OFFLINE)."""
    if model is None:
        directory = demo_model_directory()
        return ModelSource(DEMO_MODEL, directory, directory / "config.json")
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".json":
            raise ModelNotFoundError(f"{path} is a file but not a config.json; pass a checkpoint folder or its config.json")
        return ModelSource(model, path.parent, path)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelNotFoundError(
                f"folder {path} has no config.json; point at a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files)"
            )
        return ModelSource(model, path, config_file)
    shipped = shipped_model_configs()
    if model in shipped:
        return ModelSource(model, shipped[model], shipped[model] / "config.json")
    return _download_from_hub(model, weights)


def _download_from_hub(repo_id: str, weights: str) -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    patterns = _CHECKPOINT_PATTERNS if weights == "checkpoint" else _CONFIG_PATTERNS
    hint = (
        "check the spelling, pass a local checkpoint folder, or pre-download it into the HF cache "
        "(HF_HUB_OFFLINE=1 then uses the cache only)"
    )
    if "/" not in repo_id and not repo_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ModelNotFoundError(f"model {repo_id!r} is not a local path or a valid hub id; {hint}")
    try:
        directory = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError as error:
        raise ModelNotFoundError(f"model {repo_id!r} is not a local path or a valid hub id; {hint}") from error
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path, a shipped config ({', '.join(shipped_model_configs())}) "
            f"or a hub model we could fetch ({error_summary(error, 200)}); {hint}"
        ) from error
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"hub model {repo_id!r} has no config.json; is it a transformers model?")
    return ModelSource(repo_id, directory, config_file)
