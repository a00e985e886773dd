"""A request and its sequences: what the engine tracks between steps.

A ``Request`` is one prompt with its ``SamplingParams``. It runs as one or more ``Sequence``s — one per
sample (``n``) or per live beam (beam search) — and each sequence is what the scheduler and the KV
block pool see: token ids, how many of them are already in the cache, an importance.

A request may carry side inputs (``TokenRows``): graph inputs other than token ids that go with given
prompt positions, which the model runner hands to a graph whose serving signature declares them.

A request may carry an ``OutputSink``: the engine hands it the request's outputs itself, from whichever
thread ran the step, so a front end gets all of its outputs however many others share the engine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from autodeploy.runtime.beam_search import BeamSearch
from autodeploy.runtime.detokenizer import IncrementalDetokenizer
from autodeploy.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from autodeploy.runtime.sampling_params import SamplingParams

_sequence_ids = itertools.count()
# How much less each earlier draft of a sample counts in what its next is expected to keep: acceptance comes in
# runs (a copied passage, then new text), and a sample's rate a few drafts ago says little about its next.
RECENCY = 0.7


@dataclass(frozen=True)
class TokenRows:
    """A side input of one request: ``rows[i]`` goes with prompt position ``positions[i]`` (an image's
    embeddings standing in for its placeholder tokens' embeddings, say). A step computing some of those
    positions hands the graph their rows, in the step's token order, and where they go among its tokens
    (``step_inputs.SideInputSpec``)."""

    positions: tuple[int, ...]
    rows: torch.Tensor  # [len(positions), *row shape]


@dataclass(eq=False)
class Sequence:
    request: Request
    token_ids: list[int]
    index: int  # completion index (sample number)
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))
    num_computed: int = 0  # leading tokens whose K/V are in the cache (or being computed by the step in flight)
    num_pending: int = 0  # 1 while the step in flight samples this sequence's next token (not in token_ids yet)
    awaiting_beam_step: bool = False  # a beam whose next-token logprobs are in, waiting for its group
    pending_logprobs: torch.Tensor | None = None  # those logprobs [vocab]
    finish_reason: str | None = None
    stopped_text: str | None = None  # the text cut before a stop string, once one appeared
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    streamed_tokens: int = 0  # how many output tokens earlier stream outputs carried
    streamed_text: str = ""
    grammar: object | None = None  # the sample's xgrammar GrammarMatcher (json_schema / json_object requests)
    detokenizer: IncrementalDetokenizer | None = None  # made by the first decode
    num_accepted: int = 0  # speculative decoding: drafted tokens of this sample the model accepted …
    num_rejected: int = 0  # … and drafts of it the model cut
    recent_accepted: float = 0.0  # the same two, each earlier draft's counts weighing RECENCY times less …
    recent_judged: float = 0.0  # … (accepted tokens and first refusals): what Speculator.acceptance expects from
    decodes_since_draft: int = 0  # decode steps since this sample last drafted (Speculator.acceptance's probes)

    def judged(self, drafted: int, accepted: int) -> None:
        """The model kept ``accepted`` of a draft of ``drafted`` tokens of this sample."""
        refused = int(accepted < drafted)
        self.num_accepted += accepted
        self.num_rejected += refused
        self.recent_accepted = RECENCY * self.recent_accepted + accepted
        self.recent_judged = RECENCY * self.recent_judged + accepted + refused
        self.decodes_since_draft = 0

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def arrival(self) -> tuple[float, int]:
        return self.request.arrival

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_to_compute(self) -> int:
        if self.awaiting_beam_step or self.finish_reason is not None:
            return 0
        if self.num_pending and self.num_tokens - len(self.request.prompt_token_ids) >= self.request.params.max_tokens:
            return 0  # the token in flight is its last
        return self.num_tokens - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the tokens generated so far (``num_output_tokens`` counts them without copying)."""
        return self.token_ids[len(self.request.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_token_ids)

    def append(self, token: int, tokenizer) -> None:
        """Add a sampled token and decide whether this sample is finished."""
        self.token_ids.append(token)
        params = self.request.params
        if params.stop and tokenizer is not None and self._cut_at_stop_string(tokenizer):
            self.finish_reason = "stop"
        elif token in self.request.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_output_tokens >= params.max_tokens:
            self.finish_reason = "length"

    def _cut_at_stop_string(self, tokenizer) -> bool:
        """Only requests with stop strings decode every step; the others decode when asked."""
        self.stopped_text = text_before_stop(self._text(tokenizer), self.request.params.stop)
        return self.stopped_text is not None

    def decoded_text(self, tokenizer) -> str:
        if self.stopped_text is not None:
            return self.stopped_text
        return self._text(tokenizer) if tokenizer is not None else ""

    def _text(self, tokenizer) -> str:
        if self.detokenizer is None:
            self.detokenizer = IncrementalDetokenizer(tokenizer)
        return self.detokenizer.text(self.output_token_ids)


def text_before_stop(text: str, stops: list[str]) -> str | None:
    """``text`` cut before the first of ``stops`` in it, or None when none appears."""
    cuts = [text.find(stop) for stop in stops if stop in text]
    return text[: min(cuts)] if cuts else None


def streamable_prefix(text: str, stops: list[str]) -> str:
    """What a stream may show of an unfinished completion: not a trailing partial UTF-8 character (the
    next token completes it), nor a tail that could be the start of a stop string (it may be cut)."""
    end = len(text) - 1 if text.endswith("\ufffd") else len(text)
    for stop in stops:
        for length in range(min(len(stop) - 1, end), 0, -1):
            if text[end - length : end] == stop[:length]:
                end -= length
                break
    return text[:end]


class OutputSink(Protocol):
    """Where the engine delivers one request's outputs: under the engine's lock, from whichever thread
    stepped. ``streaming`` sinks get an output (with ``new_text`` / ``new_token_ids``) at every change;
    the others only the final one, so nothing decodes text at every step for them."""

    streaming: bool

    def put(self, output: RequestOutput) -> None:
        """A new output; the last one has ``finished=True`` (``finish_reason`` "abort" when cancelled)."""

    def fail(self, error: BaseException) -> None:
        """The step computing this request raised ``error``; the request is aborted and gets no more outputs."""


class Request:
    _counter = itertools.count()

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_token_ids: set[int],
        seed: int,
        priority: int,
        arrival_time: float,
        side_inputs: dict[str, TokenRows] | None = None,
        encoder_input_ids: list[int] | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.stop_token_ids = stop_token_ids
        self.seed = seed
        self.priority = priority
        self.arrival_time = arrival_time
        self.side_inputs = side_inputs or {}  # graph input name → its rows (checked against the graph by admission)
        self.arrival = (self.arrival_time, next(Request._counter))
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None
        self.beam_search = (
            BeamSearch(params.beam_width, params.max_tokens, stop_token_ids, params.length_penalty, params.early_stopping)
            if params.beam_width > 1
            else None
        )
        # Sampled requests start as one sequence; n > 1 forks the others once the prompt is computed.
        self.sequences: list[Sequence] = [Sequence(self, list(self.prompt_token_ids), 0)]
        self.finished_completions: list[CompletionOutput] | None = None  # beam search results, once done
        self.aborted = False
        self.sink: OutputSink | None = None
        self.grammar = None  # the compiled grammar of a json_schema / json_object request (the engine sets it)
        # A vision-language request's images until the vision graph has encoded them (vision_encoder.py), where each
        # one's placeholder run starts, and the spans of prompt positions whose K/V depend on more than their token
        # ids — (start, end, content key) — which the prefix cache keys by that content too.
        self.images: list = []
        self.image_starts: list[int] = []
        self.content_spans: tuple[tuple[int, int, str], ...] = ()
        # Prompt spans [start, end) whose tokens see one another both ways (Gemma 3's image tokens): a prefill chunk
        # never ends inside one (scheduler.py), and its tokens attend up to its end (step_inputs.chunk_attend_until).
        self.whole_spans: tuple[tuple[int, int], ...] = ()
        # An encoder–decoder's request: the prompt's ids are the encoder's input (``prompt_token_ids`` holds the
        # decoder's start token); once encoded, its blocks in the cross-KV pool and their token count (encoder_pass.py).
        self.encoder_input_ids = encoder_input_ids
        self.cross_table: list[int] | None = None
        self.cross_len = 0

    @property
    def finished(self) -> bool:
        if self.aborted:  # an n > 1 request aborted before it forked has fewer than n sequences
            return True
        if self.beam_search is not None:
            return self.finished_completions is not None
        return len(self.sequences) == self.params.n and all(s.finish_reason is not None for s in self.sequences)

    def live_sequences(self) -> list[Sequence]:
        return [s for s in self.sequences if s.finish_reason is None]

    def metrics(self) -> RequestMetrics:
        start = self.arrival_time
        return RequestMetrics(
            queue_time=None if self.first_scheduled_time is None else self.first_scheduled_time - start,
            time_to_first_token=self.token_times[0] - start if self.token_times else None,
            token_times=[t - start for t in self.token_times],
            e2e_latency=None if self.finish_time is None else self.finish_time - start,
        )

    def output(self, tokenizer, streaming: bool = False) -> RequestOutput:
        """The request's state now; with ``streaming``, each completion also carries what is new since the last call."""
        if self.finished_completions is not None:
            completions = self.finished_completions
        else:
            completions = [self._completion(s, tokenizer, streaming) for s in sorted(self.sequences, key=lambda s: s.index)]
        prompt_ids = self.encoder_input_ids if self.encoder_input_ids is not None else self.prompt_token_ids
        return RequestOutput(self.request_id, self.prompt, prompt_ids, completions, self.finished, self.metrics())

    def _completion(self, sequence: Sequence, tokenizer, streaming: bool) -> CompletionOutput:
        tokens = list(sequence.output_token_ids)
        text = sequence.decoded_text(tokenizer)
        wants_logprobs = self.params.logprobs is not None
        completion = CompletionOutput(
            index=sequence.index,
            text=text,
            token_ids=tokens,
            finish_reason=sequence.finish_reason,
            logprobs=list(sequence.logprobs) if wants_logprobs else None,
            top_logprobs=list(sequence.top_logprobs) if wants_logprobs else None,
            cumulative_logprob=sum(sequence.logprobs) if wants_logprobs else None,
        )
        if streaming:
            stable = text if sequence.finish_reason is not None else streamable_prefix(text, self.params.stop)
            completion.new_token_ids = tokens[sequence.streamed_tokens :]
            completion.new_text = stable[len(sequence.streamed_text) :] if stable.startswith(sequence.streamed_text) else stable
            sequence.streamed_tokens = len(tokens)
            sequence.streamed_text = stable
        return completion
