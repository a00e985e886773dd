"""Tiny random-weight encoder-only checkpoints (BERT, XLM-R; embedders, cross-encoders, sentence-transformers
folders), with a WordPiece tokenizer trained on the fly (no hub access)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import (AutoModel, AutoModelForSequenceClassification, BertConfig, PretrainedConfig, PreTrainedTokenizerFast,
                          XLMRobertaConfig)

VOCAB_SIZE = 200
CORPUS = ["the quick brown fox jumps over the lazy dog", "paged attention keeps keys and values in blocks of tokens",
          "an embedding model reads a whole text at once", "a reranker scores how well a document answers a query"]


def tiny_encoder_config(kind: str, **overrides) -> PretrainedConfig:
    """``bert`` or ``xlm-roberta`` (RoBERTa-style positions after the padding id, one token type)."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=66, pad_token_id=0)
    if kind == "bert":
        return BertConfig(**{**common, "max_position_embeddings": 64, **overrides})
    if kind == "xlm-roberta":
        return XLMRobertaConfig(**{**common, "type_vocab_size": 1, **overrides})
    raise ValueError(f"no tiny encoder config for {kind!r}")


def write_wordpiece_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A lower-casing WordPiece tokenizer with BERT's templates: ``[CLS] a [SEP]`` and ``[CLS] a [SEP] b [SEP]`` (token
    type 1 for the second segment)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(CORPUS * 10, trainers.WordPieceTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(directory)
    return fast


def write_tiny_encoder(directory: Path, kind: str = "bert", task: str = "embed", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random encoder saved with its tokenizer: the base model (``task="embed"``) or a one-label
    ``…ForSequenceClassification`` (``"score"``). Returns the float32 eval-mode Hugging Face model."""
    config = tiny_encoder_config(kind, **overrides)
    if task == "score":
        config.num_labels = overrides.get("num_labels", 1)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if task == "score" else AutoModel
    model = auto.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # biases and norms away from HF's 0 and 1, so a dropped one shows
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
    model.save_pretrained(directory)
    write_wordpiece_tokenizer(directory)
    return model


def write_sentence_transformer(directory: Path, pooling: str = "mean", normalize: bool = True, kind: str = "bert") -> Path:
    """A sentence-transformers folder (modules.json, pooling, normalization) around a tiny encoder."""
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

        encoder = directory / "encoder"
        write_tiny_encoder(encoder, kind)
        modules = [Transformer(str(encoder)), Pooling(64, pooling)] + ([Normalize()] if normalize else [])
        SentenceTransformer(modules=modules, device="cpu").save(str(directory / "st"))
    return directory / "st"


def write_decoder_embedder(directory: Path, pooling: str = "lasttoken") -> Path:
    """A sentence-transformers folder around a tiny random Qwen3 base model (Qwen3-Embedding's layout: last-token
    pooling, normalized) with the tiny byte-level BPE tokenizer; the folder's path."""
    from sentence_transformers import SentenceTransformer
    from transformers import Qwen3Config

    from tests.tiny_models import TINY_COMMON, train_tiny_tokenizer

    decoder = directory / "decoder"
    torch.manual_seed(0)
    AutoModel.from_config(Qwen3Config(**TINY_COMMON, head_dim=16), attn_implementation="eager").eval().save_pretrained(decoder)
    train_tiny_tokenizer(decoder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

        modules = [Transformer(str(decoder)), Pooling(TINY_COMMON["hidden_size"], pooling), Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(directory / "st"))
    return directory / "st"
