"""Embedding throughput: ``llm.embed`` against sentence-transformers' ``encode`` on the same texts (issue 45's target:
BERT-base ≥ 3× sentence-transformers; and a Qwen3-Embedding-0.6B-shape figure, ``--shape qwen3-embedding-0.6b``).

A BERT-base-shaped encoder (12 layers, 768 wide, vocab 30,522; or the Qwen3-Embedding-0.6B decoder) with random weights and a WordPiece tokenizer trained
on Python's library source (the kind of text the demo model learnt), saved as a sentence-transformers folder (mean pooling, normalized); ``--texts`` texts of
``--min-words`` … ``--max-words`` words drawn from that corpus. Both sides start from strings, so both include
tokenization; each is run once to warm up, then timed. sentence-transformers runs at each ``--st-batch-size`` (its
default is 32) in the same dtype; the best is the baseline. Prints texts/s and tokens/s of each, their ratio, and the
lowest cosine similarity between the two sides' vectors.

    python3 scripts/embed_bench.py --device cuda --dtype bfloat16 --texts 8192
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sentence_transformers():
    """sentence-transformers, importing where scipy and scikit-learn are missing (the device has neither): they serve
    its sparse and pairwise-distance helpers only, which ``encode`` never calls; stand-ins are named in the output."""
    stubbed = []
    for module, names in (("scipy.sparse", ("coo_matrix",)), ("sklearn.metrics", ("pairwise_distances",))):
        try:
            __import__(module)
        except ImportError:
            stubbed.append(module)
            parent = module.split(".")[0]
            sys.modules.setdefault(parent, types.ModuleType(parent))
            stub = types.ModuleType(module)
            for name in names:
                setattr(stub, name, None)
            sys.modules[module] = stub
    warnings.filterwarnings("ignore")
    import sentence_transformers

    return sentence_transformers, stubbed


def _corpus_words() -> list[str]:
    """The words of some of Python's own library (the demo model's corpus is Python source too): on every machine."""
    import email
    import json

    sources = [path for package in (email, json) for path in sorted(Path(package.__file__).parent.glob("*.py"))]
    return re.findall(r"[A-Za-z_]+", " ".join(path.read_text(errors="ignore") for path in sources))


# The shapes measured: BERT-base (mean pooling) and Qwen3-Embedding-0.6B (a decoder: last-token pooling).
SHAPES = {"bert-base": ("mean", 768), "qwen3-embedding-0.6b": ("lasttoken", 1024)}


def _config(shape: str):
    from transformers import BertConfig, Qwen3Config

    if shape == "bert-base":
        return BertConfig()  # bert-base-uncased's
    return Qwen3Config(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, tie_word_embeddings=True)


def write_model(folder: Path, words: list[str], seed: int, shape: str = "bert-base") -> Path:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import AutoModel, PreTrainedTokenizerFast

    encoder = folder / "encoder"
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    lines = [" ".join(words[i:i + 64]) for i in range(0, len(words), 64)] or [" ".join(words)]
    tokenizer.train_from_iterator(lines, trainers.WordPieceTrainer(vocab_size=30522,
                                                                   special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                             special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                            mask_token="[MASK]", model_max_length=512).save_pretrained(encoder)
    torch.manual_seed(seed)
    AutoModel.from_config(_config(shape)).save_pretrained(encoder)
    sentence_transformers, _ = _sentence_transformers()
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    pooling, width = SHAPES[shape]
    modules = [Transformer(str(encoder), max_seq_length=512), Pooling(width, pooling), Normalize()]
    sentence_transformers.SentenceTransformer(modules=modules, device="cpu").save(str(folder / "st"))
    return folder / "st"


def timed(run, sync) -> tuple[object, float]:
    sync()
    began = time.perf_counter()
    result = run()
    sync()
    return result, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--texts", type=int, default=8192)
    parser.add_argument("--min-words", type=int, default=8)
    parser.add_argument("--max-words", type=int, default=256)
    parser.add_argument("--st-batch-size", default="32,128")
    parser.add_argument("--max-num-tokens", type=int, default=None, help="autodeploy's token budget a forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bert-base")
    args = parser.parse_args()
    sentence_transformers, stubbed = _sentence_transformers()
    from autodeploy import autodeploy

    rng = random.Random(args.seed)
    words = _corpus_words()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(args.min_words, args.max_words))) for _ in range(args.texts)]
    folder = write_model(Path(tempfile.mkdtemp(prefix="embed-bench-")), words, args.seed, args.shape)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    dtype = getattr(torch, args.dtype)

    overrides = {"scheduler": {"max_num_tokens": args.max_num_tokens}} if args.max_num_tokens else {}
    llm = autodeploy(str(folder), device=args.device, dtype=args.dtype, **overrides)
    print(f"autodeploy: {llm.verification}")
    print("kernels:", "; ".join(line.strip() for line in llm.pipeline_report().splitlines() if line.startswith("  ") and " → " in line)[:700])
    llm.embed(texts[:256])
    ours, seconds = timed(lambda: llm.embed(texts), sync)
    tokens = sum(ours.num_tokens)
    print(f"autodeploy: {len(texts) / seconds:,.1f} texts/s, {tokens / seconds:,.0f} tokens/s ({seconds:.2f} s; "
          f"{llm.embedder.forwards} forwards in all, budget {llm.embedder.max_num_tokens} tokens)")
    tokenizer = llm.tokenizer
    _, tokenize_seconds = timed(lambda: tokenizer(texts)["input_ids"], lambda: None)
    print(f"tokenization alone: {tokenize_seconds:.2f} s ({tokenize_seconds / seconds:.0%} of autodeploy's time)")

    model = sentence_transformers.SentenceTransformer(str(folder), device=args.device, model_kwargs={"dtype": dtype})
    best = None
    for batch_size in (int(b) for b in args.st_batch_size.split(",")):
        model.encode(texts[:256], batch_size=batch_size)
        theirs, st_seconds = timed(lambda: model.encode(texts, batch_size=batch_size, convert_to_tensor=True), sync)
        print(f"sentence-transformers {sentence_transformers.__version__} (batch_size {batch_size}): "
              f"{len(texts) / st_seconds:,.1f} texts/s, {tokens / st_seconds:,.0f} tokens/s ({st_seconds:.2f} s)")
        if best is None or st_seconds < best[1]:
            best = (batch_size, st_seconds, theirs)
    batch_size, st_seconds, theirs = best
    cosine = torch.nn.functional.cosine_similarity(ours.vectors.float(), theirs.float().cpu(), dim=-1)
    print(f"ratio: {st_seconds / seconds:.2f}× sentence-transformers' best (batch_size {batch_size}); "
          f"cosine similarity of the vectors: min {cosine.min():.5f}, mean {cosine.mean():.5f}"
          f"{'; stand-ins for ' + ', '.join(stubbed) + ' (unused by encode)' if stubbed else ''}")


if __name__ == "__main__":
    main()
