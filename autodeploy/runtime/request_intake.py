"""Admission: a prompt and its sampling parameters become a validated ``Request``, or an ``InvalidRequestError``.

``RequestIntake`` tokenizes text prompts (refusing text no ``max_seq_len`` tokens could spell before the
tokenizer sees it), checks token ids against the vocabulary, checks that the request fits the sequence
length, the KV pool and the token budget, compiles its grammar (json_schema / json_object /
structural_tag), checks its side inputs against what the graph declares, and picks its seed and id.
Nothing is queued: the engine's ``submit`` does that, so a refused request touches nothing.

    intake = RequestIntake(tokenizer, vocab_size, eos_token_ids, settings, pool, side_inputs={})
    request = intake.make_request("Hello", SamplingParams(max_tokens=8), clock=time.perf_counter)
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceABC

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.request import Request, TokenRows
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.runtime.step_inputs import SideInputSpec
from autodeploy.runtime.structured_output import StructuredOutput
from autodeploy.runtime.vision_encoder import VisionEncoder

# Text or token ids; a vision-language model's prompt may be {"prompt": text or ids, "images": [paths, bytes, URLs, PIL images]}.
Prompt = str | list[int] | Mapping


class RequestIntake:
    """Validates and builds requests for one engine (see the module docstring). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: SequenceABC[int], settings, pool: KVBlockPool,
                 side_inputs: Mapping[str, SideInputSpec], vision: VisionEncoder | None = None,
                 decoder_start_token_id: int | None = None):
        """``side_inputs``: the side inputs the engine's graph declares (a request may carry only those);
        ``vision``: a vision-language deployment's image preparation (prompts with images are refused without)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.settings = settings
        self.max_seq_len = settings.max_seq_len
        self.pool = pool
        self.side_inputs = dict(side_inputs)
        self.vision = vision
        self.decoder_start_token_id = decoder_start_token_id  # an encoder–decoder's: the decoder's first input
        self._request_ids = itertools.count()
        self._seeds = random.Random(settings.seed)
        self._lock = threading.Lock()  # the request ids and the structured-output compiler
        self._structured_output: StructuredOutput | None = None  # built by the first json_schema / json_object request
        self._longest_text: int | None = None  # check_text_length's bound, from the vocabulary when first needed

    def make_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, priority: int,
        clock: Callable[[], float], side_inputs: Mapping[str, TokenRows] | None = None,
    ) -> Request:
        """Validate a request and build it, arriving at ``clock()`` once validated."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer (lower is served first), got {priority!r}")
        prompt, images = self._split_images(prompt)
        token_ids = self.tokenize(self.vision.expand_text(prompt) if images and isinstance(prompt, str) else prompt)
        image_starts: list[int] = []
        if self.vision is not None:  # a text prompt carries no placeholders either
            token_ids, image_starts = self.vision.expand_placeholders(token_ids, len(images or ()))
            if images and len(token_ids) + params.max_tokens > self.max_seq_len:
                raise InvalidRequestError(
                    f"the prompt's {len(images)} image(s) of {self.vision.tokens_per_image} tokens each make it {len(token_ids)} "
                    f"tokens, and with max_tokens={params.max_tokens} more than max_seq_len={self.max_seq_len}; send fewer "
                    f"images, a shorter prompt or a lower max_tokens")
        encoder_input_ids = None
        if self.decoder_start_token_id is not None:  # an encoder–decoder: the prompt is the encoder's input
            longest = min(self.max_seq_len, self.settings.scheduler.max_num_tokens)  # its encoder pass is one step's work
            if not token_ids or len(token_ids) > longest:
                raise InvalidRequestError(f"the prompt has {len(token_ids)} tokens; this encoder-decoder model's input takes "
                                          f"1 to {longest} (max_seq_len={self.max_seq_len}, scheduler.max_num_tokens="
                                          f"{self.settings.scheduler.max_num_tokens}: its encoder runs in one step)")
            encoder_input_ids, token_ids = token_ids, [self.decoder_start_token_id]
        self._check_fits(token_ids, params)
        biased_outside = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if biased_outside:
            raise InvalidRequestError(f"logit_bias has token ids outside the vocabulary [0, {self.vocab_size}): {biased_outside[:4]}")
        side_inputs = dict(side_inputs or {})
        self._check_side_inputs(side_inputs, len(token_ids))
        grammar = self.grammar(params)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(31)
        with self._lock:
            request_id = str(next(self._request_ids)) if request_id is None else str(request_id)  # submit checks it is free
        request = Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, stops, seed, priority,
                          clock(), side_inputs, encoder_input_ids)
        request.grammar = grammar
        if images:
            request.images, request.image_starts = images, image_starts
            width = self.vision.tokens_per_image
            request.content_spans = tuple((start, start + width, image.key) for start, image in zip(image_starts, images))
            request.whole_spans = self.vision.whole_spans(token_ids)
            longest = max((end - start for start, end in request.whole_spans), default=0)
            if longest > self.settings.scheduler.max_num_tokens:
                raise InvalidRequestError(
                    f"the prompt's image tokens make a run of {longest} tokens that attend to one another, which one step "
                    f"must compute together; scheduler.max_num_tokens={self.settings.scheduler.max_num_tokens} is "
                    f"smaller: raise it, or separate the images with text")
        return request

    def _split_images(self, prompt: Prompt) -> tuple[str | list[int], list | None]:
        """A ``{"prompt": …, "images": […]}`` prompt's text (or ids) and its prepared images (loaded, checked and
        preprocessed now, on worker threads); any other prompt as it is, with None."""
        if not isinstance(prompt, Mapping):
            return prompt, None
        unknown = sorted(set(prompt) - {"prompt", "images"})
        if unknown or "prompt" not in prompt:
            raise InvalidRequestError(f"a prompt given as a dict takes the keys 'prompt' and 'images'; got {sorted(prompt)}")
        sources = prompt.get("images") or []
        if sources and self.vision is None:
            raise InvalidRequestError("this model takes no images (it has no vision tower); send text only")
        return prompt["prompt"], (self.vision.prepare(sources) if self.vision is not None else None)

    def grammar(self, params: SamplingParams):
        """The compiled grammar of a json_schema / json_object / structural_tag request (None for the others)."""
        if params.json_schema is None and not params.json_object and params.structural_tag is None:
            return None
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured output (json_schema / json_object / structural_tag) needs the model's tokenizer; pass tokenizer='…' to autodeploy()"
            )
        with self._lock:
            if self._structured_output is None:
                self._structured_output = StructuredOutput(self.tokenizer, self.vocab_size)
        return self._structured_output.compile(params)

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (text through the tokenizer; ids checked against the vocabulary)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer files; pass tokenizer='…' to autodeploy() or give prompts as token ids"
                )
            _check_unicode(prompt)
            self.check_text_length(prompt)
            token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty (no tokens); give it some text")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"the prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:4]}")
        return token_ids

    def check_text_length(self, text: str, what: str = "the prompt") -> None:
        """Refuse text that no ``max_seq_len`` tokens can spell, before tokenizing it: a prompt of megabytes
        would hold the tokenizer for seconds only to be refused. No token spells more characters than the
        vocabulary's longest entry; twice that is left for normalizers that drop characters."""
        if self._longest_text is None:
            self._longest_text = 2 * self.max_seq_len * max(map(len, self.tokenizer.get_vocab()), default=1)
        if len(text) > self._longest_text:
            raise InvalidRequestError(
                f"{what} has {len(text):,} characters, more than {self.max_seq_len} tokens (max_seq_len) of this vocabulary "
                f"can spell (at most {self._longest_text:,}); shorten it"
            )

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        total = len(token_ids) + params.max_tokens
        if total > self.max_seq_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens and asks for max_tokens={params.max_tokens}: "
                f"{total} > max_seq_len={self.max_seq_len}; shorten the prompt or lower max_tokens"
            )
        method = self.settings.speculative.method
        if params.beam_width > 1 and method:
            raise InvalidRequestError(
                f"beam search (beam_width={params.beam_width}) does not combine with speculative decoding, which this "
                f"deployment runs (speculative.method={method!r}); sample (beam_width=1), or deploy without speculative"
            )
        copies = params.beam_width if params.beam_width > 1 else 1  # a beam group must fit at once
        if copies * -(-total // self.pool.block_size) > self.pool.num_blocks:
            raise InvalidRequestError(
                f"{copies} sequence(s) of {total} tokens need more KV blocks than the pool has ({self.pool.num_blocks} "
                f"of {self.pool.block_size} tokens); lower max_tokens / beam_width or give the cache more memory (kv_cache settings)"
            )
        max_num_tokens = self.settings.scheduler.max_num_tokens
        if not self.settings.scheduler.chunked_prefill and total > max_num_tokens:
            raise InvalidRequestError(
                f"{total} tokens exceed scheduler.max_num_tokens={max_num_tokens} with chunked prefill off; "
                f"turn scheduler.chunked_prefill on or raise max_num_tokens"
            )

    def _check_side_inputs(self, side_inputs: dict[str, TokenRows], prompt_len: int) -> None:
        """Each side input must be one the graph declares, with one row of its shape and dtype per distinct
        prompt position."""
        for name, carried in side_inputs.items():
            spec = self.side_inputs.get(name)
            if spec is None:
                raise InvalidRequestError(f"the request carries side input {name!r}, which this model's graph does not "
                                          f"take (it takes {sorted(self.side_inputs) or 'none'})")
            if not isinstance(carried, TokenRows):
                raise InvalidRequestError(f"side input {name!r} must be TokenRows, got {type(carried).__name__}")
            expected = (len(carried.positions), *spec.row_shape)
            if tuple(carried.rows.shape) != expected or carried.rows.dtype != spec.dtype:
                raise InvalidRequestError(f"side input {name!r} has rows {tuple(carried.rows.shape)} {carried.rows.dtype}; "
                                          f"the graph takes {expected} {spec.dtype} (one row per position)")
            if len(set(carried.positions)) != len(carried.positions) or not all(0 <= p < prompt_len for p in carried.positions):
                raise InvalidRequestError(f"side input {name!r} must name distinct prompt positions in [0, {prompt_len})")
        if side_inputs and self.settings.kv_cache.prefix_caching:
            # The prefix cache keys blocks by token ids alone: another prompt's blocks would stand for these.
            raise InvalidRequestError("requests with side inputs need kv_cache.prefix_caching off; deploy with it off")


def _check_unicode(prompt: str) -> None:
    """Tokenizers reject text that UTF-8 cannot encode (lone UTF-16 surrogates) with a bare TypeError."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"the prompt is not valid Unicode: character {error.start} ({prompt[error.start]!r}) is a lone surrogate "
            f"(half of a UTF-16 pair); decode the text with errors='replace' or remove that character"
        ) from None
