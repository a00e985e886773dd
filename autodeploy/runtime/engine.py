"""``Engine``: one scheduling step at a time — plan, run the graph once, sample, update requests.

The engine owns the KV caches, the block pool and the scheduler. ``add_request`` validates a request
completely before queueing it (a bad request raises ``InvalidRequestError`` and nothing else is
touched); ``step`` launches one forward for whatever the scheduler planned, applies the step before it
(overlapped runtime: the device computes one step while the host prepares the next) and returns the
requests that got new tokens; ``abort`` cancels a request and frees its blocks at once. It is thread-safe.

Outputs do not depend on who steps: after every step, and when a request is aborted, the engine hands
each changed request's output to the request's ``OutputSink`` (if it has one). So any number of front
ends (``LLM.generate``, ``LLM.stream``, ``AsyncLLM``s) share one engine from any threads, each stepping
when nobody else is (``step_or_wait``) and reading only its own sinks.

    engine = llm.engine
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    print(request.output(llm.tokenizer).token_ids)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from autodeploy.custom_ops.parallel_state import Layout
from autodeploy.custom_ops.serving_signature import KVCacheSpec
from autodeploy.deployment import Deployment
from autodeploy.errors import InvalidRequestError, UnsupportedModelError
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.compiled_graph import TORCH_COMPILE_BACKENDS, CompiledGraph
from autodeploy.runtime.cuda_graphs import DecodeGraphs
from autodeploy.runtime.kv_cache import allocate_kv_caches, plan_num_blocks
from autodeploy.runtime.outputs import CompletionOutput
from autodeploy.runtime.piecewise_graphs import NotSplittable, PiecewiseGraphs
from autodeploy.runtime.pipeline_schedule import PipelineSchedule
from autodeploy.runtime.request import Request, Sequence
from autodeploy.runtime.device_copies import to_device
from autodeploy.runtime.sampler import PendingSample, SampleResult, SamplingRow, has_penalty, launch_sample
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.runtime.scheduler import ScheduledChunk, Scheduler
from autodeploy.runtime.step_inputs import PendingTokens, build_step_inputs
from autodeploy.runtime.structured_output import StructuredOutput, new_matcher, next_token_bitmask

logger = logging.getLogger(__name__)

Prompt = str | list[int]

# Enough tokens for a forward to show whether the model computes finite logits at all.
_LOGITS_CHECK_TOKENS = 16


@dataclass
class _SamplingPlan:
    """How one step's logits rows become tokens: ``rows[i]`` samples logits row ``row_logits[i]`` for
    ``owners[i]`` (the sequence it extends or forks from, and the completion index); beams separately."""

    rows: list[SamplingRow] = field(default_factory=list)
    row_logits: list[int] = field(default_factory=list)
    owners: list[tuple[Sequence, int]] = field(default_factory=list)
    beam_rows: list[tuple[Sequence, int]] = field(default_factory=list)
    # No beams, forks, penalties or grammars: the next step needs none of its tokens on the host.
    overlappable: bool = True


@dataclass
class _Step:
    """A launched step, until the host has applied its tokens."""

    chunks: list[ScheduledChunk]
    sampling: _SamplingPlan
    run_ahead: bool  # the next step may be planned and launched before this one is applied
    token_rows: dict[int, int] = field(default_factory=dict)  # seq_id → its token's row in sample.tokens
    sample: PendingSample | None = None
    beam_logprobs: torch.Tensor | None = None


class Peers(Protocol):
    """Rank 0's handle on the worker processes of a deployment over several ranks (``Workers`` in
    ``autodeploy/distributed.py``). Every rank runs this engine over its own slices; rank 0 tells the others
    what to run, in the order it runs it, so their collectives pair up."""

    def step(self, commands: list[tuple]) -> None:
        """Workers: apply ``commands`` (``Engine.apply_commands``), then ``Engine.step``."""

    def prompt_logits(self, token_ids: list[int]) -> None:
        """Workers: ``Engine.prompt_logits(token_ids)``."""

    def failure(self, error: Exception) -> Exception:
        """The error to report for a failed step: the dead or stuck worker behind it, if one is."""


def _request_fields(request: Request) -> tuple:
    """What a worker needs to build rank 0's request again (``Request``'s arguments)."""
    return (request.request_id, request.prompt, request.prompt_token_ids, request.params, request.stop_token_ids,
            request.seed, request.priority, request.arrival_time)


def _agreed_num_blocks(num_blocks: int, device: torch.device, ranks: int) -> int:
    """The fewest KV blocks any of the deployment's ``ranks`` can hold: every rank plans the same steps, so
    every pool has one size. One rank agrees with nobody, even where this process's group is another
    deployment's (a one-process deployment beside a distributed one)."""
    if ranks == 1 or not (dist.is_available() and dist.is_initialized()):
        return num_blocks
    fewest = torch.tensor([num_blocks], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    return int(fewest.item())


class Engine:
    def __init__(self, deployment: Deployment, check_logits: bool = True, peers: Peers | None = None):
        """Serve ``deployment``'s model graph over its serving signature. ``check_logits``: a warm-up forward
        must give finite logits (build-time verification turns it off for the twin, whose logits it checks and
        localises itself). The signature's ``decode_graph_batch_sizes``: the compile stage's sizes for decode
        steps replayed as CUDA graphs (``runtime/cuda_graphs.py``); its ``prefill_graph_token_sizes``: the token
        counts for prefill and mixed steps replayed as piecewise graphs (``runtime/piecewise_graphs.py``),
        captured first: their memory is gone before the pool is sized. ``peers``: the worker processes of a
        deployment over several ranks that ``autodeploy()`` spawned, when this is rank 0's engine (see
        :class:`Peers`)."""
        signature = deployment.signature
        graph, graph_inputs, kv_caches = deployment.graph, signature.inputs, signature.kv_caches
        settings, tokenizer, eos_token_ids = deployment.settings, deployment.tokenizer, deployment.eos_token_ids
        vocab_size = deployment.vocab_size
        decode_graph_batch_sizes, prefill_graph_token_sizes = signature.decode_graph_batch_sizes, signature.prefill_graph_token_sizes
        self.graph = CompiledGraph(graph) if settings.compile.backend in TORCH_COMPILE_BACKENDS else graph
        self.graph_inputs = graph_inputs
        self.pipeline = PipelineSchedule.from_settings(settings)  # pipeline_parallel > 1: micro-batches through the stages
        self.settings = settings
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.device = torch.device(settings.device)
        self.max_seq_len = settings.max_seq_len
        self.max_num_tokens = settings.scheduler.max_num_tokens
        block_size = settings.kv_cache.block_size
        warmed_up = []
        graph_sizes = sorted(set(decode_graph_batch_sizes))
        started = phase_began = time.perf_counter()
        phases: dict[str, float] = {}

        def phase_done(name: str) -> None:
            nonlocal phase_began
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - phase_began
            phase_began = time.perf_counter()

        self.prefill_graphs = self._capture_prefill_graphs(kv_caches, prefill_graph_token_sizes) if prefill_graph_token_sizes else None
        phase_done("prefill graphs")

        def warm_up(num_tokens: int) -> None:
            self._warm_up(kv_caches, min(num_tokens, self.max_num_tokens, self.max_seq_len))
            warmed_up.append(True)

        num_blocks = plan_num_blocks(
            kv_caches, settings.kv_cache, settings.max_batch_size, self.max_seq_len, self.device, warm_up,
            graph_tokens=graph_sizes[-1] if graph_sizes else 0,
        )
        num_blocks = _agreed_num_blocks(num_blocks, self.device, Layout.requested(settings.distributed).world_size)
        if not warmed_up and check_logits:  # only GPU pool sizing needs the full budget; every device checks the logits
            self._warm_up(kv_caches, min(_LOGITS_CHECK_TOKENS, self.max_num_tokens, self.max_seq_len))
        phase_done("warm-up")
        # With decode graphs, one block more than the pool hands out: the padding rows' keys and values go there.
        self.caches = allocate_kv_caches(kv_caches, num_blocks + bool(graph_sizes), block_size, self.device)
        self.pool = KVBlockPool(num_blocks, block_size, settings.kv_cache.prefix_caching)
        phase_done("KV pool")
        self.decode_graphs = self._capture_decode_graphs(graph_sizes, pad_block=num_blocks) if graph_sizes else None
        phase_done("decode graphs")
        logger.info("engine ready in %.2f s (%s)", time.perf_counter() - started,
                    ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
        self.scheduler = Scheduler(self.pool, settings.max_batch_size, self.max_num_tokens, settings.scheduler.chunked_prefill)
        self.requests: dict[str, Request] = {}
        self._request_ids = itertools.count()
        self._seeds = random.Random(settings.seed)
        self._lock = threading.RLock()  # requests, scheduler and pool
        self._step_lock = threading.Lock()  # one step at a time
        self._turn = threading.Condition()  # who steps next among front ends (step_or_wait)
        self._stepping = False
        overlap = settings.scheduler.overlap
        self.overlap = self.device.type == "cuda" if overlap is None else overlap  # None: on GPUs (see SchedulerSettings)
        self._in_flight: _Step | None = None  # the step launched and not yet applied (overlapped runtime)
        self.clock = time.perf_counter  # every timestamp in RequestMetrics; benchmarks may inject their own
        self.peers = peers
        self._commands: list[tuple[str, Request | str]] = []  # with peers: submits and aborts for the next step
        self._structured_output: StructuredOutput | None = None  # built by the first json_schema / json_object request
        self._longest_text: int | None = None  # check_text_length's bound, from the vocabulary when first needed

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0
    ) -> Request:
        """Validate and queue one request (lower ``priority`` values are served first)."""
        request = self.make_request(prompt, params, request_id, priority)
        self.submit(request)
        return request

    def make_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0
    ) -> Request:
        """Validate a request and build it, without queueing it (``submit`` does)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer (lower is served first), got {priority!r}")
        token_ids = self.tokenize(prompt)
        self._check_fits(token_ids, params)
        biased_outside = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if biased_outside:
            raise InvalidRequestError(f"logit_bias has token ids outside the vocabulary [0, {self.vocab_size}): {biased_outside[:4]}")
        grammar = self._compiled_grammar(params)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(31)
        with self._lock:
            request_id = str(next(self._request_ids)) if request_id is None else str(request_id)  # submit checks it is free
            request = Request(
                request_id, prompt if isinstance(prompt, str) else None, token_ids, params, stops, seed, priority, self.clock()
            )
        request.grammar = grammar
        return request

    def _compiled_grammar(self, params: SamplingParams):
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

    def submit(self, request: Request) -> None:
        """Queue a request. With peers, it joins at the start of the next step, on every rank alike."""
        with self._lock:
            queued = {c.request_id for kind, c in self._commands if kind == "submit"}
            if request.request_id in self.requests or request.request_id in queued:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use; pick another or leave it unset")
            if self.peers is not None:
                self._commands.append(("submit", request))
                return
            self._add(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks go back to the pool now (with peers: at the start of the next step);
        its sink gets a final output whose completions end with ``"abort"``. Unknown or already finished
        requests are left alone."""
        with self._lock:
            if self.peers is not None:
                self._commands.append(("abort", str(request_id)))
            else:
                self._abort(str(request_id))

    def apply_commands(self, commands: list[tuple]) -> None:
        """A worker's replay of the submits and aborts that rank 0 queued before a step (``Peers.step``'s
        message), in their order, with rank 0's request ids, seeds and arrival times."""
        with self._lock:
            for kind, payload in commands:
                if kind == "submit":
                    request = Request(*payload)
                    request.grammar = self._compiled_grammar(request.params)
                    self._add(request)
                else:
                    self._abort(payload)

    def _add(self, request: Request) -> None:
        self._start_grammar(request.sequences[0])
        self.requests[request.request_id] = request
        self.scheduler.add(request.sequences[0])

    def _abort(self, request_id: str) -> None:
        request = self._cancel(request_id)
        if request is not None:
            self._deliver(request)

    def _mirror_commands(self) -> None:
        """Rank 0: send the queued submits and aborts to the workers with the order to step, then apply
        them here, so every rank plans the step from the same requests."""
        with self._lock:
            commands, self._commands = self._commands, []
            self.peers.step([("submit", _request_fields(c)) if kind == "submit" else (kind, c) for kind, c in commands])
            for kind, command in commands:
                if kind == "submit":
                    self._add(command)
                else:
                    self._abort(command)

    def _cancel(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.aborted = True
        for sequence in request.sequences:
            if sequence.finish_reason is None:
                sequence.finish_reason = "abort"
            self.scheduler.remove(sequence)
        request.finish_time = self.clock()
        return request

    def _deliver(self, request: Request) -> None:
        sink = request.sink
        if sink is not None and (sink.streaming or request.finished):
            sink.put(request.output(self.tokenizer, streaming=sink.streaming))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests) or any(kind == "submit" for kind, _ in self._commands)

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
        copies = params.beam_width if params.beam_width > 1 else 1  # a beam group must fit at once
        if copies * -(-total // self.pool.block_size) > self.pool.num_blocks:
            raise InvalidRequestError(
                f"{copies} sequence(s) of {total} tokens need more KV blocks than the pool has ({self.pool.num_blocks} "
                f"of {self.pool.block_size} tokens); lower max_tokens / beam_width or give the cache more memory (kv_cache settings)"
            )
        if not self.settings.scheduler.chunked_prefill and total > self.max_num_tokens:
            raise InvalidRequestError(
                f"{total} tokens exceed scheduler.max_num_tokens={self.max_num_tokens} with chunked prefill off; "
                f"turn scheduler.chunked_prefill on or raise max_num_tokens"
            )

    # ---- stepping ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Launch the next planned step, apply the one before it, hand every changed request's output to
        its sink, and return the changed requests (new tokens or finished).

        Overlapped (``scheduler.overlap``): a step whose sampling the host need not see before planning
        the next one (no beam search, ``n`` forks, penalties or grammars) stays in flight. The next call
        plans and launches the step after it, its newest tokens fed from the device, and only then waits for the
        one in flight and applies its tokens: the host's work hides behind the device's. A sequence that
        stopped on a token in flight wastes its row of the next step; nothing it computes is kept.

        The engine's lock is held to plan and stage a step and to apply its tokens, not while the device
        computes: requests can be added and aborted meanwhile (a request aborted mid-step gets nothing
        from it; its blocks were freed at once and only a later plan hands them out, after the device has
        run what was queued before). Steps run one at a time. When a forward or its sampling raises, the
        requests of that step are aborted, their sinks get the error, and it is raised here too.
        """
        with self._step_lock, self._peer_failures():
            if self.peers is not None:
                self._mirror_commands()
            previous, self._in_flight = self._in_flight, None
            try:
                launched = self._plan_and_launch(previous)
            except BaseException:
                if previous is not None:
                    with contextlib.suppress(Exception):  # its tokens are valid; a failure fails its requests
                        self._finish(previous)
                raise
            changed = self._finish(previous) if previous is not None else []
            if launched is not None:
                if launched.run_ahead:
                    self._in_flight = launched
                else:
                    changed += [r for r in self._finish(launched) if r not in changed]
            return changed

    def _plan_and_launch(self, previous: _Step | None) -> _Step | None:
        """Plan a step and queue its forward and sampling on the device, without waiting for them."""
        with self._lock:
            plan = self.scheduler.schedule()
            if not plan.chunks:
                return None
            now = self.clock()
            for chunk in plan.chunks:
                if chunk.sequence.request.first_scheduled_time is None:
                    chunk.sequence.request.first_scheduled_time = now
            try:
                step, run = self._stage_step(plan.chunks, previous)
            except Exception as error:
                self._fail(plan.chunks, error)
                raise
        try:
            self._launch_sampling(step, run())
        except Exception as error:
            with self._lock:
                self._fail(plan.chunks, error)
            raise
        return step

    def _stage_step(self, chunks: list[ScheduledChunk], previous: _Step | None) -> tuple[_Step, Callable[[], torch.Tensor]]:
        pending = PendingTokens(previous.sample.tokens, previous.token_rows) if previous is not None and previous.sample else None
        run, completing = self._graph_call(chunks, pending=pending)
        for chunk in chunks:  # counted as computed now, so the next plan can run ahead of this step
            chunk.sequence.num_computed = chunk.start + chunk.length
        sampling = self._sampling_plan([chunks[i].sequence for i in completing])
        step = _Step(chunks, sampling, run_ahead=self.overlap and sampling.overlappable and self._continues(chunks, completing))
        if step.run_ahead:
            for sequence, _ in sampling.owners:
                sequence.num_pending += 1
            step.token_rows = {sequence.seq_id: row for row, (sequence, _) in enumerate(sampling.owners)}
        return step, run

    def _continues(self, chunks: list[ScheduledChunk], completing: list[int]) -> bool:
        """Whether a next step could be planned before this one's tokens are known: some prompt is part
        way, some sequence has tokens to go after this one, or requests wait."""
        if len(completing) < len(chunks) or self.scheduler.waiting:
            return True
        for index in completing:
            sequence = chunks[index].sequence
            if sequence.num_tokens + 1 - len(sequence.request.prompt_token_ids) < sequence.request.params.max_tokens:
                return True
        return False

    def _launch_sampling(self, step: _Step, logits: torch.Tensor) -> None:
        sampling = step.sampling
        if sampling.rows:
            picked = logits
            if sampling.row_logits != list(range(logits.shape[0])):
                picked = logits.index_select(0, to_device(sampling.row_logits, torch.long, logits.device))
            step.sample = launch_sample(picked, sampling.rows)
        if sampling.beam_rows:
            index = to_device([row for _, row in sampling.beam_rows], torch.long, logits.device)
            step.beam_logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)

    def _finish(self, step: _Step) -> list[Request]:
        """Wait for a launched step's tokens, apply them and deliver the outputs they change."""
        try:
            result = step.sample.result() if step.sample is not None else None
        except Exception as error:
            with self._lock:
                self._fail(step.chunks, error)
            raise
        with self._lock:
            try:
                changed = self._apply(step, result)
            except Exception as error:
                self._fail(step.chunks, error)
                raise
            for request in changed:
                self._deliver(request)
            return changed

    @contextlib.contextmanager
    def _peer_failures(self):
        """With peers, a failed collective raises the error naming the worker behind it."""
        try:
            yield
        except Exception as error:
            failure = self.peers.failure(error) if self.peers is not None else error
            if failure is error:
                raise
            raise failure from error

    def _fail(self, chunks: list[ScheduledChunk], error: Exception) -> None:
        if self.peers is not None:
            error = self.peers.failure(error)
        for request in {id(c.sequence.request): c.sequence.request for c in chunks}.values():
            if self._cancel(request.request_id) is not None and request.sink is not None:
                request.sink.fail(error)

    def step_or_wait(self) -> None:
        """``step``; or, while another caller of ``step_or_wait`` is stepping, wait for that step to end.

        Every step delivers to every request's sink, so front ends sharing the engine take turns
        instead of queueing on its lock: a waiting front end is free to read what the step gave it.
        """
        with self._turn:
            if self._stepping:
                self._turn.wait()
                return
            self._stepping = True
        try:
            self.step()
        finally:
            with self._turn:
                self._stepping = False
                self._turn.notify_all()

    def forward(self, chunks: list[ScheduledChunk], logits_for_all_tokens: bool = False) -> tuple[torch.Tensor, list[int]]:
        """One forward over ``chunks``: the logits ``[rows, vocab]`` and the chunks they belong to
        (see ``build_step_inputs``). A decode step a captured CUDA graph holds replays it."""
        run, completing = self._graph_call(chunks, logits_for_all_tokens)
        return run(), completing

    def _graph_call(self, chunks: list[ScheduledChunk], logits_for_all_tokens: bool = False, pending: PendingTokens | None = None):
        """Fill the step's inputs from the pool's tables (``(run, completing)``); ``run()`` computes the logits."""
        if self.pipeline is not None:  # this rank's stage, the step's chunks in micro-batches (no CUDA graphs)
            return self.pipeline.stage_step(self.graph, self.graph_inputs, chunks, self.pool, self.caches, self.device,
                                            logits_for_all_tokens, pending)
        if self.decode_graphs is not None and self.decode_graphs.serves(chunks, logits_for_all_tokens):
            size = self.decode_graphs.stage(chunks, self.pool.block_table, pending)
            completing = [] if logits_for_all_tokens else list(range(len(chunks)))
            return (lambda: self.decode_graphs.replay(size, len(chunks))), completing
        inputs, completing = build_step_inputs(
            self.graph_inputs, chunks, self.pool, self.caches, self.device, logits_for_all_tokens=logits_for_all_tokens,
            pending=pending,
        )
        num_tokens = sum(chunk.length for chunk in chunks)
        if self.prefill_graphs is not None and self.prefill_graphs.serves(num_tokens):
            return (lambda: self.prefill_graphs.run(inputs, num_tokens)), completing
        return (lambda: self.graph(*inputs)[0]), completing

    def _capture_prefill_graphs(self, specs: SequenceABC[KVCacheSpec], sizes: SequenceABC[int]) -> PiecewiseGraphs | None:
        try:
            graphs = PiecewiseGraphs(self.graph, self.graph_inputs, sizes, self.device)
        except NotSplittable as reason:
            logger.warning("prefill steps run eagerly: the graph cannot be split into captured pieces (%s)", reason)
            return None
        try:
            with torch.inference_mode():
                graphs.capture_all(lambda num_tokens: self._probe_inputs(specs, num_tokens)[0])
        except Exception as error:  # a kernel the compile stage could not vet: slower, never wrong
            logger.warning("prefill CUDA graph capture failed (%s: %s); prefill steps run eagerly", type(error).__name__, error)
            return None
        return graphs

    def _capture_decode_graphs(self, sizes: list[int], pad_block: int) -> DecodeGraphs | None:
        graphs = DecodeGraphs(self.graph, self.graph_inputs, self.caches, sizes, self.settings.kv_cache.block_size,
                              self.max_seq_len, pad_block, self.device)
        try:
            with torch.inference_mode():
                graphs.capture_all()
        except Exception as error:  # a kernel the compile stage could not vet: slower, never wrong
            logger.warning("decode CUDA graph capture failed (%s: %s); decode steps run eagerly", type(error).__name__, error)
            return None
        return graphs

    def _sampling_plan(self, sequences: list[Sequence]) -> _SamplingPlan:
        """The sampling rows of the sequences that reach their last token (one per logits row, in order)."""
        plan = _SamplingPlan()
        for row, sequence in enumerate(sequences):
            request = sequence.request
            if request.beam_search is not None:
                plan.beam_rows.append((sequence, row))
                continue
            forking = request.params.n > 1 and len(request.sequences) == 1 and not sequence.output_token_ids
            for index in range(request.params.n if forking else 1):
                index = index if forking else sequence.index
                # A constrained sequence never has a token in flight (its steps do not run ahead), so its
                # matcher has seen every token; forks start from the parent's state, the grammar's start.
                bitmask = next_token_bitmask(sequence.grammar, self.vocab_size) if sequence.grammar is not None else None
                plan.rows.append(
                    SamplingRow(
                        request.params, request.seed, len(sequence.output_token_ids) + sequence.num_pending,
                        request.prompt_token_ids, sequence.output_token_ids, sample_index=index, token_bitmask=bitmask,
                    )
                )
                plan.row_logits.append(row)
                plan.owners.append((sequence, index))
            plan.overlappable &= not forking and not has_penalty(request.params) and request.grammar is None
        plan.overlappable &= not plan.beam_rows
        return plan

    def _apply(self, step: _Step, result: SampleResult | None) -> list[Request]:
        """Record what a step computed and append its tokens (or beam steps), for the requests still live."""
        for chunk in step.chunks:
            sequence = chunk.sequence
            if not sequence.request.aborted:  # only tokens the host knows are hashed into the prefix cache
                self.pool.register_full_blocks(sequence.seq_id, sequence.token_ids, min(sequence.num_computed, len(sequence.token_ids)))
        changed: dict[str, Request] = {}
        now = self.clock()
        # Forks first: the parent's own first token may end it (EOS), which frees the blocks they share.
        targets = [sequence if index == sequence.index or sequence.request.aborted else self._fork(sequence, index)
                   for sequence, index in step.sampling.owners]
        for i, ((sequence, _), target) in enumerate(zip(step.sampling.owners, targets)):
            if step.run_ahead:
                sequence.num_pending -= 1
            if target.request.aborted or target.finish_reason is not None:
                continue  # cancelled mid-step, or stopped on the token before this (a wasted row)
            target.append(result.token_ids[i], self.tokenizer)
            if target.grammar is not None:
                self._advance_grammar(target, result.token_ids[i])
            if result.logprobs[i] is not None:
                target.logprobs.append(result.logprobs[i])
                target.top_logprobs.append(result.top_logprobs[i])
            self._after_token(target, now, changed)
        beam_logprobs = step.beam_logprobs if step.beam_logprobs is not None else ()
        beams = [(s, logprobs) for (s, _), logprobs in zip(step.sampling.beam_rows, beam_logprobs) if not s.request.aborted]
        for sequence, logprobs in beams:
            sequence.pending_logprobs = logprobs
            sequence.awaiting_beam_step = True
        for request in {id(s.request): s.request for s, _ in beams}.values():
            if all(s.awaiting_beam_step for s in request.sequences):
                self._beam_step(request, now)
                changed[request.request_id] = request
        return list(changed.values())

    def _start_grammar(self, sequence: Sequence) -> None:
        """A matcher of its own at the grammar's start for each sample of a constrained request."""
        if sequence.request.grammar is not None:
            sequence.grammar = new_matcher(sequence.request.grammar, sequence.request.stop_token_ids)

    def _advance_grammar(self, sequence: Sequence, token: int) -> None:
        """Feed the sampled token to the sequence's matcher; the sequence stops once the grammar ends."""
        if not sequence.grammar.accept_token(token):  # the mask allowed it, so the matcher must accept it
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed (request {sequence.request.request_id})")
        if sequence.grammar.is_terminated():
            sequence.finish_reason = "stop"

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        """A new sample of ``parent``'s request sharing its computed full blocks (``n`` > 1)."""
        request = parent.request
        child = Sequence(request, list(request.prompt_token_ids), index)
        self._start_grammar(child)
        child.num_computed = self.pool.fork(parent.seq_id, child.seq_id, len(request.prompt_token_ids))
        request.sequences.append(child)
        self.scheduler.running.append(child)
        return child

    def _after_token(self, sequence: Sequence, now: float, changed: dict[str, Request]) -> None:
        request = sequence.request
        if sequence.index == 0:
            request.token_times.append(now)
        if sequence.finish_reason is not None:
            self.scheduler.remove(sequence)
        if request.finished:
            request.finish_time = now
            self.requests.pop(request.request_id, None)
        changed[request.request_id] = request

    def _beam_step(self, request: Request, now: float) -> None:
        search = request.beam_search
        parents = request.sequences
        search.step(torch.stack([s.pending_logprobs for s in parents]))
        request.token_times.append(now)
        if search.done:
            for sequence in parents:
                self.scheduler.remove(sequence)
            request.finished_completions = [
                self._beam_completion(request, index, result) for index, result in enumerate(search.best(request.params.n))
            ]
            request.sequences = []
            request.finish_time = now
            self.requests.pop(request.request_id, None)
            return
        survivors: list[Sequence] = []
        for beam in search.running:
            parent = parents[beam.parent]
            if parent not in survivors:  # the first child of a parent continues it in place
                sequence = parent
            else:  # a further child shares the parent's full blocks and recomputes the rest
                sequence = Sequence(request, request.prompt_token_ids + beam.token_ids[:-1], len(survivors))
                sequence.num_computed = self.pool.fork(parent.seq_id, sequence.seq_id, parent.num_computed)
                # A parent preempted while it waited for its group shares nothing: the child queues like a new prompt.
                (self.scheduler.running if sequence.num_computed else self.scheduler.waiting).append(sequence)
            sequence.token_ids.append(beam.token_ids[-1])
            sequence.awaiting_beam_step = False
            survivors.append(sequence)
        for sequence in parents:
            if sequence not in survivors:
                self.scheduler.remove(sequence)
        for index, sequence in enumerate(survivors):
            sequence.index = index
        request.sequences = survivors

    def _beam_completion(self, request: Request, index: int, result) -> CompletionOutput:
        ends_in_stop = bool(result.token_ids) and result.token_ids[-1] in request.stop_token_ids
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return CompletionOutput(index, text, list(result.token_ids), "stop" if ends_in_stop else "length", cumulative_logprob=result.logprob)

    # ---- whole-prompt logits -------------------------------------------------------------------
    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` for every position of one token sequence (no prefix cache)."""
        if len(token_ids) > self.max_seq_len:
            raise InvalidRequestError(
                f"the sequence has {len(token_ids)} tokens > max_seq_len={self.max_seq_len}; shorten it, or deploy with "
                f"a larger max_seq_len (at most the model's max_position_embeddings)"
            )
        with self._step_lock, self._lock, self._peer_failures():  # a forward of its own: not beside a running step
            if self.peers is not None:
                self.peers.prompt_logits(list(token_ids))
            probe = _Probe(list(token_ids))
            try:
                if not self.pool.reserve(probe.seq_id, len(token_ids)):
                    raise InvalidRequestError(f"{len(token_ids)} tokens do not fit in the free KV blocks now; try again when idle")
                run, _ = self._graph_call([ScheduledChunk(probe, 0, len(token_ids))], logits_for_all_tokens=True)
                return run()
            finally:
                self.pool.free(probe.seq_id)

    def _probe_inputs(self, specs: SequenceABC[KVCacheSpec], num_tokens: int) -> tuple[list[torch.Tensor], dict]:
        """The graph's inputs for one prompt of ``num_tokens`` tokens on a throwaway cache (and that cache)."""
        block_size = self.settings.kv_cache.block_size
        scratch = KVBlockPool(-(-num_tokens // block_size), block_size, enable_prefix_caching=False)
        caches = allocate_kv_caches(specs, scratch.num_blocks, block_size, self.device)
        probe = _Probe([i % self.vocab_size for i in range(num_tokens)])
        scratch.reserve(probe.seq_id, num_tokens)
        inputs, _ = build_step_inputs(self.graph_inputs, [ScheduledChunk(probe, 0, num_tokens)], scratch, caches, self.device)
        return inputs, caches

    def _warm_up(self, specs: SequenceABC[KVCacheSpec], num_tokens: int) -> None:
        """One forward of ``num_tokens`` tokens on a throwaway cache. Its peak memory sizes the GPU pool;
        its logits must be finite, or the model would only ever generate garbage."""
        with torch.inference_mode():
            inputs, caches = self._probe_inputs(specs, num_tokens)
            logits = self.graph(*inputs)[0]
            num_nan, num_inf = int(logits.isnan().sum()), int(logits.isinf().sum())
        del caches, inputs, logits
        if num_nan or num_inf:
            seen = " and ".join(f"{count} {what}" for count, what in ((num_nan, "nan"), (num_inf, "inf")) if count)
            advice = "check the checkpoint's weights for nan/inf"
            if self.settings.dtype == "float16":
                advice = f"float16 often overflows: deploy with dtype='bfloat16' (or 'float32'); if that does not help, {advice}"
            raise UnsupportedModelError(
                f"the model's logits are not finite: a warm-up forward of {num_tokens} tokens in {self.settings.dtype} "
                f"gave {seen} among {self.vocab_size} logits; {advice}"
            )


def _check_unicode(prompt: str) -> None:
    """Tokenizers reject text that UTF-8 cannot encode (lone UTF-16 surrogates) with a bare TypeError."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"the prompt is not valid Unicode: character {error.start} ({prompt[error.start]!r}) is a lone surrogate "
            f"(half of a UTF-16 pair); decode the text with errors='replace' or remove that character"
        ) from None


class _Probe:
    """A stand-in sequence for forwards outside the scheduler (warm-up, ``prompt_logits``)."""

    _ids = itertools.count(-1, -1)

    def __init__(self, token_ids: list[int]):
        self.seq_id = next(self._ids)
        self.token_ids = token_ids
        self.num_tokens = len(token_ids)
