"""The accuracy workload of ``autodeploy bench``: does the deployed model still compute the HF model?

Two measures, used to judge lossy transforms such as quantization:

* :func:`compare_with_hf` — top-1 agreement and max/mean |logit error| of the deployed model against HF
  eager on a fixed prompt set (:func:`fixed_prompts`), every position of every prompt compared;
* :func:`perplexity` — perplexity of the deployed model on a text, with the standard sliding-window
  recipe (each token scored once, with as much left context as the window allows).

>>> from autodeploy import autodeploy
>>> from autodeploy.bench.accuracy import compare_with_hf, fixed_prompts, load_reference_model
>>> llm = autodeploy("path/to/checkpoint", device="cpu")                        # doctest: +SKIP
>>> prompts = fixed_prompts(llm.vocab_size, llm.tokenizer)                      # doctest: +SKIP
>>> compare_with_hf(llm, load_reference_model(llm), prompts).top1_agreement     # doctest: +SKIP
1.0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm import tqdm

from autodeploy.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from autodeploy.frontend.llm import LLM

# The fixed prompt set: varied English prose and code, so that agreement is measured on the kind of
# text a model is deployed for rather than on one style. Changing these lines changes every baseline.
PROMPT_TEXTS = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1969, two astronauts walked on the surface of the Moon while a third orbited above them.",
    "import os\nimport sys\n\nfor name in sorted(os.listdir(sys.argv[1])):\n    print(name)\n",
    "To make bread, mix flour, water, salt and yeast, knead the dough, and let it rise for an hour.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The committee will meet on Tuesday to review the budget and vote on the new proposal.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (id) GROUP BY name;",
    "Water boils at one hundred degrees Celsius at sea level, but at a lower temperature in the mountains.",
    "for (int i = 0; i < n; ++i) {\n    sum += values[i] * weights[i];\n}\n",
    "She opened the letter slowly, read the first line twice, and then sat down by the window.",
    "const total = items.filter(item => item.active).reduce((acc, item) => acc + item.price, 0);",
    "Photosynthesis turns sunlight, carbon dioxide and water into sugar and oxygen inside the leaves.",
    "#!/bin/bash\nset -euo pipefail\nfor file in *.txt; do\n  wc -l \"$file\"\ndone\n",
    "Q: What is the capital of France?\nA: The capital of France is Paris.\nQ: And of Italy?\nA:",
    "fn main() {\n    let words = vec![\"alpha\", \"beta\", \"gamma\"];\n    println!(\"{}\", words.join(\", \"));\n}\n",
)


@dataclass
class AccuracyReport:
    """Deployed model vs HF eager over every position of a prompt set."""

    num_prompts: int
    num_tokens: int  # positions compared
    top1_agreement: float  # fraction of positions where argmax(deployed) == argmax(HF)
    max_abs_logit_error: float
    mean_abs_logit_error: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PerplexityReport:
    """Perplexity of the deployed model on a text: ``exp(mean_nll)`` over ``num_tokens`` scored tokens."""

    perplexity: float
    num_tokens: int
    mean_nll: float

    def to_dict(self) -> dict:
        return asdict(self)


def fixed_prompts(vocab_size: int, tokenizer=None, count: int = 16, length: int = 64, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` token ids, the same on every call.

    With a tokenizer: the first ``count`` of :data:`PROMPT_TEXTS`, each encoded as the tokenizer encodes a
    prompt (special tokens included) and repeated (``"\\n"``-separated, without special tokens) until it is
    ``length`` tokens long. Without one: uniform random ids in ``[0, vocab_size)`` from a generator seeded
    with ``seed``.

    >>> [len(p) for p in fixed_prompts(512, count=2, length=8)]
    [8, 8]
    """
    if count < 1 or length < 1:
        raise ConfigError(f"the accuracy prompt set needs count >= 1 and length >= 1, got count={count}, length={length}")
    if tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (count, length), generator=generator).tolist()
    if count > len(PROMPT_TEXTS):
        raise ConfigError(f"the built-in prompt set has {len(PROMPT_TEXTS)} texts; ask for at most that many prompts, got {count}")
    prompts = []
    for text in PROMPT_TEXTS[:count]:
        token_ids = list(tokenizer(text).input_ids)
        repeat = list(tokenizer("\n" + text, add_special_tokens=False).input_ids)
        while len(token_ids) < length:
            token_ids += repeat
        prompts.append(token_ids[:length])
    outside = sorted({t for p in prompts for t in p if not 0 <= t < vocab_size})
    if outside:
        raise ConfigError(
            f"the tokenizer produced ids {outside[:4]} outside the model's vocabulary [0, {vocab_size}); does it belong to this model?"
        )
    return prompts


