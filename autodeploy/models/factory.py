"""Model factory: HF config → HF model with parameters on the meta device (no weight memory).

Non-persistent buffers (RoPE ``inv_freq`` and the like) are computed for real while the model is
built, kept aside, and put back into the graph by ``load_weights``; everything is then moved to
meta so export traces a single-device model.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM,
                          AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel)

from autodeploy.errors import CheckpointError, ConfigError, UnsupportedModelError, error_summary
from autodeploy.models.checkpoint import CheckpointReader, StateDictReader
from autodeploy.models.embedding import EmbeddingSpec, embedding_spec
from autodeploy.models.encoder_decoder import EncoderDecoderSpec, encoder_decoder_spec
from autodeploy.models.source import ModelSource
from autodeploy.models.vision_language import VisionLanguageSpec, load_image_processor, vision_language_spec

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while buffers are computed on the CPU.

    ``torch.device("meta")`` would put buffers on meta too, losing values (RoPE frequencies) that no
    checkpoint stores.
    """
    register_parameter = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(module, name, param)
        if param is not None and not param.is_meta:  # re-registering a meta param (weight tying) keeps it
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter


def load_hf_config(source: ModelSource, trust_remote_code: bool = False) -> PretrainedConfig:
    try:
        config = AutoConfig.from_pretrained(source.config_file, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as error:
        model_type = _read_model_type(source)
        raise UnsupportedModelError(
            f"{source.name}: transformers does not know model type {model_type!r} ({error_summary(error)}); "
            f"upgrade transformers, or pass trust_remote_code=True if the checkpoint ships its own code"
        ) from error
    except OSError as error:
        raise UnsupportedModelError(f"{source.name}: cannot read {source.config_file}: {error}") from error
    return config


def _read_model_type(source: ModelSource) -> str | None:
    import json

    try:
        return json.loads(source.config_file.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _decoder_of_an_encoder_decoder(config: PretrainedConfig) -> bool:
    """BART-style ``…ForCausalLM`` classes are the decoder of an encoder-decoder model, saved with
    ``is_encoder_decoder=False``; their model type's own default says what the architecture is."""
    try:
        return bool(getattr(type(config)(), "is_encoder_decoder", False))
    except Exception:  # a config class that cannot be built with defaults: judge by the config given
        return False


# Sub-configs of models that also read images, audio or speech (their encoders are sub-models).
_OTHER_MODALITIES = ("vision", "audio", "vq", "image", "speech", "patch")

# Layer classes that keep a recurrent state instead of (or beside) an attention KV cache: Mamba and other
# state-space mixers, RWKV, xLSTM, linear / lightning / delta-rule attention, short convolutions, RG-LRU.
_RECURRENT_LAYER = re.compile(r"Mamba|Mixer|SSM|Rwkv|RWKV|Recurrent|LinearAttention|DeltaNet|DeltaAttention|ShortConv|Lightning|LSTM|Retention")


def _refuse_recurrent_layers(name: str, model: nn.Module) -> None:
    found = Counter(
        type(m).__name__ for m in model.modules()
        if _RECURRENT_LAYER.search(type(m).__name__) and not isinstance(m, PreTrainedModel)  # layers, not the model
    )
    if found:
        layers = ", ".join(f"{layer} ×{count}" for layer, count in found.items())
        raise UnsupportedModelError(
            f"{name}: this model has recurrent or state-space layers ({layers}); autodeploy's paged cache holds "
            f"attention keys and values only, so models with such layers are not supported yet"
        )


def config_dtype(config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def causal_lm_class(config: PretrainedConfig) -> type | None:
    """The transformers class ``AutoModelForCausalLM`` builds for ``config``; None for remote code."""
    from transformers.models.auto.auto_factory import _get_model_class

    try:
        return _get_model_class(config, AutoModelForCausalLM._model_mapping)
    except (KeyError, ValueError):
        return None


def attention_implementation(config: PretrainedConfig) -> str:
    """SDPA exports to one aten op; HF's eager attention is kept where SDPA would change the model —
    logit soft-capping (HF's SDPA path drops it), attention sinks (HF refuses SDPA for them) — and for
    model classes that have no SDPA path (Bloom, GPT-J, MPT, GPT-Neo, CodeGen, …)."""
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "model_type", "") == "gpt_oss":
        return "eager"
    model_class = causal_lm_class(config)
    if model_class is not None and not getattr(model_class, "_supports_sdpa", False):
        return "eager"
    return "sdpa"


def _encoder_attention(auto, config: PretrainedConfig) -> str:
    """SDPA where the encoder class has it (its attention then matches the canonical ``bidirectional_attention``);
    eager otherwise, which the cache stage refuses by name unless a pattern matches it."""
    from transformers.models.auto.auto_factory import _get_model_class

    try:
        model_class = _get_model_class(config, auto._model_mapping)
    except (KeyError, ValueError):
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


@dataclass
class ModelFactory:
    """Everything model-specific the pipeline needs: config, meta model, real buffers, checkpoint, tokenizer."""

    source: ModelSource
    hf_config: PretrainedConfig
    trust_remote_code: bool = False
    meta_model: nn.Module | None = None
    buffers: dict[str, torch.Tensor] | None = None
    tensors: dict[str, torch.Tensor] | None = None  # weights held in memory instead of a checkpoint folder (the twin's)

    @classmethod
    def from_source(cls, source: ModelSource, trust_remote_code: bool = False) -> ModelFactory:
        return cls(source, load_hf_config(source, trust_remote_code), trust_remote_code)

    def build_meta_model(self, dtype: torch.dtype) -> nn.Module:
        """The HF model with every parameter and buffer on meta; real buffer values in ``self.buffers``.
        Built once per dtype: preflight checks, verification and the factory stage share it."""
        if self.meta_model is not None and next(self.meta_model.parameters()).dtype == dtype:
            return self.meta_model
        config = self.hf_config
        kind = None
        encoder_decoder = self.encoder_decoder  # a family not served raises here, naming it
        # BERT-style encoders (is_decoder=False) are in the causal-LM mapping but attend bidirectionally: served as
        # embedding models and cross-encoders (models/embedding.py), their whole model one graph.
        embedding = self.embedding
        if encoder_decoder is not None or embedding is not None:
            pass  # served: the encoder and the decoder are graphs of one deployment; an encoder-only model is one
        elif getattr(config, "is_encoder_decoder", False) or _decoder_of_an_encoder_decoder(config):
            kind = "an encoder-decoder architecture (its causal-LM class is the decoder alone, made to read an encoder's output)"
        if kind is not None:
            raise UnsupportedModelError(
                f"{self.source.name}: {type(config).__name__} ({config.model_type}) is {kind}; "
                f"it is not a causal language model autodeploy can serve: it serves decoder-only causal LMs"
            )
        vision_language = self.vision_language
        modalities = [name for name in getattr(config, "sub_configs", None) or {} if name.startswith(_OTHER_MODALITIES)]
        if modalities and vision_language is None:
            raise UnsupportedModelError(
                f"{self.source.name}: {type(config).__name__} ({config.model_type}) is a multimodal model "
                f"({', '.join(modalities)}); autodeploy serves text-only decoders, so multimodal models are not supported yet"
            )
        if vision_language is None and encoder_decoder is None and embedding is None and causal_lm_class(config) is None \
                and not self.trust_remote_code:
            raise UnsupportedModelError(
                f"{self.source.name}: {type(config).__name__} ({config.model_type}) is not a causal language model: "
                f"transformers has no AutoModelForCausalLM class for it, and autodeploy serves decoder-only causal LMs"
            )
        config.use_cache = False
        try:
            with parameters_on_meta():
                if vision_language is not None:  # the whole model: both graphs are exported from it
                    model = AutoModelForImageTextToText.from_config(
                        config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=self.trust_remote_code)
                elif encoder_decoder is not None:  # likewise: the encoder and the decoder graphs
                    model = AutoModelForSeq2SeqLM.from_config(
                        config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=self.trust_remote_code)
                elif embedding is not None:  # the base model (an embedder) or the model with its classifier (a reranker)
                    auto = AutoModelForSequenceClassification if embedding.task == "score" else AutoModel
                    model = auto.from_config(config, dtype=dtype, attn_implementation=_encoder_attention(auto, config),
                                             trust_remote_code=self.trust_remote_code)
                else:
                    model = AutoModelForCausalLM.from_config(
                        config, dtype=dtype, attn_implementation=attention_implementation(config),
                        trust_remote_code=self.trust_remote_code,
                    )
        except (ValueError, ImportError) as error:
            built_as = "an encoder" if embedding is not None else "a causal language model"
            raise UnsupportedModelError(
                f"{self.source.name}: transformers could not build {type(config).__name__} ({config.model_type}) "
                f"as {built_as}: {error_summary(error)}"
            ) from error
        _refuse_recurrent_layers(self.source.name, model)
        if encoder_decoder is not None:
            self._untie_a_stored_head(model)
        model.eval()
        self.buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
        # Parameters are already on meta; move only the buffers (``model.to`` would untie tied weights).
        for submodule in model.modules():
            for name, buffer in submodule._buffers.items():
                if buffer is not None:
                    submodule._buffers[name] = buffer.to("meta")
        self.meta_model = model
        return model

    def _untie_a_stored_head(self, model: nn.Module) -> None:
        """transformers 5 builds T5 with its head tied to the embedding whatever the checkpoint is (its config forces
        ``tie_word_embeddings``; ``scale_decoder_outputs`` tells v1.0 from v1.1), and unties the two when it loads a
        checkpoint that stores the head apart with other values (v1.1, Flan-T5). A head the checkpoint stores gets a
        parameter of its own here: the checkpoint's head where the two differ, the same output where they do not."""
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if head is None or head.weight is not embedding.weight:
            return
        name = next(path for path, module in model.named_modules() if module is head) + ".weight"
        if name in self._stored_keys():
            head.weight = nn.Parameter(torch.empty_like(head.weight), requires_grad=False)  # on meta, as the rest

    def _stored_keys(self) -> set[str]:
        """The names of the tensors the weights come from; none for a config without a checkpoint (random weights)."""
        if self.tensors is not None:
            return set(self.tensors)
        try:
            return set(CheckpointReader(self.source.directory).keys())
        except CheckpointError:
            return set()

    @functools.cached_property
    def vision_language(self) -> VisionLanguageSpec | None:
        """What the pipeline and runtime need of a vision-language checkpoint (``models/vision_language.py``);
        None for a text-only model. A multimodal family autodeploy does not serve raises here."""
        return vision_language_spec(self.hf_config, self.source.name)

    @functools.cached_property
    def encoder_decoder(self) -> EncoderDecoderSpec | None:
        """What the pipeline and runtime need of an encoder–decoder checkpoint (``models/encoder_decoder.py``); None
        for any other. An encoder–decoder family autodeploy does not serve raises here."""
        return encoder_decoder_spec(self.hf_config, self.source.name)

    @functools.cached_property
    def embedding(self) -> EmbeddingSpec | None:
        """What the pipeline and runtime need of an encoder-only checkpoint (``models/embedding.py``): an embedder or a
        cross-encoder; None for any other model."""
        return embedding_spec(self.hf_config, self.source.directory, self.source.name)

    @functools.cached_property
    def prequantized(self):
        """The checkpoint's own quantization (``autodeploy/models/prequantized.py``), or None for a float checkpoint."""
        from autodeploy.models.prequantized import detect_prequantized

        return detect_prequantized(self.hf_config, self.source.directory)

    def checkpoint_reader(self) -> CheckpointReader | StateDictReader:
        """Where ``load_weights`` reads the weights: the in-memory ``tensors`` if given, else the checkpoint folder."""
        return StateDictReader(self.tensors, self.source.directory) if self.tensors is not None else CheckpointReader(self.source.directory)

    def load_image_processor(self):
        """A vision-language checkpoint's image processor (``models/vision_language.load_image_processor``)."""
        return load_image_processor(self.source.directory, self.source.name)

    def load_tokenizer(self, tokenizer: str | None = None):
        """The checkpoint's tokenizer (or ``tokenizer``), or None when there are no tokenizer files."""
        from transformers import AutoTokenizer

        location = tokenizer or str(self.source.directory)
        try:
            return AutoTokenizer.from_pretrained(location, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError, TypeError, ImportError) as error:
            if tokenizer is not None:
                raise ConfigError(f"cannot load tokenizer {tokenizer!r}: {error_summary(error)}") from error
            if isinstance(error, ImportError):  # the tokenizer class needs a package that is not installed
                logger.warning("the checkpoint's tokenizer cannot be loaded (%s); prompts must be token ids", error_summary(error))
            else:
                logger.info("no tokenizer in %s (%s)", location, error)
            return None
