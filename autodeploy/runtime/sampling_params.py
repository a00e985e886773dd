"""Per-request sampling parameters."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from autodeploy.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Choosing a token (in this order; ``sampler.sample`` applies them):

    - ``repetition_penalty``: HF semantics; a token already in the prompt or output has a positive
      logit divided by it and a negative one multiplied by it. 1 = off, > 1 discourages repeats.
    - ``presence_penalty``, ``frequency_penalty``: OpenAI semantics, on generated tokens only;
      ``logit -= presence·[count > 0] + frequency·count``. In [-2, 2]; 0 = off.
    - ``logit_bias``: ``{token id: bias}``, each bias in [-100, 100] added to that token's logit
      (OpenAI semantics; -100 in effect bans a token, 100 all but forces it). Token ids may be given as
      strings and the whole as JSON text, as OpenAI's JSON carries it (``validate`` converts).
    - ``temperature``: divides the logits; 0 is greedy decoding (the argmax).
    - ``top_k``: keep the k most likely tokens; 0 = off.
    - ``top_p``: nucleus; keep the most likely tokens until their probability reaches ``top_p``
      (the top token always stays); 1 = off.
    - ``min_p``: drop tokens less likely than ``min_p`` times the most likely one; 0 = off.
    - ``seed``: makes a sampled request reproducible, whatever else is in the batch.
    - ``n``: how many samples to return for the prompt.
    - ``logprobs``: None, or 0..20: also return the chosen token's log-probability and that many
      most likely alternatives (from the model's raw distribution).
    - ``beam_width``: > 1 turns on beam search, which is deterministic: it needs ``temperature=0``,
      the filters and penalties off, and ``n ≤ beam_width``. ``length_penalty`` is the exponent of the
      length that divides a beam's score (HF semantics; > 0 favours longer outputs), and
      ``early_stopping`` is HF's: True stops when ``beam_width`` beams are finished, False stops when
      no better beam is likely, ``"never"`` only when none can be.

    Structured output: ``json_schema`` (a JSON Schema, as a dict or its JSON text) or ``json_object=True``
    (any JSON object) masks every step's logits so the output stays valid JSON of that shape (compact:
    ``", "`` and ``": "`` are its only whitespace); the completion stops once the JSON is complete and a
    stop token follows. It needs ``xgrammar`` (``pip install 'autodeploy[serve]'``) and does not combine
    with beam search. With ``json_schema``, objects take no properties the schema does not list unless it
    says ``additionalProperties``. ``structural_tag`` is the general form (xgrammar's structural tag, a dict
    or its JSON text): free text and constrained parts, as tool calls use (``frontend/tool_calls.py``).

    Stopping: at ``max_tokens``, at any of ``stop_token_ids`` (plus the model's EOS unless
    ``ignore_eos``), or when the text contains one of the ``stop`` strings (which is cut from the
    returned text; a single string is accepted).

    >>> SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=1)
    SamplingParams(max_tokens=32, temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=1, n=1, logprobs=None, beam_width=1, length_penalty=1.0, early_stopping=False, stop=[], stop_token_ids=[], ignore_eos=False, json_schema=None, json_object=False, structural_tag=None, logit_bias=None)
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    json_schema: dict | str | None = None
    json_object: bool = False
    structural_tag: dict | str | None = None
    logit_bias: dict[int, float] | None = None

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the first invalid field; turn ``stop="x"`` into ``["x"]`` and
        ``logit_bias`` JSON text or string token ids into ``{int: float}``."""

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_real(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not is_real(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number ≥ 0 (0 = greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer ≥ 0 (0 = off), got {self.top_k!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        if self.seed is not None and not is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        if not is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer ≥ 1 (samples per prompt), got {self.n!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be an integer ≥ 1 (1 = no beam search), got {self.beam_width!r}")
        if not is_real(self.length_penalty):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise InvalidRequestError(f'early_stopping must be True, False or "never", got {self.early_stopping!r}')
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"json_object must be True or False, got {self.json_object!r}")
        if self.logit_bias is not None:
            self.logit_bias = _token_biases(self.logit_bias)
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or not all(is_int(t) and t >= 0 and is_real(b) and -100 <= b <= 100 for t, b in self.logit_bias.items())
        ):
            raise InvalidRequestError(
                f"logit_bias must map token ids (integers ≥ 0) to biases in [-100, 100], got {self.logit_bias!r}"
            )
        if self.json_schema is not None or self.json_object or self.structural_tag is not None:
            self._validate_structured_output()
        if self.beam_width > 1:
            self._validate_beam_search()

    def _validate_structured_output(self) -> None:
        if (self.json_schema is not None) + self.json_object + (self.structural_tag is not None) > 1:
            raise InvalidRequestError("set one of json_schema, json_object and structural_tag (json_object is any JSON object)")
        if self.beam_width > 1:
            raise InvalidRequestError(
                f"structured output (json_schema / json_object / structural_tag) does not combine with beam search (beam_width="
                f"{self.beam_width}); use beam_width=1"
            )
        from autodeploy.runtime import structured_output  # xgrammar, only when asked for

        for name, check in (("json_schema", structured_output.check_json_schema), ("structural_tag", structured_output.check_structural_tag)):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    json.loads(value)
                except ValueError as error:
                    raise InvalidRequestError(f"{name} is not valid JSON: {error}") from None
            elif not isinstance(value, dict):
                raise InvalidRequestError(f"{name} must be a dict or its JSON text, got {type(value).__name__}")
            check(value)

    def _validate_beam_search(self) -> None:
        """Beam search ranks beams by log-probability, so nothing may reshape or randomise the distribution."""
        if self.temperature != 0:
            raise InvalidRequestError(
                f"beam search (beam_width={self.beam_width}) is deterministic: temperature must be 0, got {self.temperature!r}"
            )
        defaults = {
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logit_bias": None,
        }
        for name, default in defaults.items():
            if getattr(self, name) != default:
                raise InvalidRequestError(
                    f"beam search (beam_width={self.beam_width}) does not combine with {name}: "
                    f"it must stay {default!r}, got {getattr(self, name)!r}"
                )
        if self.n > self.beam_width:
            raise InvalidRequestError(
                f"n must be ≤ beam_width under beam search (it returns the n best beams), "
                f"got n={self.n!r} with beam_width={self.beam_width!r}"
            )


def _token_biases(logit_bias):
    """``logit_bias`` with integer token ids: from JSON text, and from string keys (JSON object keys)."""
    if isinstance(logit_bias, str):
        try:
            logit_bias = json.loads(logit_bias)
        except ValueError as error:
            raise InvalidRequestError(f"logit_bias is not valid JSON: {error}") from None
    if not isinstance(logit_bias, dict):
        return logit_bias  # validate names the problem
    try:
        return {int(token) if isinstance(token, str) else token: bias for token, bias in logit_bias.items()}
    except ValueError:
        raise InvalidRequestError(
            f"logit_bias keys must be token ids (integers, or integers as strings as in {{\"50256\": -100}}), got {list(logit_bias)[:4]}"
        ) from None
