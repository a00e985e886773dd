"""``Deployment``: a built model as one record — what a build (or a reload) makes and ``LLM``, ``Engine``, save
and load take.

It holds the graphs by role (``"model"``, and ``"vision"`` for a vision-language model; an encoder graph is a
further role, not further constructor arguments), the serving signature the cache stage declared (graph inputs in order,
KV cache specs, the decode batch and prefill token sizes captured as graphs), the tokenizer and end-of-sequence
ids, the resolved settings, the build report and the folder the model came from.

The pipeline, the runtime and ``autodeploy/artifact`` all import this module, so it imports only records
below them (the serving signature, the build report, the typed errors) and torch.

    >>> from autodeploy import autodeploy
    >>> deployment = autodeploy().deployment
    >>> deployment.signature.inputs[:2], deployment.graph is deployment.graphs["model"]
    (('input_ids', 'position_ids'), True)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from autodeploy.build_report import BuildReport, TransformRecord, VerificationReport
from autodeploy.custom_ops.serving_signature import KVCacheSpec, ServingSignature
from autodeploy.errors import ConfigError

MODEL = "model"  # the role of the graph that turns token ids into logits; every generating deployment has one
VISION = "vision"  # a vision-language model's: preprocessed images in, the feature rows the model graph reads out
ENCODER = "encoder"  # an encoder–decoder's: a request's input ids in, every decoder layer's cross keys and values out
EMBED = "embed"  # an encoder-only model's: texts packed into one row in, hidden states (or a reranker's scores) out
ROLES = (MODEL, VISION, ENCODER, EMBED)
# An "embed" graph's meta key: its attention keeps the texts packed in its row apart (transforms/pack_bidirectional_attention.py)
PACKED_TEXTS = "autodeploy_packed_texts"


@dataclass(frozen=True)
class ImageBoundaries:
    """The tokens a vision-language model puts around each image's placeholders (Gemma 3's start and end of image;
    a prompt puts the start token where an image goes) and the text its processor puts on both sides of them."""

    start_token_id: int
    end_token_id: int
    separator: str = ""


POOLINGS = ("cls", "mean", "last")  # an embedder's rows a text pooled into its vector: the first, their mean, the last


@dataclass(frozen=True)
class EmbeddingHead:
    """How an encoder-only deployment's ``"embed"`` graph is served (``models/embedding.py`` decides): ``task``
    ``"embed"`` pools its hidden states into one vector a text (``pooling``, then L2 ``normalize``), ``"score"``
    reads its logit of a (query, document) pair; texts of at most ``max_text_tokens`` tokens, ids below
    ``vocab_size``; an embedder's vectors have ``width`` components. ``prompts``: sentence-transformers' texts put before
    a string input by name (``default_prompt_name``'s unless another is named); ``include_prompt``: whether pooling reads
    a prompt's rows."""

    task: str
    pooling: str
    normalize: bool
    max_text_tokens: int
    vocab_size: int
    width: int
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True


@dataclass
class Deployment:
    """A built model: its graphs by role, how to serve them, and how it was built."""

    graphs: Mapping[str, fx.GraphModule]
    signature: ServingSignature
    settings: Any  # the resolved settings (an OmegaConf DictConfig, autodeploy/config.py)
    tokenizer: Any = None  # a Hugging Face tokenizer; None serves token ids only
    eos_token_ids: tuple[int, ...] = ()
    report: BuildReport = field(default_factory=BuildReport)
    model_directory: str | None = None  # the checkpoint or config folder it was built from
    # A vision-language model's image processor (transformers'; it resizes and normalises images for the vision graph).
    image_processor: Any = None
    image_token_id: int | None = None  # the placeholder token whose embeddings the vision graph's rows replace
    image_boundaries: ImageBoundaries | None = None  # tokens around each image's placeholders, where the model has them
    # An encoder–decoder's: the decoder's first input token (its "prompt"; the request's prompt is the encoder's input).
    decoder_start_token_id: int | None = None
    # A draft model for speculative decoding (speculative.method "draft"): a deployment of its own, with its own
    # serving signature, settings and build report, whose runner and KV pool sit beside the model's.
    draft: Deployment | None = None
    # An encoder-only model's (its graph is the "embed" role, and it has no "model" graph): how it is served.
    embedding: EmbeddingHead | None = None

    def __post_init__(self) -> None:
        if (MODEL in self.graphs) == (EMBED in self.graphs) or (EMBED in self.graphs) != (self.embedding is not None):
            raise ConfigError(f"a Deployment needs a {MODEL!r} graph (token ids in, logits out) or an {EMBED!r} graph and its "
                              f"EmbeddingHead; it has {sorted(self.graphs)}"
                              f"{' and an EmbeddingHead' if self.embedding is not None else ''}")
        self.graphs = dict(self.graphs)
        self.eos_token_ids = tuple(int(token) for token in self.eos_token_ids)

    @property
    def graph(self) -> fx.GraphModule:
        """The ``"model"`` graph: token ids and KV pages in, logits out."""
        return self.graphs[MODEL]

    @property
    def vocab_size(self) -> int:
        """The width of the model graph's logits, as the graph's output declares it (an embedding model's vocabulary)."""
        if self.embedding is not None:
            return self.embedding.vocab_size
        output = next(n for n in self.graph.graph.nodes if n.op == "output")
        value = fx.node.map_aggregate(output.args, lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a)
        logits = value[0][0] if isinstance(value[0], (list, tuple)) else value[0]
        return int(logits.shape[-1])


def as_deployment(caller: str, deployment, legacy_arguments: tuple, legacy_keywords: dict) -> Deployment:
    """``deployment`` itself, or, for the form before ``Deployment`` (``caller(graph, graph_inputs, settings,
    tokenizer, eos_token_ids, records, kv_caches, model_directory, verification, decode_graph_batch_sizes,
    prefill_graph_token_sizes)``, with those names and in that order), the deployment those loose arguments
    describe, with a ``DeprecationWarning`` at the caller's caller."""
    if isinstance(deployment, Deployment):
        if legacy_arguments or legacy_keywords:
            raise TypeError(f"{caller} takes the Deployment alone")
        return deployment
    warnings.warn(f"{caller}'s graph, graph_inputs, settings, ... arguments are deprecated: pass one Deployment "
                  f"(autodeploy.deployment.Deployment)", DeprecationWarning, stacklevel=3)
    return _from_loose_arguments(deployment, *legacy_arguments, **legacy_keywords)


def _from_loose_arguments(
    graph: fx.GraphModule,
    graph_inputs: Sequence[str],
    settings,
    tokenizer=None,
    eos_token_ids: Sequence[int] = (),
    records: Sequence[TransformRecord] | None = None,
    kv_caches: Sequence[KVCacheSpec] = (),
    model_directory: str | None = None,
    verification: VerificationReport | None = None,
    decode_graph_batch_sizes: Sequence[int] = (),
    prefill_graph_token_sizes: Sequence[int] = (),
) -> Deployment:
    signature = ServingSignature(tuple(graph_inputs), tuple(kv_caches), tuple(decode_graph_batch_sizes),
                                 tuple(prefill_graph_token_sizes))
    return Deployment({MODEL: graph}, signature, settings, tokenizer, tuple(eos_token_ids),
                      BuildReport(list(records or []), verification), model_directory)