def compare_with_hf(llm: LLM, hf_model: PreTrainedModel, prompts: list[list[int]]) -> AccuracyReport:
    """Top-1 agreement and |logit error| of ``llm`` against ``hf_model`` (eager, no cache) on ``prompts``.

    Both sides' logits are compared in float32, so the error measures the deployed model, not the cast.
    """
    if not prompts:
        raise ConfigError("the accuracy prompt set is empty; pass at least one prompt")
    agreeing = compared = compared_logits = 0
    max_error = 0.0
    error_sum = 0.0  # float64 accumulation: millions of positions × vocab would lose precision in float32
    device = next(hf_model.parameters()).device
    for tokens in tqdm(prompts, desc="comparing with HF", unit="prompt", leave=False, mininterval=2.0, disable=None):
        with torch.inference_mode():
            reference = hf_model(torch.tensor([tokens], device=device), use_cache=False).logits[0].float().cpu()
            deployed = llm.logits([tokens])[0].float()
        if deployed.shape != reference.shape:
            raise ConfigError(
                f"deployed logits {tuple(deployed.shape)} and HF logits {tuple(reference.shape)} differ in shape; "
                f"is the reference model the one that was deployed?"
            )
        error = (deployed - reference).abs()
        agreeing += int((deployed.argmax(-1) == reference.argmax(-1)).sum())
        compared += len(tokens)
        compared_logits += error.numel()
        max_error = max(max_error, float(error.max()))
        error_sum += float(error.double().sum())
    return AccuracyReport(
        num_prompts=len(prompts),
        num_tokens=compared,
        top1_agreement=agreeing / compared,
        max_abs_logit_error=max_error,
        mean_abs_logit_error=error_sum / compared_logits,
    )


def load_reference_model(llm: LLM) -> PreTrainedModel:
    """The deployed checkpoint as an HF eager model, in the deployed dtype and on the deployed device."""
    from transformers import AutoModelForCausalLM

    from autodeploy.models.checkpoint import CheckpointReader

    settings = llm.settings
    if settings.weights == "random":
        raise ConfigError(
            "the deployed model has random weights (weights=random), so HF's model would have different ones and "
            "agreement would mean nothing; deploy a checkpoint with weights to measure accuracy"
        )
    directory = llm.model_directory
    try:
        CheckpointReader(directory)
    except CheckpointError as error:
        raise ConfigError(f"cannot load the HF reference model: {error}") from error
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=getattr(torch, settings.dtype),
        attn_implementation="eager",
        trust_remote_code=settings.trust_remote_code,
    )
    return model.to(settings.device).eval()


def perplexity(llm: LLM, text: str, window: int | None = None, stride: int | None = None) -> PerplexityReport:
    """Perplexity of ``llm`` on ``text`` with sliding windows (the Hugging Face recipe).

    Windows of at most ``window`` tokens (default ``min(max_seq_len, 1024)``) start every ``stride`` tokens
    (default ``window // 2``); each window scores only the tokens no earlier window scored, so every token
    after the first is scored exactly once, with at least ``window - stride`` tokens of left context.
    """
    if llm.tokenizer is None:
        raise ConfigError("perplexity needs a tokenizer, and this model has none; pass tokenizer='…' when deploying")
    window = window if window is not None else min(int(llm.settings.max_seq_len), 1024)
    stride = stride if stride is not None else window // 2
    if not 2 <= window <= llm.settings.max_seq_len:
        raise ConfigError(f"the perplexity window must be between 2 and max_seq_len={llm.settings.max_seq_len} tokens, got {window}")
    # stride == window would leave each window's first token without the context it is predicted from.
    if not 1 <= stride < window:
        raise ConfigError(f"the perplexity stride must be at least 1 and less than the window ({window}), got {stride}")
    token_ids = list(llm.tokenizer(text).input_ids) if text else []
    if len(token_ids) < 2:
        raise ConfigError(f"the text file is empty or too short to score: it has {len(token_ids)} token(s), perplexity needs at least 2")
    nll_sum = 0.0
    scored = 0
    scored_until = 1  # the first token has no context: it is never a target
    starts = range(0, max(len(token_ids) - window, 0) + stride, stride)  # the last window is the first to reach the end
    for begin in tqdm(starts, desc="perplexity", unit="window", leave=False, mininterval=2.0, disable=None):
        end = min(begin + window, len(token_ids))
        with torch.inference_mode():
            logits = llm.logits([token_ids[begin:end]])[0]
        # Logits at position p predict token p + 1: targets [scored_until, end) need logits [scored_until - 1, end - 1).
        predicting = logits[scored_until - 1 - begin : end - 1 - begin].float()
        targets = torch.tensor(token_ids[scored_until:end])
        nll_sum += float(F.cross_entropy(predicting, targets, reduction="sum"))
        scored += end - scored_until
        scored_until = end
    mean_nll = nll_sum / scored
    return PerplexityReport(perplexity=math.exp(mean_nll), num_tokens=scored, mean_nll=mean_nll)


def perplexity_of_file(llm: LLM, path: str | Path, window: int | None = None, stride: int | None = None) -> PerplexityReport:
    """:func:`perplexity` of a UTF-8 text file's contents."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"perplexity text file {path} does not exist; pass a UTF-8 text file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read perplexity text file {path}: {error}") from error
    if not text.strip():
        raise ConfigError(f"the text file {path} is empty; perplexity needs some text")
    return perplexity(llm, text, window, stride)
