"""Encoder-only checkpoints (BERT, RoBERTa, XLM-R and their kin) and decoder embedding models: which ones autodeploy serves
as embedding models or cross-encoder rerankers, and what it needs to know of them.

An encoder-only model reads a whole text at once with bidirectional self-attention and has nothing to generate:
it is served for its last hidden state, pooled into one vector a text (``task="embed"``: retrieval embeddings), or
for a classifier over a (query, document) pair (``task="score"``: a cross-encoder's relevance, from a
``…ForSequenceClassification`` checkpoint with one label). autodeploy exports it as one graph, the ``"embed"`` role
(``export/encoder_only.py``): many texts packed into one forward with no padding.

    >>> spec = embedding_spec(config, folder)   # None for a model that is not an encoder-only one
    >>> spec.task, spec.pooling, spec.normalize

How a text's vectors are pooled and normalized comes from the folder's sentence-transformers modules where it has
them (``modules.json``, ``1_Pooling/config.json``, a ``Normalize`` module), as ``SentenceTransformer.encode``
computes them; without them: the ``[CLS]`` row, normalized (what retrieval models without those files, and OpenAI's
embeddings, give). A sentence-transformers module autodeploy does not compute (a ``Dense`` projection, max or
weighted-mean pooling) is refused by name rather than left out.

A decoder (a causal LM's config) is an embedding model when its folder is a sentence-transformers model (Qwen3-Embedding,
gte-Qwen2: ``modules.json`` with last-token pooling): its base model's last hidden state (after the final norm),
each text read causally, pooled as the modules say. Without those files a decoder is a language model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers import PretrainedConfig

from autodeploy.errors import UnsupportedModelError

# sentence-transformers' Pooling modes → autodeploy's (the modes it does not compute are refused by name).
_ST_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_ST_UNSERVED = {"pooling_mode_max_tokens": "max pooling", "pooling_mode_mean_sqrt_len_tokens": "mean-sqrt-len pooling",
                "pooling_mode_weightedmean_tokens": "weighted-mean pooling"}
# Encoder-only model types whose config says nothing of decoding (no add_cross_attention / is_decoder)
ENCODER_TYPES = ("modernbert",)
# Encoder types served as embedders only: the score graph computes BERT's pooler and RoBERTa's classification head, not
# ModernBERT's (a prediction head before its classifier, over the [CLS] row or the mean by classifier_pooling)
EMBED_ONLY_TYPES = ("modernbert",)
# sentence-transformers ≥ 6 names a mode by a word: the earlier boolean key it stands for
_ST_WORDS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken",
             "max": "pooling_mode_max_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
             "weightedmean": "pooling_mode_weightedmean_tokens"}
_ST_MODULES_SERVED = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class EmbeddingSpec:
    """What the pipeline and the runtime need to know of an encoder-only checkpoint."""

    model_type: str
    task: str  # "embed": pooled vectors; "score": a cross-encoder's relevance of a (query, document) pair
    pooling: str  # the rows a text's vector is made of: "cls" (its first), "mean" (all), "last"
    normalize: bool  # L2-normalized vectors (the folder's sentence-transformers Normalize module, or the default)
    source: str  # where pooling and normalize came from, for the build report
    # sentence-transformers' prompts (config_sentence_transformers.json): text put before an input by name ("query"),
    # the one every input gets unless another is named, and whether pooling reads the prompt's rows (Pooling's include_prompt)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True


def is_encoder_only(config: PretrainedConfig) -> bool:
    """BERT-style encoders: the configs that can add cross-attention to become a decoder, and are not one
    (``is_decoder`` False). GPT-NeoX also carries ``is_decoder=False``, but without ``add_cross_attention``."""
    return (hasattr(config, "add_cross_attention") and getattr(config, "is_decoder", None) is False) or config.model_type in ENCODER_TYPES


def embedding_spec(config: PretrainedConfig, directory: Path | None, name: str) -> EmbeddingSpec | None:
    """The embedding spec of ``config`` (its checkpoint folder ``directory``, for sentence-transformers' files), or
    None for a model that is not encoder-only. Raises ``UnsupportedModelError`` for an encoder-only checkpoint whose
    head or sentence-transformers modules autodeploy does not compute."""
    model_type = config.model_type
    if not is_encoder_only(config):
        # A decoder embedding model (Qwen3-Embedding, gte-Qwen2): a causal LM whose folder is a sentence-transformers model,
        # its last hidden state pooled (the last token, as their Pooling modules say).
        if directory is None or not (Path(directory) / "modules.json").is_file():
            return None
        pooling, normalize, source = _sentence_transformers_modules(directory, name, default_pooling="last")
        spec = EmbeddingSpec(model_type, "embed", pooling, normalize, f"a decoder embedding model; {source}")
        return _with_prompts(spec, Path(directory), name)
    architectures = list(getattr(config, "architectures", None) or [])
    if any(arch.endswith("ForSequenceClassification") for arch in architectures):
        if model_type in EMBED_ONLY_TYPES:
            raise UnsupportedModelError(f"{name}: autodeploy does not compute {architectures[0]}'s classification head yet; "
                                        f"it serves {model_type} checkpoints as embedding models (the base model)")
        labels = int(getattr(config, "num_labels", 1))
        if labels != 1:
            raise UnsupportedModelError(
                f"{name}: {architectures[0]} classifies into {labels} labels; autodeploy serves cross-encoder rerankers "
                f"with one relevance logit (num_labels=1), as sentence-transformers' CrossEncoder scores them")
        return EmbeddingSpec(model_type, "score", "cls", False, "the checkpoint's sequence-classification head")
    unserved_heads = [arch for arch in architectures if arch.endswith(("ForTokenClassification", "ForQuestionAnswering",
                                                                          "ForMultipleChoice", "ForNextSentencePrediction"))]
    if unserved_heads:
        raise UnsupportedModelError(f"{name}: {unserved_heads[0]} is a task head autodeploy does not serve; it serves "
                                    f"encoder-only models as embedders (their hidden states pooled) and one-label "
                                    f"cross-encoders (…ForSequenceClassification)")
    pooling, normalize, source = _sentence_transformers_modules(directory, name)
    spec = EmbeddingSpec(model_type, "embed", pooling, normalize, source)
    return spec if directory is None else _with_prompts(spec, Path(directory), name)


def _with_prompts(spec: EmbeddingSpec, directory: Path, name: str) -> EmbeddingSpec:
    """``spec`` with the folder's sentence-transformers prompts (``config_sentence_transformers.json``) and whether its
    pooling reads a prompt's rows (``1_Pooling/config.json``'s ``include_prompt``)."""
    config_file = directory / "config_sentence_transformers.json"
    if not config_file.is_file():
        return spec
    try:
        config = json.loads(config_file.read_text())
        prompts = {str(key): str(value) for key, value in (config.get("prompts") or {}).items()}
        default = config.get("default_prompt_name")
        modules = json.loads((directory / "modules.json").read_text()) if (directory / "modules.json").is_file() else []
        pooling_path = next((m.get("path", "") for m in modules if m["type"].rsplit(".", 1)[-1] == "Pooling"), None)
        pooling_config = json.loads((directory / pooling_path / "config.json").read_text()) if pooling_path else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise UnsupportedModelError(f"{name}: cannot read its sentence-transformers prompts ({error}); fix or remove "
                                    f"{config_file.name}") from None
    if default is not None and default not in prompts:
        raise UnsupportedModelError(f"{name}: its default_prompt_name {default!r} is not one of its prompts ({', '.join(prompts)})")
    include = bool(pooling_config.get("include_prompt", True))
    if default is not None and prompts[default] and not include:
        raise UnsupportedModelError(f"{name}: every input gets its {default!r} prompt, and its pooling leaves the prompt's rows "
                                    f"out (include_prompt false), which autodeploy does not do yet")
    return replace(spec, prompts=prompts, default_prompt_name=default, include_prompt=include)


def _sentence_transformers_modules(directory: Path | None, name: str, default_pooling: str = "cls") -> tuple[str, bool, str]:
    """Pooling and normalization from the folder's sentence-transformers modules; ``("cls", True, …)`` without them."""
    modules_file = None if directory is None else Path(directory) / "modules.json"
    if modules_file is None or not modules_file.is_file():
        return "cls", True, "the default (no sentence-transformers modules.json): the [CLS] row, normalized"
    try:
        modules = json.loads(modules_file.read_text())
        kinds = {module["type"].rsplit(".", 1)[-1]: module.get("path", "") for module in modules}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise UnsupportedModelError(f"{name}: cannot read its sentence-transformers modules.json ({error}); fix or remove the "
                                    f"file") from None
    unserved = [kind for kind in kinds if kind not in _ST_MODULES_SERVED]
    if unserved:
        raise UnsupportedModelError(f"{name}: its sentence-transformers pipeline has {', '.join(unserved)} module(s), which "
                                    f"autodeploy does not compute (it computes {', '.join(_ST_MODULES_SERVED)}); its "
                                    f"vectors would differ from SentenceTransformer.encode's")
    pooling = default_pooling
    if "Pooling" in kinds:
        try:
            modes = json.loads((Path(directory) / kinds["Pooling"] / "config.json").read_text())
        except (OSError, ValueError) as error:
            raise UnsupportedModelError(f"{name}: cannot read its sentence-transformers pooling config ({error})") from None
        if "pooling_mode" in modes:  # sentence-transformers ≥ 6: {"pooling_mode": "mean"} (or a list of modes)
            given = modes["pooling_mode"]
            wanted = [_ST_WORDS.get(mode, mode) for mode in ([given] if isinstance(given, str) else list(given))]
        else:  # earlier releases: one boolean a mode
            wanted = [mode for mode in (*_ST_POOLING, *_ST_UNSERVED) if modes.get(mode)]
        if len(wanted) != 1 or wanted[0] not in _ST_POOLING:
            described = ", ".join(_ST_UNSERVED.get(mode, _ST_POOLING.get(mode, mode)) for mode in wanted) or "none"
            raise UnsupportedModelError(f"{name}: its sentence-transformers pooling is {described}; autodeploy pools one way a "
                                        f"model: the [CLS] row, the mean of the rows, or the last row")
        pooling = _ST_POOLING[wanted[0]]
    normalize = "Normalize" in kinds
    return pooling, normalize, f"sentence-transformers modules: {pooling} pooling{', normalized' if normalize else ''}"
