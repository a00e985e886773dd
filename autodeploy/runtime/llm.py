"""``LLM``: the deployed model — ``generate`` a batch, ``stream`` one prompt, read ``logits``.

Everything runs through one :class:`~autodeploy.runtime.engine.Engine` (paged KV cache, in-flight
batching), so a ``stream`` and a ``generate`` started from different threads share batches. For asyncio
servers see :class:`~autodeploy.runtime.async_llm.AsyncLLM`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC

import torch
from torch import fx
from tqdm import tqdm

from autodeploy.custom_ops.cached_attention import KVCacheSpec
from autodeploy.errors import InvalidRequestError
from autodeploy.pipeline import TransformRecord, format_report
from autodeploy.runtime.engine import Engine, Prompt
from autodeploy.runtime.outputs import RequestOutput
from autodeploy.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """A deployed model: ``generate`` text, ``stream`` it, inspect the pipeline that built it.

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
        kv_caches: SequenceABC[KVCacheSpec] = (),
        model_directory: str | None = None,
    ):
        self.graph = graph
        self.graph_inputs = graph_inputs
        self.settings = settings
        self.tokenizer = tokenizer
        self.records = records or []
        self.model_directory = model_directory  # the checkpoint or config folder it was built from
        self.device = torch.device(settings.device)
        self.vocab_size = self._graph_vocab_size()
        self._eos_token_ids = list(eos_token_ids)
        self._kv_caches = tuple(kv_caches)
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        """The serving engine, built on first use (it sizes and allocates the KV cache)."""
        if self._engine is None:
            if self.device.type == "meta":
                raise InvalidRequestError(
                    "this model was deployed on the meta device (no weights); deploy with device='cpu' or 'cuda' to generate"
                )
            if not self._kv_caches:
                raise InvalidRequestError(
                    "this graph has no KV cache (the insert_cached_attention transform is disabled); enable it to generate"
                )
            self._engine = Engine(
                self.graph, self.graph_inputs, self._kv_caches, self.settings, self.tokenizer, self._eos_token_ids, self.vocab_size
            )
        return self._engine

    def free_kv_cache(self) -> None:
        """Drop the engine and its KV cache now (the pool holds most of a GPU); the next request builds
        them again. Requests still in flight are lost, so call it only when idle."""
        if self._engine is not None and self._engine.has_unfinished():
            raise InvalidRequestError("requests are still running; wait for them (or abort them) before freeing the KV cache")
        self._engine = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def pipeline_report(self) -> str:
        """Time, matches and node counts of every transform that built this model, and op histograms."""
        return format_report(self.records)

    def logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Logits ``[len(seq), vocab]`` (on the CPU) for every position of each token sequence."""
        engine = self.engine
        return [engine.prompt_logits(engine.tokenize(tokens)).cpu() for tokens in sequences]

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        priority: int | list[int] = 0,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text or token ids); outputs keep the prompts' order.

        Every request is validated before any runs: one bad prompt or parameter raises
        ``InvalidRequestError`` and nothing is queued.
        """
        prompts = self._prompt_list(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        priorities = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        for what, given in (("SamplingParams", params_list), ("priorities", priorities)):
            if len(given) != len(prompts):
                raise InvalidRequestError(f"got {len(given)} {what} for {len(prompts)} prompts; pass one or one per prompt")
        engine = self.engine
        requests = []
        for index, (prompt, p, rank) in enumerate(zip(prompts, params_list, priorities)):
            try:
                requests.append(engine.make_request(prompt, p, priority=rank))
            except InvalidRequestError as error:
                raise InvalidRequestError(f"prompt {index}: {error}") from None
        try:
            for request in requests:
                engine.submit(request)
            total = sum(r.params.max_tokens for r in requests)
            with tqdm(total=total, desc="generating", unit="tok", leave=False, mininterval=2.0, disable=None) as bar:
                pending = {r.request_id for r in requests}
                while pending:
                    for request in engine.step():
                        if request.request_id in pending and request.finished:
                            pending.discard(request.request_id)
                            bar.update(request.params.max_tokens)
                    if not engine.has_unfinished():
                        break
        except BaseException:
            for request in requests:
                engine.abort(request.request_id)
            raise
        return [r.output(self.tokenizer) for r in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0) -> Iterator[RequestOutput]:
        """Yield the request's output each time it gets new tokens (``outputs[i].new_text`` /
        ``new_token_ids`` hold the new part); the last one has ``finished=True``. Closing the iterator
        early cancels the request.

        >>> for chunk in llm.stream("def add(a, b):", SamplingParams(max_tokens=8)):  # doctest: +SKIP
        ...     print(chunk.outputs[0].new_text, end="", flush=True)
        """
        engine = self.engine
        request = engine.add_request(prompt, params, priority=priority)
        try:
            while True:
                changed = engine.step()
                if any(r is request for r in changed):
                    output = request.output(self.tokenizer, streaming=True)
                    yield output
                    if output.finished:
                        return
                elif request.finished or not engine.has_unfinished():
                    return
        finally:
            if not request.finished:
                engine.abort(request.request_id)

    def _prompt_list(self, prompts) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise InvalidRequestError("generate() needs at least one prompt (a string or a list of token ids)")
        return list(prompts)

    def _graph_vocab_size(self) -> int:
        output = next(n for n in self.graph.graph.nodes if n.op == "output")
        value = fx.node.map_aggregate(output.args, lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a)
        logits = value[0][0] if isinstance(value[0], (list, tuple)) else value[0]
        return int(logits.shape[-1])
