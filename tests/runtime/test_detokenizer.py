"""Incremental detokenization equals decoding the whole output, after every token, for the tokenizer
families the engine meets: byte-level BPE (GPT-2, Llama 3, the demo model: characters split over tokens),
SentencePiece-style ``▁`` spacing (Llama 2, Mistral: the first token's space dropped), special tokens
skipped, and a tokenizer that rewrites spaces across tokens (decoded whole)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import autodeploy
from autodeploy.runtime.detokenizer import IncrementalDetokenizer
from tests.tiny_models import train_tiny_tokenizer

CORPUS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
          "Grüße, 世界! ünïcödé façade — naïve café 😀 ✓\n", "The quick brown fox jumps over the lazy dog. Don't stop .\n"] * 20


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (``▁`` for spaces, byte fallback), as Llama 2's and Mistral's are built."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    tiny = tmp_path_factory.mktemp("byte-level")
    train_tiny_tokenizer(tiny)
    demo = Path(autodeploy.__file__).parent / "assets" / "tiny-code-llama"
    cleaning = AutoTokenizer.from_pretrained(tiny)
    cleaning.clean_up_tokenization_spaces = True
    return {"byte-level": AutoTokenizer.from_pretrained(tiny), "demo": AutoTokenizer.from_pretrained(demo),
            "metaspace": metaspace_tokenizer(), "cleaning": cleaning}


@pytest.mark.parametrize("name", ["byte-level", "demo", "metaspace", "cleaning"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_text_after_every_token_equals_decoding_all(tokenizers, name, data):
    tokenizer = tokenizers[name]
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
    ids += tokenizer(data.draw(st.sampled_from(CORPUS[:3])), add_special_tokens=False).input_ids[: data.draw(st.integers(0, 40))]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.incremental == (name != "cleaning")
    for end in range(len(ids) + 1):
        assert detokenizer.text(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True)


def test_a_list_that_does_not_extend_the_last_one_starts_over(tokenizers):
    tokenizer = tokenizers["byte-level"]
    first, other = tokenizer("def f(x):").input_ids, tokenizer("import os").input_ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    for ids in (first, first[:2], other, other + first):  # shorter, different (a beam reordered), longer
        assert detokenizer.text(ids) == tokenizer.decode(ids, skip_special_tokens=True)
