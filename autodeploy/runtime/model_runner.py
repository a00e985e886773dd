"""``ModelRunner``: how the forward of one engine step runs, behind one interface chosen at set-up.

The engine plans a step (chunks of sequences) and asks its runner to ``stage`` it: the runner fills the
graph's inputs from the chunks and the block pool's tables and returns ``(run, completing)``; ``run()``
computes the logits rows of the ``completing`` chunks. Staging and running are apart so that the engine
stages under its lock and runs outside it. The four ways to run a step (eager, decode CUDA graphs, piecewise
prefill graphs, the pipeline schedule) are three runners (``make_model_runner`` picks one):

- ``ModelRunner``: eager, each step one call of the graph.
- ``CapturedRunner``: decode steps replay CUDA graphs captured per batch size (``cuda_graphs.py``) and
  prefill and mixed steps run piecewise graphs per token bucket (``piecewise_graphs.py``), either or
  both as the compile stage declared; the steps they do not hold run eagerly.
- ``PipelineRunner``: this rank's pipeline stage, the step's chunks in micro-batches (``pipeline_schedule.py``).

``set_up`` sizes the KV pool (on a GPU a warm-up forward at the token budget shows the activations'
peak; over several ranks every pool takes the smallest size), allocates the caches and captures the
graphs. The deployment's graphs come by role: ``{"model": graph}`` runs the steps; a role this runtime
does not run yet (a ``"vision"`` or ``"encoder"`` graph) is refused (a draft model is a deployment of its own,
``Deployment.draft``, run by ``runtime/draft_model.py``). The side inputs that
requests carry (``TokenRows``) fill the inputs the graph declares for them (``step_inputs.SideInputSpec``).

    runner = make_model_runner(deployment)
    runner.set_up()
    run, completing = runner.stage(chunks)
    logits = run()
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autodeploy.custom_ops.parallel_state import Layout
from autodeploy.deployment import ENCODER, MODEL, VISION, Deployment
from autodeploy.errors import InvalidRequestError, UnsupportedModelError
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.compiled_graph import TORCH_COMPILE_BACKENDS, CompiledGraph
from autodeploy.runtime.cuda_graphs import DecodeGraphs
from autodeploy.runtime.encoder_pass import EncoderPass
from autodeploy.runtime.kv_cache import allocate_kv_caches, move_kv_entries, plan_num_blocks
from autodeploy.runtime.piecewise_graphs import NotSplittable, PiecewiseGraphs
from autodeploy.runtime.pipeline_schedule import PipelineSchedule
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.device_copies import to_device
from autodeploy.runtime.step_inputs import PendingTokens, build_step_inputs, carries_side_rows, declared_side_inputs, slot
from autodeploy.runtime.verify_graphs import VerifyGraphs

logger = logging.getLogger(__name__)

RUN_ROLES = (MODEL, VISION, ENCODER)  # the graph roles an engine runs (vision: its VisionEncoder; encoder: EncoderPass)
StagedStep = tuple[Callable[[], torch.Tensor], list[int]]  # (run, completing)

# Enough tokens for a forward to show whether the model computes finite logits at all.
_LOGITS_CHECK_TOKENS = 16


def make_model_runner(deployment: Deployment) -> ModelRunner:
    """The runner for this deployment's settings and signature: pipeline stages, captured graphs, or eager."""
    schedule = PipelineSchedule.from_settings(deployment.settings)  # pipeline_parallel > 1 (nothing is captured then)
    if schedule is not None:
        return PipelineRunner(deployment, schedule)
    signature = deployment.signature
    if signature.decode_graph_batch_sizes or signature.prefill_graph_token_sizes:
        return CapturedRunner(deployment)
    return ModelRunner(deployment)


