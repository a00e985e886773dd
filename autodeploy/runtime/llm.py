"""``LLM``: the deployed model. This first runtime re-runs each sequence's full context every step."""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC

import torch
from torch import fx
from tqdm import tqdm

from autodeploy.errors import InvalidRequestError
from autodeploy.pipeline import TransformRecord, format_report
from autodeploy.runtime.graph_inputs import build_graph_inputs
from autodeploy.runtime.outputs import RequestOutput
from autodeploy.runtime.sampler import sample_next_tokens
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.runtime.sequence import Sequence

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """A deployed model: ``generate`` text, inspect the pipeline that built it.

    >>> from autodeploy import autodeploy, SamplingParams
    >>> llm = autodeploy()                                         # the embedded demo model
    >>> llm.generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0))[0].text  # doctest: +SKIP
    """

    def __init__(
        self,
        graph: fx.GraphModule,
        graph_inputs: tuple[str, ...],
        settings,
        tokenizer=None,
        eos_token_ids: SequenceABC[int] = (),
        records: list[TransformRecord] | None = None,
    ):
        self.graph = graph
        self.graph_inputs = graph_inputs
        self.settings = settings
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.records = records or []
        self.device = torch.device(settings.device)
        self.vocab_size = self._graph_vocab_size()

    def pipeline_report(self) -> str:
        """Time, matches and node counts of every transform that built this model, and op histograms."""
        return format_report(self.records)

    @torch.inference_mode()
    def logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Logits ``[len(seq), vocab]`` (on the CPU) for every position of each token sequence, in one forward."""
        self._require_weights()
        batch = build_graph_inputs(self.graph_inputs, sequences, self.device)
        out = self.graph(*batch.inputs.values())
        return [out[row, : len(tokens)].cpu() for row, tokens in enumerate(sequences)]

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text or token ids); outputs keep the prompts' order."""
        sequences = self._make_sequences(prompts, params)
        self._require_weights()
        with torch.inference_mode():
            for start in range(0, len(sequences), self.settings.max_batch_size):
                self._run_to_completion(sequences[start : start + self.settings.max_batch_size])
        return [s.output() for s in sequences]

    def _run_to_completion(self, sequences: list[Sequence]) -> None:
        active = list(sequences)
        total = max(s.params.max_tokens for s in active)
        with tqdm(total=total, desc="generating", unit="step", leave=False, mininterval=2.0, disable=None) as bar:
            while active:
                batch = build_graph_inputs(self.graph_inputs, [s.token_ids for s in active], self.device)
                logits = self.graph(*batch.inputs.values())
                last = logits[torch.arange(len(active), device=self.device), batch.last_positions]
                tokens = sample_next_tokens(last, [s.params for s in active], [s.generator for s in active])
                for sequence, token in zip(active, tokens):
                    sequence.append(token, self.tokenizer)
                active = [s for s in active if s.finish_reason is None]
                bar.update(1)

    def _make_sequences(self, prompts, params) -> list[Sequence]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise InvalidRequestError("generate() needs at least one prompt (a string or a list of token ids)")
        if params is None:
            params = SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        sequences = []
        for index, (prompt, p) in enumerate(zip(prompts, params_list)):
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError(f"params for prompt {index} must be SamplingParams, got {type(p).__name__}")
            p.validate()
            token_ids = self._tokenize(index, prompt)
            limit = self.settings.max_seq_len
            if len(token_ids) + p.max_tokens > limit:
                raise InvalidRequestError(
                    f"prompt {index} has {len(token_ids)} tokens and asks for max_tokens={p.max_tokens}: "
                    f"{len(token_ids) + p.max_tokens} > max_seq_len={limit}; shorten the prompt or lower max_tokens"
                )
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            generator = None
            if p.seed is not None and p.temperature > 0:
                generator = torch.Generator(device=self.device).manual_seed(p.seed)
            sequences.append(Sequence(prompt if isinstance(prompt, str) else None, token_ids, p, stops, generator))
        return sequences

    def _tokenize(self, index: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer files; pass tokenizer='…' to autodeploy() or give prompts as token ids"
                )
            token_ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise InvalidRequestError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise InvalidRequestError(f"prompt {index} is empty (no tokens); give it some text")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt {index} has token ids outside the vocabulary [0, {vocab}): {bad[:4]}")
        return token_ids

    def _graph_vocab_size(self) -> int:
        output = next(n for n in self.graph.graph.nodes if n.op == "output")
        value = fx.node.map_aggregate(output.args, lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a)
        logits = value[0][0] if isinstance(value[0], (list, tuple)) else value[0]
        return int(logits.shape[-1])

    def _require_weights(self) -> None:
        if self.device.type == "meta":
            raise InvalidRequestError("this model was deployed on the meta device (no weights); deploy with device='cpu' or 'cuda' to generate")
