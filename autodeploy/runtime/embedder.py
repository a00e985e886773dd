"""``Embedder``: an encoder-only deployment's ``"embed"`` graph run over many texts at once (``models/embedding.py``).

There is no cache and nothing to generate: a text is read once. Texts are packed into one row with no padding
(``[1, T]``: their token ids, positions counted from 0 within each, token types) with ``seq_start`` saying where each
begins; the graph's attention keeps them apart (``transforms/pack_bidirectional_attention.py``). A forward holds at
most ``scheduler.max_num_tokens`` tokens (the same budget a generating engine's step has), so a long list of texts runs
as several forwards, each full; a text longer than the budget (but within ``max_text_tokens``) runs alone.

An embedder's rows are pooled per text in float32 (``cls``: its first row; ``mean``: the mean of its rows; ``last``:
its last), truncated to ``dimensions`` (Matryoshka models' leading components) and L2-normalized when asked. A
cross-encoder's graph returns one logit a text (a query–document pair); its relevance is the logit's sigmoid, as
sentence-transformers' ``CrossEncoder`` reports it.

    >>> embedder = Embedder(deployment)
    >>> embedder.pooled([[101, 7592, 102], [101, 2088, 2003, 102]])   # [2, H] float32 on the CPU
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from autodeploy.deployment import EMBED, PACKED_TEXTS, POOLINGS, Deployment
from autodeploy.errors import ConfigError, InvalidRequestError


@dataclass
class Embeddings:
    """``LLM.embed``'s answer: one row a text, in the order given, and how many tokens each was."""

    vectors: torch.Tensor  # [N, D] float32, on the CPU
    num_tokens: list[int]


@dataclass
class Scores:
    """``LLM.score``'s answer: each document's relevance to the query (a sigmoid, in [0, 1]), in the order given,
    and how many tokens each (query, document) pair was."""

    scores: list[float]
    num_tokens: list[int]