class ModelRunner:
    """Eager: each step is one call of the ``"model"`` graph on inputs built for it."""

    def __init__(self, deployment: Deployment):
        not_run = sorted(set(deployment.graphs) - set(RUN_ROLES))
        if not_run:
            raise UnsupportedModelError(f"the deployment holds graphs {sorted(deployment.graphs)}; this runtime runs its "
                                        f"{MODEL!r} graph and no {not_run} graph yet")
        settings = deployment.settings
        compiled = settings.compile.backend in TORCH_COMPILE_BACKENDS
        self.graphs: dict[str, Callable] = {role: CompiledGraph(g) if compiled else g for role, g in deployment.graphs.items()}
        self.graph_inputs = deployment.signature.inputs
        self.side_inputs = declared_side_inputs(deployment.graph, self.graph_inputs)
        self.kv_specs = deployment.signature.kv_caches
        self.settings = settings
        self.vocab_size = deployment.vocab_size
        self.device = torch.device(settings.device)
        self.max_seq_len = settings.max_seq_len
        self.max_num_tokens = settings.scheduler.max_num_tokens
        self.block_size = settings.kv_cache.block_size
        self.pool: KVBlockPool | None = None  # set_up makes the pool and its caches
        self.caches: dict[str, torch.Tensor] = {}
        # An encoder–decoder's encoder graph and cross-KV pool (set_up allocates it before sizing the pool)
        self.cross_specs = deployment.signature.cross_kv_caches
        self.encoder: EncoderPass | None = None
        self.staged_width: int | None = None  # how the staged step lays its chunks out: None in turn, w: chunk i at row i·w

    @property
    def graph(self) -> Callable:
        """The graph that runs the steps (read at every step: tests and benchmarks wrap it)."""
        return self.graphs[MODEL]

    @graph.setter
    def graph(self, graph: Callable) -> None:
        self.graphs[MODEL] = graph

    def set_up(self, check_logits: bool = True) -> dict[str, float]:
        """Size the KV pool and allocate its caches; the seconds each phase took. ``check_logits``: a warm-up
        forward must give finite logits (build-time verification turns it off for the twin it checks itself)."""
        phases = _Phases()
        self._set_up_pool(check_logits, phases)
        return phases

    def stage(self, chunks: list[ScheduledChunk], logits_for_all_tokens: bool = False,
              pending: PendingTokens | None = None) -> StagedStep:
        """Fill the step's inputs from the pool's tables; ``run()`` computes the logits."""
        inputs, completing = self._step_inputs(chunks, logits_for_all_tokens, pending)
        self.staged_width = None
        return (lambda: self.graph(*inputs)[0]), completing

    def staged_rows(self, chunks: list[ScheduledChunk]) -> list[int]:
        """The first token row of each of the staged step's ``chunks`` in the graph's rows (its hidden states')."""
        if self.staged_width is not None:
            return [index * self.staged_width for index in range(len(chunks))]
        rows, row = [], 0
        for chunk in chunks:
            rows.append(row)
            row += chunk.length
        return rows

    def kv_slots(self, seq_id: int, positions: list[int]) -> list[int]:
        """The flat cache slots of sequence ``seq_id``'s ``positions``."""
        table, size = self.pool.block_table(seq_id), self.block_size
        return [slot(table, p, size) for p in positions]

    def move_kv(self, sources: list[int], targets: list[int]) -> None:
        """Copy the KV entries at flat slots ``sources`` to slots ``targets`` in every layer (the accepted paths of a
        step's tree drafts, ``runtime/speculative.py``), queued on the device: two kernels a cache."""
        move_kv_entries(self.caches, to_device(sources, torch.long, self.device), to_device(targets, torch.long, self.device))

    def forward(self, chunks: list[ScheduledChunk], logits_for_all_tokens: bool = False) -> tuple[torch.Tensor, list[int]]:
        """One forward over ``chunks``: the logits ``[rows, vocab]`` and the chunks they belong to."""
        run, completing = self.stage(chunks, logits_for_all_tokens)
        return run(), completing

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` of every position, on blocks borrowed from the pool for the call."""
        probe = _Probe(list(token_ids))
        try:
            if not self.pool.reserve(probe.seq_id, len(token_ids)):
                raise InvalidRequestError(f"{len(token_ids)} tokens do not fit in the free KV blocks now; try again when idle")
            return self.forward([ScheduledChunk(probe, 0, len(token_ids))], logits_for_all_tokens=True)[0]
        finally:
            self.pool.free(probe.seq_id)

    def _step_inputs(self, chunks: list[ScheduledChunk], logits_for_all_tokens: bool, pending: PendingTokens | None):
        return build_step_inputs(self.graph_inputs, chunks, self.pool, self.caches, self.device,
                                 logits_for_all_tokens=logits_for_all_tokens, pending=pending,
                                 side_inputs=list(self.side_inputs.values()))

    def _set_up_pool(self, check_logits: bool, phases: _Phases, graph_tokens: int = 0, pad_block: bool = False) -> None:
        """Warm up and size the pool (``graph_tokens``: the largest decode graph's batch, whose activations
        the graphs keep); with ``pad_block``, one cache block more than the pool hands out."""
        settings = self.settings
        warmed_up = []

        def warm_up(num_tokens: int) -> None:
            self._warm_up(min(num_tokens, self.max_num_tokens, self.max_seq_len))
            warmed_up.append(True)

        if self.cross_specs and self.encoder is None:  # before sizing: what it takes is not the pool's
            graphed = settings.compile.backend in ("cuda_graph", "torch_compile_cuda_graph")
            self.encoder = EncoderPass(self.graphs[ENCODER], self.cross_specs, settings.max_batch_size, self.max_seq_len,
                                       self.block_size, self.device, settings.compile.encoder_graphs if graphed else 0)
        num_blocks = plan_num_blocks(self.kv_specs, settings.kv_cache, settings.max_batch_size, self.max_seq_len,
                                     self.device, warm_up, graph_tokens=graph_tokens)
        num_blocks = _agreed_num_blocks(num_blocks, self.device, Layout.requested(settings.distributed).world_size)
        if not warmed_up and check_logits:  # only GPU pool sizing needs the full budget; every device checks the logits
            self._warm_up(min(_LOGITS_CHECK_TOKENS, self.max_num_tokens, self.max_seq_len))
        phases.done("warm-up")
        self.caches = allocate_kv_caches(self.kv_specs, num_blocks + pad_block, self.block_size, self.device)
        if self.encoder is not None:
            self.caches.update(self.encoder.caches)
        self.pool = KVBlockPool(num_blocks, self.block_size, settings.kv_cache.prefix_caching)
        phases.done("KV pool")

    def _probe_inputs(self, num_tokens: int) -> tuple[list[torch.Tensor], dict]:
        """The graph's inputs for one prompt of ``num_tokens`` tokens on a throwaway cache (and that cache)."""
        scratch = KVBlockPool(-(-num_tokens // self.block_size), self.block_size, enable_prefix_caching=False)
        caches = allocate_kv_caches(self.kv_specs, scratch.num_blocks, self.block_size, self.device)
        caches.update(allocate_kv_caches(self.cross_specs, 1, self.block_size, self.device))  # read by nothing: no cross length
        probe = _Probe([i % self.vocab_size for i in range(num_tokens)])
        scratch.reserve(probe.seq_id, num_tokens)
        inputs, _ = build_step_inputs(self.graph_inputs, [ScheduledChunk(probe, 0, num_tokens)], scratch, caches, self.device,
                                      side_inputs=list(self.side_inputs.values()))
        return inputs, caches

    def _warm_up(self, num_tokens: int) -> None:
        """One forward of ``num_tokens`` tokens on a throwaway cache. Its peak memory sizes the GPU pool;
        its logits must be finite, or the model would only ever generate garbage."""
        with torch.inference_mode():
            inputs, caches = self._probe_inputs(num_tokens)
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


class CapturedRunner(ModelRunner):
    """Decode steps replay CUDA graphs (at the signature's ``decode_graph_batch_sizes``), prefill and mixed steps
    run piecewise graphs (at its ``prefill_graph_token_sizes``); what they do not hold, and what fails to
    capture, runs eagerly."""

    def __init__(self, deployment: Deployment):
        super().__init__(deployment)
        self.decode_sizes = sorted(set(deployment.signature.decode_graph_batch_sizes))
        self.prefill_sizes = deployment.signature.prefill_graph_token_sizes
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PiecewiseGraphs | None = None
        # Speculative decoding: verification steps of num_tokens + 1 tokens a sequence, captured at the decode
        # sizes whose tokens fit the step's budget.
        speculative = deployment.settings.speculative
        self.verify_tokens = speculative.num_tokens * speculative.tree_width if speculative.method else 0
        self.verify_sizes = [size for size in self.decode_sizes if size * (self.verify_tokens + 1) <= self.max_num_tokens] \
            if self.verify_tokens else []
        self.verify_graphs: VerifyGraphs | None = None

    def set_up(self, check_logits: bool = True) -> dict[str, float]:
        """Capture the prefill graphs (before the pool is sized: their memory is gone by then), size the
        pool (the decode graphs' padding rows write into one block more), then capture the decode graphs."""
        phases = _Phases()
        self.prefill_graphs = self._capture_prefill_graphs() if self.prefill_sizes else None
        phases.done("prefill graphs")
        graph_tokens = max(self.decode_sizes[-1] if self.decode_sizes else 0,  # the graphs' activations stay
                           self.verify_sizes[-1] * (self.verify_tokens + 1) if self.verify_sizes else 0)
        self._set_up_pool(check_logits, phases, graph_tokens=graph_tokens, pad_block=bool(self.decode_sizes))
        self.decode_graphs = self._capture_decode_graphs() if self.decode_sizes else None
        phases.done("decode graphs")
        if self.verify_sizes:
            self.verify_graphs = self._capture_verify_graphs()
            phases.done("verification graphs")
        return phases

    def stage(self, chunks: list[ScheduledChunk], logits_for_all_tokens: bool = False,
              pending: PendingTokens | None = None) -> StagedStep:
        """A decode step a captured graph holds replays it; a step a prefill bucket holds runs the pieces."""
        # Captured steps hold side inputs without rows: a step computing a position that carries one runs otherwise.
        plain = not self.side_inputs or not carries_side_rows(chunks, list(self.side_inputs.values()))
        if plain and self.decode_graphs is not None and self.decode_graphs.serves(chunks, logits_for_all_tokens):
            size = self.decode_graphs.stage(chunks, self.pool.block_table, pending)
            self.staged_width = 1
            completing = [] if logits_for_all_tokens else list(range(len(chunks)))
            return (lambda: self.decode_graphs.replay(size, len(chunks))), completing
        if plain and self.verify_graphs is not None and not logits_for_all_tokens and self.verify_graphs.serves(chunks):
            size, keep = self.verify_graphs.stage(chunks, self.pool.block_table, pending)
            self.staged_width = self.verify_graphs.width
            return (lambda: self.verify_graphs.replay(size, keep)), list(range(len(chunks)))
        inputs, completing = self._step_inputs(chunks, logits_for_all_tokens, pending)
        self.staged_width = None
        num_tokens = sum(chunk.length for chunk in chunks)
        if self.prefill_graphs is not None and self.prefill_graphs.serves(num_tokens):
            return (lambda: self.prefill_graphs.run(inputs, num_tokens)), completing
        return (lambda: self.graph(*inputs)[0]), completing

    def _capture_prefill_graphs(self) -> PiecewiseGraphs | None:
        try:
            graphs = PiecewiseGraphs(self.graph, self.graph_inputs, self.prefill_sizes, self.device)
        except NotSplittable as reason:
            logger.warning("prefill steps run eagerly: the graph cannot be split into captured pieces (%s)", reason)
            return None
        try:
            with torch.inference_mode():
                graphs.capture_all(lambda num_tokens: self._probe_inputs(num_tokens)[0])
        except Exception as error:  # a kernel the compile stage could not vet: slower, never wrong
            logger.warning("prefill CUDA graph capture failed (%s: %s); prefill steps run eagerly", type(error).__name__, error)
            return None
        return graphs

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        graphs = DecodeGraphs(self.graph, self.graph_inputs, self.caches, self.decode_sizes, self.block_size,
                              self.max_seq_len, pad_block=self.pool.num_blocks, device=self.device,
                              side_inputs=list(self.side_inputs.values()))
        try:
            with torch.inference_mode():
                graphs.capture_all()
        except Exception as error:  # a kernel the compile stage could not vet: slower, never wrong
            logger.warning("decode CUDA graph capture failed (%s: %s); decode steps run eagerly", type(error).__name__, error)
            return None
        return graphs


    def _capture_verify_graphs(self) -> VerifyGraphs | None:
        graphs = VerifyGraphs(self.graph, self.graph_inputs, self.caches, self.verify_sizes, self.verify_tokens,
                              self.block_size, self.max_seq_len, pad_block=self.pool.num_blocks, device=self.device,
                              side_inputs=list(self.side_inputs.values()))
        try:
            with torch.inference_mode():
                graphs.capture_all()
                if graphs.capture:
                    self._check_verify_graphs(graphs)
        except Exception as error:  # slower, never wrong: verification steps run as prefill steps do
            logger.warning("verification CUDA graph capture failed (%s: %s); verification steps run piecewise or "
                           "eagerly", type(error).__name__, error)
            return None
        return graphs

    def _check_verify_graphs(self, graphs: VerifyGraphs) -> None:
        """Replay a real verification step of the smallest size (each probe's newest token and K drafted ones, on
        blocks of the pool) against eager; ``RuntimeError`` when they differ."""
        probes = [_Probe([i % self.vocab_size]) for i in range(graphs.sizes[0])]
        try:
            chunks = []
            for probe in probes:
                if not self.pool.reserve(probe.seq_id, graphs.width):
                    raise RuntimeError("no free KV blocks to check the verification graphs on")
                chunks.append(ScheduledChunk(probe, 0, graphs.width,
                                             draft=[(probe.seq_id + j) % self.vocab_size for j in range(1, graphs.width)]))
            graphs.check(chunks, self.pool.block_table)
        finally:
            for probe in probes:
                self.pool.free(probe.seq_id)


class PipelineRunner(ModelRunner):
    """This rank's pipeline stage: each step's chunks in micro-batches through ``schedule`` (no CUDA graphs)."""

    def __init__(self, deployment: Deployment, schedule: PipelineSchedule):
        super().__init__(deployment)
        self.schedule = schedule

    def stage(self, chunks: list[ScheduledChunk], logits_for_all_tokens: bool = False,
              pending: PendingTokens | None = None) -> StagedStep:
        return self.schedule.stage_step(self.graph, self.graph_inputs, chunks, self.pool, self.caches, self.device,
                                        logits_for_all_tokens, pending, side_inputs=list(self.side_inputs.values()))


def _agreed_num_blocks(num_blocks: int, device: torch.device, ranks: int) -> int:
    """The fewest KV blocks any of the deployment's ``ranks`` can hold: every rank plans the same steps, so
    every pool has one size. One rank agrees with nobody, even where this process's group is another
    deployment's (a one-process deployment beside a distributed one)."""
    if ranks == 1 or not (dist.is_available() and dist.is_initialized()):
        return num_blocks
    fewest = torch.tensor([num_blocks], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    return int(fewest.item())


class _Phases(dict):
    """Seconds per named phase of a set-up, each phase ending where ``done`` is called."""

    def __init__(self):
        super().__init__()
        self._began = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self[name] = self.get(name, 0.0) + now - self._began
        self._began = now


class _Probe:
    """A stand-in sequence for forwards outside the scheduler (warm-up, ``prompt_logits``): no request, so
    no side inputs."""

    _ids = itertools.count(-1, -1)
    request = None

    def __init__(self, token_ids: list[int]):
        self.seq_id = next(self._ids)
        self.token_ids = token_ids
        self.num_tokens = len(token_ids)
