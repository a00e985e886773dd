"""Tiny random-weight Hugging Face models and checkpoints, built on the fly (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, PretrainedConfig, Qwen2Config

VOCAB_SIZE = 512

TINY_COMMON = dict(  # shared by every tiny test config
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral")


def tiny_config(arch: str) -> PretrainedConfig:
    if arch == "llama":
        return LlamaConfig(**TINY_COMMON, tie_word_embeddings=True)
    if arch == "mistral":
        return MistralConfig(**TINY_COMMON, sliding_window=16)
    if arch == "qwen2":
        return Qwen2Config(**TINY_COMMON)
    if arch == "mixtral":
        return MixtralConfig(**TINY_COMMON, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(f"no tiny config for {arch!r}")


def tiny_hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """An fp32 eval-mode HF causal LM with random weights (deterministic per seed)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def train_tiny_tokenizer(directory: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """A byte-level BPE tokenizer trained on a few lines of Python, saved as HF fast-tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        "for i in range(10):\n    print(i * i)\n",
    ] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)


def write_tiny_checkpoint(arch: str, directory: Path, seed: int = 0, max_shard_size: str | None = None) -> torch.nn.Module:
    """Save a tiny random model (safetensors) and tokenizer into ``directory``; return the HF model."""
    model = tiny_hf_model(arch, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    train_tiny_tokenizer(directory)
    return model