class Embedder:
    """Runs the deployment's ``"embed"`` graph (see the module docstring)."""

    def __init__(self, deployment: Deployment):
        if EMBED not in deployment.graphs or deployment.embedding is None:
            raise ConfigError("Embedder serves an encoder-only deployment (an 'embed' graph and its EmbeddingHead)")
        graph = deployment.graphs[EMBED]
        if not graph.meta.get(PACKED_TEXTS, False):
            raise ConfigError("the embed graph's attention does not keep packed texts apart (the pack_bidirectional_attention "
                              "transform is disabled): enable it")
        self.graph = graph
        self.head = deployment.embedding
        self.device = torch.device(deployment.settings.device)
        self.max_num_tokens = int(deployment.settings.scheduler.max_num_tokens)
        self.forwards = 0  # forwards run so far (for tests and metrics: how well texts were packed)

    def check(self, texts: Sequence[Sequence[int]], first_index: int = 0, alone: bool | None = None) -> None:
        """Refuse, before anything runs, a text that is empty, too long or holds ids outside the vocabulary. The texts are
        inputs ``first_index`` … of a call (``alone``: the call's only input; by default when ``texts`` is one)."""
        if len(texts) == 0:
            raise InvalidRequestError("no input: pass at least one text (a string or a list of token ids)")
        alone = len(texts) == 1 and first_index == 0 if alone is None else alone
        for index, tokens in enumerate(texts, first_index):
            where = "the input" if alone else f"input {index}"
            if len(tokens) == 0:
                raise InvalidRequestError(f"{where} is empty: an embedding needs at least one token")
            if len(tokens) > self.head.max_text_tokens:
                raise InvalidRequestError(f"{where} is {len(tokens)} tokens; this model reads at most {self.head.max_text_tokens} "
                                          f"(its position embeddings): shorten or split it")
            outside = [t for t in tokens if not 0 <= t < self.head.vocab_size]
            if outside:
                raise InvalidRequestError(f"{where} has token ids outside the vocabulary [0, {self.head.vocab_size}): {outside[:4]}")

    def run(self, texts: Sequence[Sequence[int]], token_types: Sequence[Sequence[int]] | None = None,
            pooling: str | None = None, on_device: bool = False, first_index: int = 0, alone: bool | None = None) -> torch.Tensor:
        """The graph's rows for each text: pooled ``[N, H]`` (an embedder, by ``pooling``, default the model's; before
        truncation and normalization) or the logits ``[N]`` (a cross-encoder), float32, in the order given: on the CPU,
        or (``on_device``) where the graph ran, so a caller can queue more before the one wait for the device.
        ``first_index`` / ``alone``: where these texts are in the caller's inputs, for the errors (``check``)."""
        self.check(texts, first_index, alone)
        pooling = pooling or self.head.pooling
        if pooling not in POOLINGS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")
        outputs = []
        for first, last in self._forwards([len(tokens) for tokens in texts]):
            types = token_types[first:last] if token_types is not None else None
            outputs.append(self._forward(texts[first:last], types, pooling))
        rows = torch.cat(outputs)
        return rows if on_device else rows.cpu()

    def _forwards(self, lengths: list[int]) -> Iterator[tuple[int, int]]:
        """Consecutive runs of texts, each within the token budget (a longer text alone)."""
        first, tokens = 0, 0
        for index, length in enumerate(lengths):
            if index > first and tokens + length > self.max_num_tokens:
                yield first, index
                first, tokens = index, 0
            tokens += length
        yield first, len(lengths)

    @torch.inference_mode()
    def _forward(self, texts: Sequence[Sequence[int]], token_types: Sequence[Sequence[int]] | None, pooling: str) -> torch.Tensor:
        lengths = torch.tensor([len(tokens) for tokens in texts])
        starts = torch.zeros(len(texts) + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(lengths, 0)
        total = int(starts[-1])
        text_of = torch.repeat_interleave(torch.arange(len(texts)), lengths)  # each row's text
        positions = torch.arange(total) - starts[:-1].long()[text_of]
        ids = torch.tensor([token for tokens in texts for token in tokens])
        types = (torch.tensor([t for row in token_types for t in row]) if token_types is not None
                 else torch.zeros(total, dtype=torch.long))
        # A cross-encoder's graph picks a row a text, and export specialises a count of one (torch's 0/1 rule): one text
        # runs after an empty one (its start, 0, is a row of the graph), whose logit is dropped.
        alone = self.head.task == "score" and len(texts) == 1
        graph_starts = torch.cat([starts[:1], starts]) if alone else starts
        inputs = [tensor.to(self.device, non_blocking=True) for tensor in (ids[None], positions[None], types[None], graph_starts)]
        out = self.graph(*inputs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        self.forwards += 1
        if self.head.task == "score":
            return out.reshape(-1)[-len(texts):].float()
        return pool(out[0].float(), starts.to(out.device), pooling)  # no wait for the device: the next forward queues behind


def pool(rows: torch.Tensor, seq_start: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector a text of the packed ``rows`` ``[T, H]``: its first row, the mean of its rows, or its last."""
    starts, ends = seq_start[:-1].long(), seq_start[1:].long()
    if pooling == "cls":
        return rows[starts]
    if pooling == "last":
        return rows[ends - 1]
    if pooling == "mean":
        lengths = ends - starts
        # output_size: the rows, known on the host, so the device is not waited for to size the result
        text_of = torch.repeat_interleave(torch.arange(len(lengths), device=rows.device), lengths, output_size=rows.shape[0])
        sums = torch.zeros(len(lengths), rows.shape[1], dtype=rows.dtype, device=rows.device).index_add_(0, text_of, rows)
        return sums / lengths[:, None].to(rows.dtype)
    raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")


def finish_vectors(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """The first ``dimensions`` components (all when None), L2-normalized when ``normalize``."""
    if dimensions is not None:
        if not 1 <= dimensions <= pooled.shape[1]:
            raise InvalidRequestError(f"dimensions must be between 1 and the model's {pooled.shape[1]}; got {dimensions}")
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, dim=-1) if normalize else pooled
