"""What the runtime returns per request: completions, their log-probabilities, and timing."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample (``n`` > 1) or beam of a request.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (max_tokens),
    ``"abort"`` (cancelled) or ``None`` while it is still generating. ``logprobs[i]`` is the log-probability
    of ``token_ids[i]`` under the model (raw logits), ``top_logprobs[i]`` the most likely alternatives;
    both only when ``SamplingParams.logprobs`` is set. ``new_token_ids``/``new_text`` hold what arrived
    since the previous output of a stream. ``cumulative_logprob`` ranks beams (beam search).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""


@dataclass
class RequestMetrics:
    """Seconds (``time.perf_counter``): ``queue_time`` from arrival to first scheduled,
    ``time_to_first_token`` from arrival, ``token_times`` the arrival time of every output token
    (of the first completion) relative to arrival, ``e2e_latency`` from arrival to finish."""

    queue_time: float | None = None
    time_to_first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    e2e_latency: float | None = None

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    """A request's state: its completions (one unless ``n`` > 1 or beam search) and timing.
    ``text``, ``token_ids`` and ``finish_reason`` are the first completion's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
