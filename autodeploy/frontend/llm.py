"""``LLM``: the deployed model — ``generate`` a batch, ``stream`` one prompt, read ``logits``.

Everything runs through one :class:`~autodeploy.runtime.engine.Engine` (paged KV cache, in-flight
batching), so a ``stream`` and a ``generate`` started from different threads share batches. Each call
steps the engine when no one else is stepping and reads its outputs from its own sink, which any step
fills, whoever ran it. For asyncio servers see :class:`~autodeploy.frontend.async_llm.AsyncLLM`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import fx
from tqdm import tqdm

from autodeploy.build_report import TransformRecord, VerificationReport
from autodeploy.deployment import MODEL, POOLINGS, Deployment, as_deployment
from autodeploy.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from autodeploy.frontend.chat import ChatResult, run_chat
from autodeploy.runtime.embedder import Embedder, Embeddings, Scores, finish_vectors
from autodeploy.runtime.engine import Engine, Prompt
from autodeploy.runtime.outputs import RequestOutput
from autodeploy.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

EMBED_CHUNK = 1024  # texts LLM.embed tokenizes at a time, the next chunk on a thread while this one's forwards queue


class LLM:
    """A deployed model: ``generate`` text, ``stream`` it, inspect the pipeline that built it.

    >>> from autodeploy import autodeploy, SamplingParams
    >>> llm = autodeploy()                                         # the embedded demo model
    >>> llm.generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0))[0].text  # doctest: +SKIP
    """

    def __init__(self, deployment: Deployment, *legacy_arguments, **legacy_keywords):
        """Serve ``deployment`` (what ``autodeploy()`` builds or reloads). The form before ``Deployment``,
        ``LLM(graph, graph_inputs, settings, tokenizer, eos_token_ids, records, kv_caches, model_directory,
        verification, decode_graph_batch_sizes, prefill_graph_token_sizes)``, still works and warns."""
        deployment = as_deployment("LLM()", deployment, legacy_arguments, legacy_keywords)
        self.deployment = deployment
        self.device = torch.device(deployment.settings.device)
        self.vocab_size = deployment.vocab_size
        self._engine: Engine | None = None
        self._embedder: Embedder | None = None
        self._shut_down = False
        self.workers = None  # the worker processes autodeploy() spawned for the other ranks (autodeploy/distributed.py)

    # The deployment's parts as before it was one record. Setting one swaps in a new record rather than editing
    # it: a copy of this LLM (copy.copy) shares the old one.
    @property
    def graph(self) -> fx.GraphModule:
        """The served model graph (``deployment.graphs["model"]``)."""
        return self.deployment.graph

    @property
    def graph_inputs(self) -> tuple[str, ...]:
        """The graph's inputs in order, as the runtime fills them (the serving signature's)."""
        return self.deployment.signature.inputs

    @property
    def settings(self):
        """The resolved settings it was built (or reloaded) with."""
        return self.deployment.settings

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer; None serves token ids only."""
        return self.deployment.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.deployment = dataclasses.replace(self.deployment, tokenizer=tokenizer)

    @property
    def image_token(self) -> str | None:
        """A vision-language model's image placeholder as prompt text (``"<image>"``, Gemma 3's ``"<start_of_image>"``:
        one where each image goes); None for a model that takes no images."""
        boundaries = self.deployment.image_boundaries
        token_id = self.deployment.image_token_id if boundaries is None else boundaries.start_token_id
        return None if token_id is None or self.tokenizer is None else self.tokenizer.convert_ids_to_tokens(token_id)

    @property
    def records(self) -> list[TransformRecord]:
        """Every transform's record, in run order (``pipeline_report`` prints them)."""
        return self.deployment.report.records

    @property
    def verification(self) -> VerificationReport | None:
        """The build's verification (``autodeploy/verification.py``); None if it was off."""
        return self.deployment.report.verification

    @property
    def model_directory(self) -> str | None:
        """The checkpoint or config folder it was built from."""
        return self.deployment.model_directory

    @model_directory.setter
    def model_directory(self, directory: str | None) -> None:
        self.deployment = dataclasses.replace(self.deployment, model_directory=directory)

    @property
    def tasks(self) -> frozenset[str]:
        """What this deployment serves: ``"generate"`` (a language model: ``generate``, ``stream``, ``chat``),
        ``"embed"`` (an embedding model: ``embed``) or ``"score"`` (a cross-encoder: ``score``)."""
        if MODEL in self.deployment.graphs:
            return frozenset({"generate"})
        return frozenset({self.deployment.embedding.task})

    @property
    def max_seq_len(self) -> int:
        """The longest sequence it reads: a prompt and its completion, or a text to embed or score."""
        embedding = self.deployment.embedding
        return embedding.max_text_tokens if embedding is not None else int(self.settings.max_seq_len)

    @property
    def can_serve(self) -> bool:
        """Whether this deploy can generate: it has weights (not the meta device) and a KV cache."""
        return self.device.type != "meta" and bool(self.deployment.signature.kv_caches)

    @property
    def engine(self) -> Engine:
        """The serving engine, built on first use (it sizes and allocates the KV cache)."""
        if self._engine is None:
            if self._shut_down:
                raise InvalidRequestError("this LLM was shut down (LLM.shutdown); deploy the model again to generate")
            if "generate" not in self.tasks:
                raise UnsupportedModelError(self._task_message("generate text"))
            if self.device.type == "meta":
                raise InvalidRequestError(
                    "this model was deployed on the meta device (no weights); deploy with device='cpu' or 'cuda' to generate"
                )
            if not self.deployment.signature.kv_caches:
                raise InvalidRequestError(
                    "this graph has no KV cache (the insert_cached_attention transform is disabled); enable it to generate"
                )
            if self.workers is not None:
                self.workers.build_engine()
            self._engine = Engine(self.deployment, peers=self.workers)
        return self._engine

    @property
    def embedder(self) -> Embedder:
        """An encoder-only deployment's runner (``runtime/embedder.py``), built on first use."""
        if self._embedder is None:
            if self._shut_down:
                raise InvalidRequestError("this LLM was shut down (LLM.shutdown); deploy the model again")
            if self.deployment.embedding is None:
                raise UnsupportedModelError(self._task_message("embed or score texts"))
            if self.device.type == "meta":
                raise InvalidRequestError("this model was deployed on the meta device (no weights); deploy with device='cpu' or 'cuda'")
            self._embedder = Embedder(self.deployment)
        return self._embedder

    def _task_message(self, wanted: str) -> str:
        served = {"generate": "generates text (generate, stream, chat)", "embed": "embeds texts (llm.embed, /v1/embeddings)",
                  "score": "scores query–document pairs (llm.score, /v1/rerank, /v1/score)"}
        return (f"this model cannot {wanted}: it {' and '.join(served[task] for task in sorted(self.tasks))}. "
                f"Deploy an embedding model (BERT, XLM-R) to embed, a …ForSequenceClassification cross-encoder to score, "
                f"a causal LM to generate")

    def embed(self, inputs: str | list[int] | list[str | list[int]], *, pooling: str | None = None, normalize: bool | None = None,
              dimensions: int | None = None, prompt_name: str | None = None, prompt: str | None = None) -> Embeddings:
        """One vector a text (a string, or token ids as the model reads them), packed into as few forwards as the token
        budget allows. ``pooling``: ``"cls"``, ``"mean"`` or ``"last"`` (default: the model's own, from its
        sentence-transformers modules or ``"cls"``); ``dimensions``: keep the first components only (Matryoshka models);
        ``normalize``: L2-normalize (default: the model's own, normally yes). ``prompt_name`` / ``prompt``: text put
        before each string input, as ``SentenceTransformer.encode`` takes them (a name from the model's
        sentence-transformers prompts, e.g. ``"query"``; its ``default_prompt_name``'s when neither is given); token id
        inputs are read as given. A bad input (empty, too long, ids outside the vocabulary) raises
        ``InvalidRequestError`` naming its index, and nothing is returned.

        >>> llm = autodeploy("BAAI/bge-small-en-v1.5")                                  # doctest: +SKIP
        >>> out = llm.embed(["what is paged attention?", "a KV cache in blocks"])  # doctest: +SKIP
        >>> out.vectors @ out.vectors.T                                               # doctest: +SKIP
        """
        embedder = self.embedder
        if embedder.head.task != "embed":
            raise UnsupportedModelError(self._task_message("embed texts"))
        if pooling is not None and pooling not in POOLINGS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")
        items = self._inputs(inputs)
        prefix = self._prompt(embedder.head, prompt_name, prompt)
        if prefix:
            items = [prefix + item if isinstance(item, str) else item for item in items]
        if dimensions is not None and not 1 <= dimensions <= embedder.head.width:
            raise InvalidRequestError(f"dimensions must be between 1 and the model's {embedder.head.width}; got {dimensions}")
        pooled, num_tokens = [], []
        for first, texts in self._tokenized_chunks(items):  # a bad text raises before its chunk runs; nothing is returned
            pooled.append(embedder.run(texts, pooling=pooling, on_device=True, first_index=first, alone=len(items) == 1))
            num_tokens += [len(tokens) for tokens in texts]
        vectors = finish_vectors(torch.cat(pooled).cpu(), dimensions, embedder.head.normalize if normalize is None else normalize)
        return Embeddings(vectors, num_tokens)

    def score(self, query: str, documents: str | list[str]) -> Scores:
        """Each document's relevance to ``query`` from a cross-encoder (a ``…ForSequenceClassification`` checkpoint
        with one label): the sigmoid of its logit for the pair, as sentence-transformers' ``CrossEncoder`` reports it.

        >>> llm = autodeploy("cross-encoder/ms-marco-MiniLM-L6-v2")                      # doctest: +SKIP
        >>> llm.score("how do I page a KV cache?", ["blocks of 16 tokens", "a recipe"]).scores  # doctest: +SKIP
        """
        embedder = self.embedder
        if embedder.head.task != "score":
            raise UnsupportedModelError(self._task_message("score query–document pairs"))
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer files, so a query and a document cannot be paired")
        documents = [documents] if isinstance(documents, str) else list(documents)
        if not isinstance(query, str) or not documents or not all(isinstance(d, str) for d in documents):
            raise InvalidRequestError("score() takes a query string and a non-empty list of document strings")
        encoded = self.tokenizer([query] * len(documents), documents, add_special_tokens=True)
        texts = encoded["input_ids"]
        types = encoded.get("token_type_ids") or [[0] * len(ids) for ids in texts]
        logits = embedder.run(texts, types)
        return Scores(torch.sigmoid(logits).tolist(), [len(ids) for ids in texts])

    @staticmethod
    def _prompt(head, prompt_name: str | None, prompt: str | None) -> str:
        """The text put before each string input (sentence-transformers' rule: an explicit ``prompt``, else the named
        one, else the model's default; "" for none)."""
        if prompt is None and prompt_name is not None:
            if prompt_name not in head.prompts:
                named = ", ".join(map(repr, head.prompts)) or "none"
                raise InvalidRequestError(f"prompt_name {prompt_name!r} is not one of this model's prompts ({named})")
            prompt = head.prompts[prompt_name]
        elif prompt is None and head.default_prompt_name is not None:
            prompt = head.prompts[head.default_prompt_name]
        if prompt and not head.include_prompt:
            raise InvalidRequestError("this model's pooling leaves a prompt's rows out (sentence-transformers' include_prompt "
                                      "false), which autodeploy does not do yet: embed without a prompt, or put it in the text")
        return prompt or ""

    def _inputs(self, inputs) -> list:
        """``inputs`` as a list of strings and token id lists, each checked for its kind (not yet tokenized)."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not isinstance(inputs, (list, tuple)) or len(inputs) == 0:
            raise InvalidRequestError("no input: pass a string, a list of token ids, or a non-empty list of either")
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                if item == "":
                    raise InvalidRequestError(f"input {index} is an empty string: there is nothing to embed")
                if self.tokenizer is None:
                    raise InvalidRequestError("this model has no tokenizer files: pass token ids, not strings")
            elif not isinstance(item, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                raise InvalidRequestError(f"input {index} is neither a string nor a list of token ids")
        return list(inputs)

    def _tokenized(self, items: list) -> list[list[int]]:
        """Token ids of each item: strings through the tokenizer in one batch call (the fast tokenizers encode a batch on
        a pool of threads, without the GIL), token id lists as given."""
        strings = [index for index, item in enumerate(items) if isinstance(item, str)]
        texts = [None if isinstance(item, str) else list(item) for item in items]
        if strings:
            encoded = self.tokenizer([items[index] for index in strings], add_special_tokens=True)["input_ids"]
            for index, ids in zip(strings, encoded):
                texts[index] = ids
        return texts

    def _tokenized_chunks(self, items: list) -> Iterator[tuple[int, list[list[int]]]]:
        """``(first index, token ids)`` of ``EMBED_CHUNK`` items at a time, the next chunk tokenized on a thread while the
        caller queues this one's forwards: tokenizing overlaps the device's work instead of preceding all of it."""
        chunks = [(first, items[first:first + EMBED_CHUNK]) for first in range(0, len(items), EMBED_CHUNK)]
        if len(chunks) == 1:
            yield 0, self._tokenized(items)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as tokenizing:
            pending = tokenizing.submit(self._tokenized, chunks[0][1])
            for index, (first, _) in enumerate(chunks):
                texts = pending.result()
                if index + 1 < len(chunks):
                    pending = tokenizing.submit(self._tokenized, chunks[index + 1][1])
                yield first, texts

    def save(self, directory: str | Path) -> Path:
        """Write this deployment to ``directory`` (a new or empty folder, or an earlier save, which is replaced):
        the graph in ``torch.export``'s format, its tensors as safetensors, the settings, the kernel choices,
        the tokenizer and a manifest. ``autodeploy(directory)`` serves it again without export, transforms or
        verification (``autodeploy/artifact``).

        >>> llm.save("deployed/tiny-llama")  # doctest: +SKIP
        >>> autodeploy("deployed/tiny-llama").generate("def f(x):")  # doctest: +SKIP
        """
        from autodeploy.artifact import save_deployment

        distributed = self.settings.distributed
        if max(int(distributed[name]) for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel")) > 1:
            raise ConfigError("saving a deployment over several ranks is not available yet (each rank holds its own "
                              "slices); save one built with tensor_parallel, expert_parallel and pipeline_parallel 1")
        return save_deployment(directory, self.deployment)

    def free_kv_cache(self) -> None:
        """Drop the engine and its KV cache now (the pool holds most of a GPU); the next request builds
        them again. Requests still in flight are lost, so call it only when idle."""
        if self._engine is not None and self._engine.has_unfinished():
            raise InvalidRequestError("requests are still running; wait for them (or abort them) before freeing the KV cache")
        if self.workers is not None:
            self.workers.free_engine()
        self._engine = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def is_shut_down(self) -> bool:
        """Whether :meth:`shutdown` was called: this LLM serves no more and holds no ranks."""
        return self._shut_down

    def shutdown(self) -> None:
        """Stop the worker processes of a deployment over several ranks (``autodeploy(model,
        tensor_parallel=2)``), leave its process group and free the KV cache; later requests raise
        ``InvalidRequestError``, and this process can deploy over several ranks again. Also done when the
        ``LLM`` is garbage-collected and when the interpreter exits. A single-process deployment only frees
        its KV cache."""
        self._shut_down = True
        if self.workers is not None:
            self.workers.stop()
        self._engine = None
        self._embedder = None
        gc.collect()

    def pipeline_report(self) -> str:
        """Time, matches and node counts of every transform that built this model, op histograms, and
        the build-time verification; with speculative decoding, the drafter, its costs and its acceptance so far."""
        report = str(self.deployment.report)
        if self.deployment.draft is not None:
            report += "\n\ndraft model (speculative decoding):\n" + str(self.deployment.draft.report)
        speculator = self._engine.speculator if self._engine is not None else None
        if speculator is not None:
            report += "\n\n" + speculator.describe()
        return report

    def logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Logits ``[len(seq), vocab]`` (on the CPU) for every position of each token sequence (at most
        ``max_seq_len`` tokens each)."""
        engine = self.engine
        logits = []
        for index, tokens in enumerate(sequences):
            try:
                logits.append(engine.prompt_logits(engine.tokenize(tokens)).cpu())
            except InvalidRequestError as error:
                raise InvalidRequestError(f"sequence {index}: {error}") from None
        return logits

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
        sink = _CollectingSink(streaming=False)
        for request in requests:
            request.sink = sink
        finals: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                engine.submit(request)
            max_tokens = {r.request_id: r.params.max_tokens for r in requests}
            with tqdm(total=sum(max_tokens.values()), desc="generating", unit="tok", leave=False, mininterval=2.0, disable=None) as bar:
                while True:
                    for output in sink.take():
                        finals[output.request_id] = output
                        bar.update(max_tokens[output.request_id])
                    if len(finals) == len(requests):
                        break
                    engine.step_or_wait()
        except BaseException:
            for request in requests:
                engine.abort(request.request_id)
            raise
        return [finals[r.request_id] for r in requests]

    def chat(
        self,
        messages: list[dict],
        params: SamplingParams | None = None,
        tools=None,
        tool_choice: str | dict | None = None,
        max_rounds: int = 8,
        chat_template: str | None = None,
        parallel_tool_calls: bool = True,
        tool_call_format: str = "auto",
        reasoning: bool = False,
    ) -> ChatResult:
        """The assistant's answer to OpenAI-style ``messages``, through the chat template.

        ``tools``: a ``ToolRegistry`` (``autodeploy.ToolRegistry``), whose functions are run when the model calls
        them, their results fed back, for up to ``max_rounds`` turns; or OpenAI tool schemas, whose calls
        are returned (``ChatResult.tool_calls``) for the caller to run. ``tool_choice``: ``"auto"`` (the
        default with tools), ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name": …}}``,
        for the first turn. ``tool_call_format``: ``"hermes"`` (``<tool_call>`` tags), ``"json"`` (a bare
        ``{"name", "parameters"}`` object, as Llama 3.x templates ask) or ``"auto"``, the one the template
        teaches. ``reasoning``: split each answer's ``<think>…</think>`` block off (``frontend/reasoning.py``)
        into ``ChatResult.reasoning`` and the turn's ``reasoning_content``; calls are looked for in the rest.
        ``params`` default to greedy with ``max_tokens=256``.

        >>> reply = llm.chat([{"role": "user", "content": "Is it warm in Rome?"}], tools=registry)  # doctest: +SKIP
        >>> reply.content, [(r.call.name, r.output) for r in reply.trace]  # doctest: +SKIP
        """
        return run_chat(self, messages, params, tools, tool_choice, max_rounds, chat_template, parallel_tool_calls, tool_call_format,
                        reasoning)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0) -> Iterator[RequestOutput]:
        """Yield the request's output each time it gets new tokens (``outputs[i].new_text`` /
        ``new_token_ids`` hold the new part); the last one has ``finished=True``. Closing the iterator
        early cancels the request.

        >>> for chunk in llm.stream("def add(a, b):", SamplingParams(max_tokens=8)):  # doctest: +SKIP
        ...     print(chunk.outputs[0].new_text, end="", flush=True)
        """
        engine = self.engine
        request = engine.make_request(prompt, params, priority=priority)
        sink = request.sink = _CollectingSink(streaming=True)
        engine.submit(request)
        try:
            while True:
                for output in sink.take():
                    yield output
                    if output.finished:
                        return
                engine.step_or_wait()
        finally:
            if not request.finished:
                engine.abort(request.request_id)

    def _prompt_list(self, prompts) -> list[Prompt]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: text, token ids, or {"prompt": …, "images": […]}
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise InvalidRequestError("generate() needs at least one prompt (a string, a list of token ids, or "
                                      "{'prompt': …, 'images': […]})")
        return list(prompts)


class _CollectingSink:
    """Where the engine leaves a synchronous call's outputs until the call reads them (``take``)."""

    def __init__(self, streaming: bool):
        self.streaming = streaming
        self._outputs: deque[RequestOutput] = deque()  # appends and pops are atomic across threads
        self._error: BaseException | None = None

    def put(self, output: RequestOutput) -> None:
        self._outputs.append(output)

    def fail(self, error: BaseException) -> None:
        self._error = error

    def take(self) -> list[RequestOutput]:
        """The outputs delivered since the last call; raises the error of a failed step."""
        if self._error is not None:
            raise self._error
        taken = []
        while self._outputs:
            taken.append(self._outputs.popleft())
        return taken
