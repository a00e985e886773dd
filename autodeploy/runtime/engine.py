"""``Engine``: one scheduling step at a time — plan, run the graph once, sample, update requests.

The engine owns the requests and the scheduler, and delegates: admission to ``RequestIntake``
(``request_intake.py``), the forward and the KV pool to its ``ModelRunner`` (``model_runner.py``), turning
logits into tokens on sequences to ``sampled_tokens.py``, and, on rank 0 of several, telling the workers to
``RankMirror`` (``rank_mirror.py``). ``add_request`` validates a request completely before queueing it (a
bad request raises ``InvalidRequestError`` and nothing else is touched); ``step`` launches one forward for
whatever the scheduler planned, applies the step before it (overlapped runtime: the device computes one
step while the host prepares the next) and returns the requests that got new tokens; ``abort`` cancels a
request and frees its blocks at once. It is thread-safe.

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
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from autodeploy.deployment import VISION, Deployment
from autodeploy.custom_ops.serving_signature import ATTEND_UNTIL, TREE_MASK
from autodeploy.errors import ConfigError, InvalidRequestError
from autodeploy.runtime import draft_model, eagle3, mtp  # noqa: F401  (register the "draft", "eagle3" and "mtp" drafters)
from autodeploy.runtime.kv_handoff import KVHandoff
from autodeploy.runtime.model_runner import make_model_runner
from autodeploy.runtime.rank_mirror import Command, Peers, RankMirror
from autodeploy.runtime.request import Request, TokenRows
from autodeploy.runtime.request_intake import Prompt, RequestIntake
from autodeploy.runtime.sampled_tokens import SamplingPlan, TokenApplier, launch_sampling, plan_sampling
from autodeploy.runtime.sampler import PendingSample
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.runtime.scheduler import ScheduledChunk, Scheduler
from autodeploy.runtime.speculation_costs import StepCosts, measure_step_costs, timed_batch_sizes
from autodeploy.runtime.speculative import Speculator, hidden_state_buffer, make_drafter
from autodeploy.runtime.step_inputs import PendingTokens
from autodeploy.runtime.vision_encoder import VisionEncoder, vision_signature

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    """A launched step, until the host has applied its tokens."""

    chunks: list[ScheduledChunk]
    sampling: SamplingPlan
    run_ahead: bool  # the next step may be planned and launched before this one is applied
    token_rows: dict[int, int] = field(default_factory=dict)  # seq_id → its token's row in sample.tokens
    sample: PendingSample | None = None
    beam_logprobs: torch.Tensor | None = None


class Engine:
    def __init__(self, deployment: Deployment, check_logits: bool = True, peers: Peers | None = None):
        """Serve ``deployment`` through the model runner its settings and signature call for
        (``runtime/model_runner.py``). ``check_logits``: a warm-up forward must give finite logits (build-time
        verification turns it off for the twin, whose logits it checks and localises itself). ``peers``: the
        worker processes of a deployment over several ranks that ``autodeploy()`` spawned, when this is rank
        0's engine (see :class:`Peers`)."""
        settings, tokenizer, vocab_size = deployment.settings, deployment.tokenizer, deployment.vocab_size
        self.settings = settings
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = torch.device(settings.device)
        self.max_seq_len = settings.max_seq_len
        self.max_num_tokens = settings.scheduler.max_num_tokens
        self.runner = make_model_runner(deployment)
        speculative = settings.speculative
        if speculative.method and speculative.tree_width > 1 and TREE_MASK not in self.runner.graph_inputs:
            raise ConfigError("speculative.tree_width > 1, but this deployment's graph was built without tree drafts (no "
                              "tree_mask input: saved before, or built with tree_width 1); build it again with the tree_width")
        # A draft model's runner sizes its own pool first: the model's pool takes the memory left.
        drafter = make_drafter(deployment, speculative) if speculative.method else None
        started = time.perf_counter()
        phases = self.runner.set_up(check_logits)
        logger.info("engine ready in %.2f s (%s)", time.perf_counter() - started,
                    ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
        self.pool = self.runner.pool
        self.vision = (VisionEncoder(self.runner.graphs[VISION], vision_signature(deployment.graphs[VISION]),
                                     deployment.image_processor, deployment.image_token_id, settings,
                                     boundaries=deployment.image_boundaries, tokenizer=tokenizer,
                                     bidirectional=ATTEND_UNTIL in self.runner.graph_inputs)
                       if VISION in deployment.graphs else None)
        if self.vision is not None and self.vision.bidirectional and self.vision.tokens_per_image > self.max_num_tokens:
            raise ConfigError(f"an image's {self.vision.tokens_per_image} tokens attend to one another and must be computed in "
                              f"one step, but scheduler.max_num_tokens is {self.max_num_tokens}; raise it to at least "
                              f"{self.vision.tokens_per_image}")
        if self.vision is not None and settings.compile.backend == "cuda_graph":
            self.vision.capture()
        self.intake = RequestIntake(tokenizer, vocab_size, deployment.eos_token_ids, settings, self.pool,
                                    self.runner.side_inputs, self.vision, deployment.decoder_start_token_id)
        self.scheduler = Scheduler(self.pool, settings.max_batch_size, self.max_num_tokens, settings.scheduler.chunked_prefill)
        self.encoder = self.runner.encoder  # an encoder–decoder's encoder pass and cross-KV pool (None for the others)
        if self.encoder is not None:
            self.scheduler.preempted = self._release_cross_blocks
        self.requests: dict[str, Request] = {}
        self.speculator = (Speculator(drafter, speculative.num_tokens, self.pool, vocab_size, speculative.method,
                                      self._step_costs(speculative.num_tokens, speculative.tree_width) if speculative.auto else None,
                                      runner=self.runner)
                           if drafter is not None else None)
        # What a hidden-state drafter (eagle3, mtp) reads: the graph's copy of the layers it asked for.
        self.hidden_states = hidden_state_buffer(deployment.graph) if self.speculator is not None else None
        self.tokens = TokenApplier(self.pool, self.scheduler, self.requests, tokenizer,
                                   *((self.speculator.record, self.speculator.accept, self.speculator.relocate)
                                     if self.speculator is not None else ()))
        self._lock = threading.RLock()  # requests, scheduler and pool
        # A prompt's KV blocks out of this engine or into it (disaggregated serving's prefill and decode workers).
        self.handoff = KVHandoff(self.pool, self.runner.caches, self._lock)
        self._step_lock = threading.Lock()  # one step at a time
        self._turn = threading.Condition()  # who steps next among front ends (step_or_wait)
        self._stepping = False
        overlap = settings.scheduler.overlap
        self.overlap = self.device.type == "cuda" if overlap is None else overlap  # None: on GPUs (see SchedulerSettings)
        self._in_flight: _Step | None = None  # the step launched and not yet applied (overlapped runtime)
        self.clock = time.perf_counter  # every timestamp in RequestMetrics; benchmarks may inject their own
        self.mirror = RankMirror(peers) if peers is not None else None  # rank 0 of several: workers mirror its steps

    def _step_costs(self, num_tokens: int, tree_width: int = 1) -> StepCosts:
        """Decode and verification steps timed on this engine's runner and pool (``speculation_costs.py``); a tree
        of ``num_tokens`` levels verifies ``num_tokens × tree_width`` drafted tokens."""
        context = 64
        sizes = timed_batch_sizes(self.settings.max_batch_size, self.max_num_tokens,
                                  self.pool.num_blocks * self.pool.block_size, num_tokens * tree_width, context)
        with torch.inference_mode():
            costs = measure_step_costs(self.runner, sizes, num_tokens, context, width=tree_width)
        logger.info("speculation pays at batch %s from per-token acceptance %s", list(costs.batch_sizes),
                    [None if (t := costs.threshold(b)) is None else round(t, 2) for b in costs.batch_sizes])
        return costs

    @property
    def graph(self):
        """The graph that runs the steps (``ModelRunner.graph``; settable, to wrap it)."""
        return self.runner.graph

    @graph.setter
    def graph(self, graph) -> None:
        self.runner.graph = graph

    @property
    def eos_token_ids(self) -> set[int]:
        """The tokens that end a completion unless ``ignore_eos`` (admission reads them; settable)."""
        return self.intake.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids) -> None:
        self.intake.eos_token_ids = set(token_ids)

    @property
    def graph_inputs(self) -> tuple[str, ...]:
        return self.runner.graph_inputs

    @property
    def caches(self) -> dict[str, torch.Tensor]:
        return self.runner.caches

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0,
        side_inputs: Mapping[str, TokenRows] | None = None,
    ) -> Request:
        """Validate and queue one request (lower ``priority`` values are served first; ``side_inputs``: graph
        inputs other than token ids that the request carries, see ``TokenRows``)."""
        request = self.make_request(prompt, params, request_id, priority, side_inputs)
        self.submit(request)
        return request

    def make_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0,
        side_inputs: Mapping[str, TokenRows] | None = None,
    ) -> Request:
        """Validate a request and build it, without queueing it (``submit`` does); see ``RequestIntake``."""
        return self.intake.make_request(prompt, params, request_id, priority, self.clock, side_inputs)

    def submit(self, request: Request) -> None:
        """Queue a request. With peers, it joins at the start of the next step, on every rank alike."""
        with self._lock:
            queued = {r.request_id for r in self.mirror.queued_submits()} if self.mirror is not None else set()
            if request.request_id in self.requests or request.request_id in queued:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use; pick another or leave it unset")
            if self.mirror is not None:
                self.mirror.queue("submit", request)
                return
            self._add(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks go back to the pool now (with peers: at the start of the next step);
        its sink gets a final output whose completions end with ``"abort"``. Unknown or already finished
        requests are left alone."""
        with self._lock:
            if self.mirror is not None:
                self.mirror.queue("abort", str(request_id))
            else:
                self._abort(str(request_id))

    def apply_commands(self, commands: list[tuple]) -> None:
        """A worker's replay of the submits and aborts that rank 0 queued before a step (``Peers.step``'s
        message), in their order, with rank 0's request ids, seeds and arrival times."""
        with self._lock:
            self._run_commands([(kind, self._rebuilt(payload) if kind == "submit" else payload) for kind, payload in commands])

    def _rebuilt(self, fields: tuple) -> Request:
        request = Request(*fields)  # rank 0 validated it; its grammar is compiled here again
        request.grammar = self.intake.grammar(request.params)
        return request

    def _run_commands(self, commands: list[Command]) -> None:
        for kind, payload in commands:
            if kind == "submit":
                self._add(payload)
            else:
                self._abort(payload)

    def _add(self, request: Request) -> None:
        self.tokens.start_grammar(request.sequences[0])
        self.requests[request.request_id] = request
        self.scheduler.add(request.sequences[0])

    def _abort(self, request_id: str) -> None:
        request = self._cancel(request_id)
        if request is not None:
            self._deliver(request)

    def _cancel(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.aborted = True
        for sequence in request.sequences:
            if sequence.finish_reason is None:
                sequence.finish_reason = "abort"
            self.scheduler.remove(sequence)
        if self.encoder is not None:
            self.encoder.release(request)
        request.finish_time = self.clock()
        return request

    def _release_cross_blocks(self, sequence) -> None:
        """A preempted sequence's request gives its cross blocks back when it has no other sequence (it is encoded
        again when it runs again); a request's sequences that fork (n > 1, beams) share them until it is done."""
        request = sequence.request
        if len(request.sequences) == 1 and request.beam_search is None:
            self.encoder.release(request)

    def _deliver(self, request: Request) -> None:
        sink = request.sink
        if sink is not None and (sink.streaming or request.finished):
            sink.put(request.output(self.tokenizer, streaming=sink.streaming))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests) or bool(self.mirror is not None and self.mirror.queued_submits())

    def load(self) -> dict:
        """How busy the engine is now: prompt tokens waiting to be computed, sequences waiting and running, the share of
        KV blocks in use (what a router balances workers by)."""
        with self._lock:
            waiting, running = self.scheduler.waiting, self.scheduler.running
            return {"queued_prompt_tokens": sum(s.num_to_compute for s in waiting), "waiting": len(waiting),
                    "running": len(running), "kv_usage": round(self.pool.num_used_blocks / self.pool.num_blocks, 4)}

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (text through the tokenizer; ids checked against the vocabulary)."""
        return self.intake.tokenize(prompt, add_special_tokens)

    def check_text_length(self, text: str, what: str = "the prompt") -> None:
        """Refuse text that no ``max_seq_len`` tokens can spell, before tokenizing it."""
        self.intake.check_text_length(text, what)

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
        began = time.perf_counter()
        with self._step_lock, self._peer_failures():
            if self.mirror is not None:  # every rank plans this step from the same requests
                with self._lock:
                    self._run_commands(self.mirror.send_step())
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
                if self.speculator is not None:  # what auto weighs: steps as they ran
                    self.speculator.step_took(time.perf_counter() - began)
            return changed

    def _plan_and_launch(self, previous: _Step | None) -> _Step | None:
        """Plan a step and queue its forward and sampling on the device, without waiting for them."""
        with self._lock:
            plan = self.scheduler.schedule()
            if not plan.chunks:
                return None
            # Before the forward: the images of requests this step starts, and an encoder–decoder's encoder pass of the
            # requests it starts (or restarts after a preemption).
            if self.vision is not None:
                self._encode_first(self.vision, plan.chunks, lambda request: bool(request.images))
            if self.encoder is not None:
                self._encode_first(self.encoder, plan.chunks, lambda request: request.cross_table is None)
            if self.speculator is not None:
                self.speculator.extend(plan.chunks, self.max_num_tokens - plan.num_tokens)
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
            logits = run()
            if self.hidden_states is not None and self.speculator is not None:  # a hidden-state drafter copies this step's rows now
                self.speculator.observe(plan.chunks, self.runner.staged_rows(plan.chunks), self.hidden_states)
            step.sample, step.beam_logprobs = launch_sampling(step.sampling, logits)
        except Exception as error:
            with self._lock:
                self._fail(plan.chunks, error)
            raise
        return step

    def _encode_first(self, encoder, chunks: list[ScheduledChunk], pending: Callable[[Request], bool]) -> None:
        """``encoder.encode`` the chunks' requests that are ``pending`` (each once); on an error the step's requests get
        it, and nothing is left waiting."""
        starting = {id(c.sequence.request): c.sequence.request for c in chunks if pending(c.sequence.request)}
        if not starting:
            return
        try:
            encoder.encode(list(starting.values()))
        except Exception as error:
            self._fail(chunks, error)
            raise

    def _stage_step(self, chunks: list[ScheduledChunk], previous: _Step | None) -> tuple[_Step, Callable[[], torch.Tensor]]:
        pending = PendingTokens(previous.sample.tokens, previous.token_rows) if previous is not None and previous.sample else None
        run, completing = self.runner.stage(chunks, pending=pending)
        for chunk in chunks:  # counted as computed now, so the next plan can run ahead of this step
            chunk.sequence.num_computed = chunk.start + chunk.length
        sampling = plan_sampling([chunks[i] for i in completing], self.vocab_size)
        # While speculation drafts, every step waits for its tokens: the next draft starts from them.
        drafting = self.speculator is not None and self.speculator.drafting
        run_ahead = self.overlap and not drafting and sampling.overlappable and self._continues(chunks, completing)
        step = _Step(chunks, sampling, run_ahead=run_ahead)
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
                if self.speculator is not None:  # drafts left on the device: their tokens, read with the samples
                    self.speculator.resolve(step.chunks)
                changed = self.tokens.apply(step.chunks, step.sampling, result, step.beam_logprobs, step.run_ahead, self.clock())
                if self.encoder is not None:  # a finished request's cross blocks go back with its last sequence's
                    for request in changed:
                        if request.finished:
                            self.encoder.release(request)
                if self.speculator is not None:
                    self.speculator.flush_moves()
            except Exception as error:
                self._fail(step.chunks, error)
                raise
            for request in changed:
                self._deliver(request)
            return changed

    def _peer_failures(self):
        """With peers, a failed collective raises the error naming the worker behind it."""
        return self.mirror.failures() if self.mirror is not None else contextlib.nullcontext()

    def _fail(self, chunks: list[ScheduledChunk], error: Exception) -> None:
        if self.mirror is not None:
            error = self.mirror.peers.failure(error)
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
        return self.runner.forward(chunks, logits_for_all_tokens)

    # ---- whole-prompt logits -------------------------------------------------------------------
    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` for every position of one token sequence (no prefix cache)."""
        if self.encoder is not None:
            raise InvalidRequestError("an encoder-decoder's decoder reads its request's encoder input, which a bare token "
                                      "sequence does not give; generate with logprobs to score its output instead")
        if len(token_ids) > self.max_seq_len:
            raise InvalidRequestError(
                f"the sequence has {len(token_ids)} tokens > max_seq_len={self.max_seq_len}; shorten it, or deploy with "
                f"a larger max_seq_len (at most the model's max_position_embeddings)"
            )
        with self._step_lock, self._lock, self._peer_failures():  # a forward of its own: not beside a running step
            if self.mirror is not None:
                self.mirror.peers.prompt_logits(list(token_ids))
            return self.runner.prompt_logits(token_ids)
