"""Speculative decoding: a drafter proposes tokens, the model checks them all in the step's one forward.

A ``Drafter`` proposes, for sequences about to decode one token, up to ``k`` further tokens each. The engine's
``Speculator`` turns those decode chunks of a planned step into verification chunks (the sequence's newest
token, then its draft), with KV blocks reserved for every token; the forward computes one logits row per
token. Each row is sampled exactly as the sequence would have sampled that position without speculation — the
same seeded counter (the output position), penalties counting the draft tokens before it, the grammar's mask
after them — and ``accepted_prefix`` keeps the draft's longest prefix equal to the tokens sampled, then the
first sampled token that differs (or the one after the whole draft). The KV entries of the rejected tokens are
dropped (the sequence's computed count goes back, and ``KVBlockPool.truncate`` frees whole blocks past it).

Why the output is the model's, exactly: a draft token ``d`` at a position is kept when the token the model
samples there is ``d``; with probability ``p(d)`` that is so, and otherwise the sampled token, drawn from ``p``
given that it is not ``d``, ends the step. That is rejection sampling against a draft distribution that puts
all its mass on ``d`` (accept with ``min(1, p(d)/q(d)) = p(d)``, else draw from ``(p - q)⁺``). So greedy
decoding is token-identical with and without speculation, and a seeded request draws the same tokens either way.

**Trees.** A drafter may return a ``DraftTree`` instead of a list: several candidates at a position, each node
following its parent. The chunk then carries every node after the newest token (``ScheduledChunk.draft_parents``),
each at the position of its depth and seeing only its ancestors (``cached_attention``'s ``tree_mask``); each row
is sampled as its position would be after its path. ``accepted_path`` walks from the newest token to the child
whose token the model sampled, as long as there is one, so the output is again exactly the model's; the accepted
nodes' KV entries then move to the positions they now hold (``Speculator.relocate``, one copy a step). A chain is the tree whose
every node has one child. Sequences with a grammar or penalties verify only the tree's main chain.

Drafters are registered by name (``register_drafter``); ``speculative.method`` picks one. Built in: ``ngram``
(prompt lookup, this module) and ``draft`` (a smaller model, ``runtime/draft_model.py``).

    @register_drafter("repeat_last")
    def repeat_last(deployment, settings):
        return lambda sequences, limits: [[s.token_ids[-1]] * k for s, k in zip(sequences, limits)]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from autodeploy.errors import ConfigError
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.device_copies import HostCopy
from autodeploy.runtime.draft_trees import DraftTree, tree_depths
from autodeploy.runtime.sampler import has_penalty
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.speculation_costs import (MARGIN, DraftingTimes, ObservedSteps, StepCosts, StepTally, best_num_tokens,
                                                  breakeven_acceptance)
from autodeploy.runtime.structured_output import next_token_bitmask

logger = logging.getLogger(__name__)


class Drafter(Protocol):
    """Proposes tokens to verify: ``drafter(sequences, limits)`` returns, for each sequence, at most ``limits[i]``
    token ids to follow its ``token_ids`` (fewer, or none, when it has no good guess), or a ``DraftTree`` at most
    ``limits[i]`` deep. It runs on the engine's
    thread between steps, so it should be quick; it never changes the sequences."""

    def __call__(self, sequences: list, limits: list[int]) -> list[list[int]]: ...


# A drafter that reads the model's hidden states (EAGLE-3, MTP) names the layers it needs, ``(settings,
# num_layers) -> [layer, ...]`` (``settings``: the deployment's; layer ``i`` < num_layers: the residual stream
# entering it; ``num_layers``: the final norm's output, what the LM head reads);
# ``transforms/expose_hidden_states.py`` makes the graph copy them out, and the engine hands each step's rows to
# the drafter's ``observe(chunks, rows, hidden)``.
HiddenStateLayers = Callable[[Any, int], list[int]]
HIDDEN_STATES = "speculative_hidden_states"  # the graph's buffer of them ``[max_num_tokens, layers · H]`` (hidden_state_buffer)
HIDDEN_STATE_LAYERS = "speculative_hidden_state_layers"  # graph.meta: (layers, the model's layers, H)
_HIDDEN_STATE_LAYERS: dict[str, HiddenStateLayers] = {}


_PRIOR_WEIGHT = 1  # judged tokens' worth of weight the overall acceptance has in a sequence's estimate
# A sequence that has not drafted for PROBE decode steps is expected to keep what the drafter keeps overall, its own
# record forgotten: a sequence whose early drafts failed would otherwise never draft again, though acceptance comes in
# runs (the same trap as a slow first call, below, one sequence at a time).
PROBE = 8
# The acceptance taken before the drafter has verified EXPLORED tokens: hopeful, so that where drafting can pay at
# all it is tried and the drafter's real rate learnt (a pessimistic start never drafts, so never learns).
_FIRST_ACCEPTANCE, EXPLORED = 0.8, 100
# After REVISIT steps in a row that ``auto`` chose not to draft, it drafts two steps anyway (as many tokens as the
# forward's costs alone would pay for) and takes what those cost as its new estimates of drafting's own time and a
# drafting step's overhead: one slow first call (a kernel compiled, a graph captured) must not turn drafting off
# for good, since a state that never drafts never measures drafting again.
# A revisit that finds drafting still losing doubles the wait for the next, up to _REVISIT_MAX steps. Measured (H100,
# the trained pair at batch 1, REVISIT 64 up to 1024): 31 revisits and the drafting steps they led to cost 2.5 % of a
# run where drafting lost; from 256 up to 4096 that is under 1 %.
REVISIT, _REVISIT_STEPS, _REVISIT_MAX = 256, 2, 4096
# A step of decodes alone that drafts nothing still hands the drafter its hidden states unless, at its batch size, not
# even this per-token acceptance would make a draft pay (re-read every _HOPELESS_EVERY such steps). Skipping them
# where drafting could pay left the head a gap at every revisit: it drafted from one position, was refused, and auto
# concluded that drafting lost (H100, 512 requests: 17 rows drafted at batch 1, 1 token accepted).
HOPELESS, _HOPELESS_EVERY = 0.8, 64

DrafterFactory = Callable[[Any, Any], Drafter]  # (deployment, speculative settings) -> Drafter
_DRAFTERS: dict[str, DrafterFactory] = {}


def register_drafter(name: str, hidden_states: HiddenStateLayers | None = None) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register ``factory(deployment, settings) -> Drafter`` as ``speculative.method: <name>`` (``settings`` is the
    ``speculative`` section; a drafter's own options are in ``settings.options``). ``hidden_states``: the layers
    whose hidden states the drafter reads (see ``HiddenStateLayers``); its drafter then has an ``observe``."""

    def register(factory: DrafterFactory) -> DrafterFactory:
        if name in _DRAFTERS and _DRAFTERS[name] is not factory:
            raise ConfigError(f"a drafter named {name!r} is already registered; pick another name")
        _DRAFTERS[name] = factory
        if hidden_states is not None:
            _HIDDEN_STATE_LAYERS[name] = hidden_states
        return factory

    return register


def hidden_state_buffer(graph) -> torch.Tensor | None:
    """The buffer a graph's ``save_hidden_states`` ops write the step's hidden states into (found from the ops, as a
    saved and reloaded graph names its attributes anew), or None."""
    target = torch.ops.autodeploy.save_hidden_states.default
    for node in getattr(getattr(graph, "graph", None), "nodes", ()):
        if node.op == "call_function" and node.target == target and node.args[1].op == "get_attr":
            value = graph
            for part in node.args[1].target.split("."):
                value = getattr(value, part)
            return value
    return None


def hidden_state_layers(settings, num_layers: int) -> list[int]:
    """The layers whose hidden states the drafter ``settings.speculative.method`` reads ([] for one that reads none)."""
    method = settings.speculative.method
    layers = _HIDDEN_STATE_LAYERS.get(method) if method else None
    return list(layers(settings, num_layers)) if layers is not None else []


def registered_drafters() -> list[str]:
    return sorted(_DRAFTERS)


def make_drafter(deployment, settings) -> Drafter:
    """The drafter ``settings.method`` names, made for ``deployment``; a ``ConfigError`` naming the registered ones."""
    factory = _DRAFTERS.get(settings.method)
    if factory is None:
        raise ConfigError(f"speculative.method is {settings.method!r}; the registered drafters are "
                          f"{', '.join(registered_drafters())} (register your own with register_drafter)")
    return factory(deployment, settings)


@dataclass
class SpeculationStats:
    """What speculation did so far: verification rows, drafted and accepted tokens, accepted tokens by position."""

    steps: int = 0  # sequence-steps that carried a draft
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # sequence-steps whose draft the model cut (a token not accepted)
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: drafts whose token i was accepted
    drafted_at: list[int] = field(default_factory=list)  # drafted_at[i]: drafts at least i + 1 tokens long

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_token_acceptance(self) -> float:
        """The chance that the model accepts a drafted token once it accepted those before it: accepted tokens ÷ the
        tokens the model decided on (the accepted and each draft's first refused one; the tokens after that one are
        never judged). Accepted ÷ drafted counts those as refusals, and so underrates a long draft's worth: with
        K = 4 and 80% a token, a draft keeps 2.4 of 4 tokens on average, 60% of them."""
        decided = self.accepted + self.rejected
        return self.accepted / decided if decided else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens a verification step produced per sequence on average: the accepted drafts plus the model's own."""
        return 1 + self.accepted / self.steps if self.steps else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += accepted < drafted
        for counts, upto in ((self.drafted_at, drafted), (self.accepted_at, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for i in range(upto):
                counts[i] += 1


def accepted_prefix(draft: list[int], sampled: list[int]) -> int:
    """How many leading draft tokens the model's own samples confirm (``sampled`` has one token per row: the
    draft's ``len(draft) + 1``)."""
    count = 0
    while count < len(draft) and sampled[count] == draft[count]:
        count += 1
    return count


class Speculator:
    """The engine's side of speculation: drafts for a step's decode chunks, and the statistics."""

    def __init__(self, drafter: Drafter, num_tokens: int, pool: KVBlockPool, vocab_size: int, method: str = "",
                 costs: StepCosts | None = None, runner=None):
        self.drafter = drafter
        self.runner = runner  # its kv_slots and move_kv move the kept nodes of tree drafts
        self._moves: tuple[list[int], list[int]] = ([], [])  # KV slots to copy from, to: the step's kept tree nodes
        self.num_tokens = num_tokens
        self.pool = pool
        self.vocab_size = vocab_size
        self.method = method
        self.costs = costs  # None: draft num_tokens every step; else as many as pay (speculation_costs.py)
        self.drafting_times = DraftingTimes()  # what the drafter's own calls cost, counted against its drafts
        self._idle_steps = 0  # steps of decodes in a row that auto chose not to draft
        self._revisit_left = 0  # steps left of a revisit (REVISIT), whose costs replace the estimates
        self._revisit_every = REVISIT  # idle steps before the next revisit
        self._revisiting = False  # whether the last planned step is one of them
        self.observed = ObservedSteps()  # what whole steps took as they ran (``step_took``)
        self.tally = StepTally()  # every step of decodes alone, by kind (the bench reports it)
        self._timing: tuple[int, int, float] | None = None  # the planned step's (batch, tokens drafted, drafting s/position)
        self._last_drafted: bool | None = None  # whether the step before drafted (None: not decodes alone)
        self._drafted = None  # the planned step's drafts left on the device: (tokens, their HostCopy); resolve
        self.drafting = False  # whether the last planned step chose to draft (its step then does not run ahead)
        self.stats = SpeculationStats()
        self._hopeless_at: dict[int, tuple[int, bool]] = {}  # batch → (step, whether no draft could pay there)
        self._observed_steps = 0  # steps of decodes alone that drafted nothing (``_hopeless`` counts them)
        self._warned_low_acceptance = False
        # How many draft tokens a verification keeps: the prefix the model's own samples confirm. Only the replay
        # benchmark (``bench/replay.py``) overrides it, to set the acceptance length of random weights.
        self.accept = getattr(drafter, "benchmark_acceptance", None) or accepted_prefix
        # A drafter that keeps something per block of a prefix (a hidden-state head's rows) keys it by the pool's.
        use_prefix_cache = getattr(drafter, "use_prefix_cache", None)
        if use_prefix_cache is not None:
            use_prefix_cache(pool)

    def extend(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """Give the decode chunks of a planned step their drafts, within ``budget`` more tokens and the blocks
        free (a draft that does not fit is cut; speculation never preempts). Chunks stay ordered prompt chunks
        first, single-token decodes last (what ``cached_attention`` wants). With step costs, as many tokens
        as pay for this step's decoding sequences, maybe none."""
        self._extend(chunks, budget)
        for chunk in chunks:
            if chunk.length == 1 and chunk.completes:  # a decode without a draft (Speculator.acceptance's probes)
                chunk.sequence.decodes_since_draft += 1

    def _extend(self, chunks: list[ScheduledChunk], budget: int) -> None:
        self._drafted = None
        decoding = [c for c in chunks if c.length == 1 and c.completes and c.sequence.request.beam_search is None]
        wanted, batch = self.num_tokens, len(decoding)
        per_position = self.drafting_times.per_position(batch)
        revisiting = False
        if self.costs is not None and decoding:
            acceptances = [self.acceptance(c.sequence) for c in decoding]
            wanted = best_num_tokens(self.costs, acceptances, self.num_tokens, per_position,
                                     self.observed.overhead_seconds(batch), self.observed.decoding_seconds(batch))
            if wanted:  # drafting pays by the estimates: the next revisit, if any, after REVISIT steps again
                self._idle_steps, self._revisit_every = 0, REVISIT
            else:
                self._idle_steps += 1
            if self._idle_steps >= self._revisit_every:  # each revisit that finds drafting still losing waits twice as long
                self._idle_steps, self._revisit_left = 0, _REVISIT_STEPS
                self._revisit_every = min(2 * self._revisit_every, _REVISIT_MAX)
            if not wanted and self._revisit_left:
                self._revisit_left -= 1
                wanted = best_num_tokens(self.costs, acceptances, self.num_tokens)
                revisiting = wanted > 0
        self.drafting = wanted > 0 and bool(decoding)
        self._revisiting = revisiting
        self._timing = (batch, wanted if self.drafting else 0, per_position) if decoding and batch == len(chunks) else None
        if not self.drafting or budget <= 0:
            return
        candidates = [c for c in decoding if self._may_draft(c)]
        if not candidates:
            return
        limits = [min(wanted, self._tokens_left(c.sequence)) for c in candidates]
        sequences = [c.sequence for c in candidates]
        # Drafts left on the device while the step is staged (the host reads them with its samples): a drafter that
        # can, for sequences whose draft the host need not see first (no grammar to cut it, no penalty to sample by).
        source = None
        on_device = getattr(self.drafter, "on_device", None)
        began = time.perf_counter()
        if on_device is not None and not any(s.grammar is not None or has_penalty(s.request.params) for s in sequences):
            source, drafts = on_device(sequences, limits)
            self._drafted = (source, HostCopy(source)) if source is not None else None
        else:
            drafts = self.drafter(sequences, limits)
        self.drafting_times.observe(len(candidates), max(limits), time.perf_counter() - began, replace=revisiting)
        if len(drafts) != len(candidates):
            raise RuntimeError(f"the {self.method!r} drafter returned {len(drafts)} drafts for {len(candidates)} sequences")
        for chunk, limit, draft in zip(candidates, limits, drafts):
            parents = None
            if isinstance(draft, DraftTree):
                draft, parents = self._tree(chunk.sequence, draft, limit, budget)
            draft = [int(t) for t in draft[: min(limit, budget)]] if parents is None else draft
            if source is None and any(not 0 <= t < self.vocab_size for t in draft):
                raise RuntimeError(f"the {self.method!r} drafter proposed a token outside the vocabulary "
                                   f"(0 … {self.vocab_size - 1}): {draft}")
            masks = None
            if chunk.sequence.grammar is not None:
                draft, masks = _grammar_cut(chunk.sequence.grammar, draft, self.vocab_size)
            if not draft or not self.pool.reserve(chunk.sequence.seq_id, chunk.start + 1 + len(draft)):
                continue
            chunk.draft, chunk.draft_bitmasks, chunk.draft_parents = draft, masks, parents
            if source is not None:  # draft holds the tokens' indices in source: placeholders until resolve
                chunk.draft, chunk.draft_rows, chunk.draft_source = [0] * len(draft), draft, source
            chunk.length = 1 + len(draft)
            budget -= len(draft)
            if budget <= 0:
                break
        chunks.sort(key=lambda chunk: chunk.length == 1)

    def _tree(self, sequence, tree: DraftTree, depth: int, budget: int) -> tuple[list[int], list[int] | None]:
        """A drafted tree as the chunk carries it: its nodes down to ``depth``, as (tokens, parents); its main chain
        alone (parents None) where only a chain may be verified (a grammar, penalties) or the tree is a chain or
        does not fit ``budget``."""
        tree.check(self.method)
        keep = [d <= depth for d in tree_depths(tree.parents)]
        index = {-1: -1}
        tokens, parents = [], []
        for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            if keep[node] and parent in index:
                index[node] = len(tokens)
                tokens.append(int(token))
                parents.append(index[parent])
        chain_only = sequence.grammar is not None or has_penalty(sequence.request.params) or len(tokens) > budget
        if chain_only or parents == list(range(-1, len(parents) - 1)):
            return DraftTree(tokens, parents).main_chain(), None
        return tokens, parents

    def resolve(self, chunks: list[ScheduledChunk]) -> None:
        """Put the tokens of drafts left on the device into their chunks' ``draft`` (in place: the sampling plan holds
        those lists), once the step's samples are back (so is their copy to the host)."""
        drafted, self._drafted = self._drafted, None
        if drafted is None:
            return
        source, copy = drafted
        tokens = copy.wait().tolist()
        for chunk in chunks:
            if chunk.draft_source is source:
                chunk.draft[:] = [tokens[i] for i in chunk.draft_rows]
                chunk.draft_rows = chunk.draft_source = None

    def step_took(self, seconds: float) -> None:
        """The engine's step that launched the last planned one took ``seconds`` of wall time (overlapped, a decoding
        step's call applies the step before it: in a run of them, one step's cost). Counted when that step and the
        one before were decodes alone, both drafting or both not, so what ``auto`` weighs is what steps cost."""
        timing, self._timing = self._timing, None
        drafted = None if timing is None else timing[1] > 0
        last, self._last_drafted = self._last_drafted, drafted
        if timing is not None:
            self.tally.add(timing[0], "revisit" if self._revisiting else "drafting" if drafted else "decoding", seconds)
        if self.costs is None or timing is None or drafted != last:
            return
        batch, k, per_position = timing
        self.observed.observe(batch, drafted, seconds, self.costs.seconds(batch, k) + per_position * k,
                              replace=self._revisiting)

    def relocate(self, sequence, start: int, path: list[int]) -> None:
        """A tree verified at ``start`` (the position of the sequence's newest token) kept the nodes ``path``: their
        KV entries are to move to the positions they now hold (``flush_moves``, once for the step), and a drafter
        with an ``accepted`` method hears which."""
        moves = [(start + 1 + node, start + 1 + depth) for depth, node in enumerate(path) if node != depth]
        if moves and self.runner is not None:  # slots now: the blocks past the kept tokens are freed next
            self._moves[0].extend(self.runner.kv_slots(sequence.seq_id, [a for a, _ in moves]))
            self._moves[1].extend(self.runner.kv_slots(sequence.seq_id, [b for _, b in moves]))
        accepted = getattr(self.drafter, "accepted", None)
        if accepted is not None:
            accepted(sequence, start, path)

    def flush_moves(self) -> None:
        """Copy the step's kept tree nodes' KV entries into place (before any forward can reuse a freed block)."""
        sources, targets = self._moves
        if sources:
            self._moves = ([], [])
            self.runner.move_kv(sources, targets)

    def observe(self, chunks: list[ScheduledChunk], rows: list[int], hidden: torch.Tensor) -> None:
        """A forward over ``chunks`` was queued; chunk ``i``'s tokens are rows ``rows[i]…`` of ``hidden`` (the
        hidden states the drafter asked for). The drafter takes its copy now, before the next forward overwrites
        them. With ``auto``, a step of decodes alone that drafts nothing is still handed over wherever drafting could
        pay at its batch size: a head that missed those positions would draft the next time from a gap, be refused,
        and ``auto`` would read that as drafting losing — and never draft again. Only where not even an acceptance of
        ``HOPELESS`` would pay (large batches) is the step skipped: keeping every sequence's row costs there what
        speculation is off to save, and a sequence that drafts again later starts from the positions seen since."""
        if (self.costs is not None and not self.drafting and all(chunk.length == 1 for chunk in chunks)
                and self._hopeless(len(chunks))):
            return
        self.drafter.observe(chunks, rows, hidden)

    def _hopeless(self, batch: int) -> bool:
        """Whether no draft could pay at ``batch`` (``threshold_as_run`` above ``HOPELESS``), as of the last
        ``_HOPELESS_EVERY`` steps (the estimates it reads move slowly)."""
        self._observed_steps += 1
        step, hopeless = self._hopeless_at.get(batch, (-_HOPELESS_EVERY, False))
        if self._observed_steps - step >= _HOPELESS_EVERY:
            threshold = self.threshold_as_run(batch)
            hopeless = threshold is None or threshold > HOPELESS
            self._hopeless_at[batch] = (self._observed_steps, hopeless)
        return hopeless

    def record(self, drafted: int, accepted: int) -> None:
        self.stats.record(drafted, accepted)
        stats = self.stats
        if not self._warned_low_acceptance and stats.drafted >= 1000 and stats.acceptance_rate < 0.02:
            self._warned_low_acceptance = True
            logger.warning("the %r drafter's tokens are almost never accepted (%d of %d): speculation only costs time "
                           "here; check the drafter (a draft model with another tokenizer or broken weights?) or turn "
                           "speculative.method off", self.method, stats.accepted, stats.drafted)

    def describe(self) -> str:
        """The drafter, when it drafts (the costs' thresholds) and what it achieved, by position."""
        lines = [f"speculative decoding: {self.method!r}, up to {self.num_tokens} tokens a step"]
        if self.costs is None:
            lines.append("  auto off: every step drafts")
        else:
            for batch in self.costs.batch_sizes:
                threshold = self.costs.threshold(batch)
                lines.append(f"  batch {batch}: a whole draft pays from a per-token acceptance of "
                             f"{'(never)' if threshold is None else f'{threshold:.2f}'} (the forwards timed at set-up)")
            observed = self.observed
            for bucket in sorted(set(observed.decoding) | set(observed.overhead)):
                decoding, overhead = observed.decoding.get(bucket), observed.overhead.get(bucket)
                lines.append(f"  batch ≤{bucket} as run: decoding step "
                             f"{'-' if decoding is None else f'{1e3 * decoding:.2f} ms'}, a drafting step's host work "
                             f"{'-' if overhead is None else f'{1e3 * overhead:.2f} ms'} more than its forward and drafting")
        if hasattr(self.drafter, "describe"):
            lines.append(self.drafter.describe())
        stats = self.stats
        lines.append(f"  verified {stats.drafted} drafted tokens in {stats.steps} rows: {stats.accepted} accepted "
                     f"({100 * stats.acceptance_rate:.0f}%; {100 * stats.per_token_acceptance:.0f}% of the tokens judged), "
                     f"{stats.acceptance_length:.2f} tokens per row")
        if stats.drafted_at:
            lines.append("  accepted by position: " + ", ".join(
                f"{i + 1}: {100 * a / d:.0f}%" for i, (a, d) in enumerate(zip(stats.accepted_at, stats.drafted_at))))
        return "\n".join(lines)

    def threshold_as_run(self, batch: int) -> float | None:
        """The per-token acceptance from which ``auto`` drafts a whole draft at ``batch``, with the steps as they ran:
        the verification forward timed at set-up plus the drafter's observed time and a drafting step's observed host
        work, against a decoding step as it ran (the set-up's forward until one has). None: never (or ``auto`` off)."""
        costs, k = self.costs, self.num_tokens
        if costs is None:
            return None
        observed = self.observed
        drafting = costs.seconds(batch, k) + self.drafting_times.per_position(batch) * k + observed.overhead_seconds(batch)
        return breakeven_acceptance(MARGIN * drafting / (observed.decoding_seconds(batch) or costs.seconds(batch, 0)), k)

    def acceptance(self, sequence) -> float:
        """The per-token acceptance to expect of ``sequence``'s next draft (``SpeculationStats.per_token_acceptance``,
        what ``best_num_tokens``' geometric model takes): its own over its last few drafts (``RECENCY``), pulled toward
        the drafter's overall one (a hopeful 0.8 until it has verified ``EXPLORED`` tokens) while that is little; the
        overall one alone once it has not drafted for ``PROBE`` steps."""
        stats = self.stats
        overall = stats.per_token_acceptance if stats.drafted >= EXPLORED else _FIRST_ACCEPTANCE
        if sequence.decodes_since_draft >= PROBE:
            return overall
        return (sequence.recent_accepted + _PRIOR_WEIGHT * overall) / (sequence.recent_judged + _PRIOR_WEIGHT)

    def _may_draft(self, chunk: ScheduledChunk) -> bool:
        """A decode chunk (``extend`` picked those) of a sequence whose newest token the host has, with tokens left."""
        sequence = chunk.sequence
        return sequence.num_pending == 0 and sequence.finish_reason is None and self._tokens_left(sequence) > 0

    @staticmethod
    def _tokens_left(sequence) -> int:
        """Draft tokens the sequence may still take: its output ends at ``max_tokens``, one of them the model's own."""
        request = sequence.request
        return request.params.max_tokens - len(sequence.output_token_ids) - 1


def _grammar_cut(matcher, draft: list[int], vocab_size: int) -> tuple[list[int], list[torch.Tensor]]:
    """The draft up to its first token the grammar refuses (or past its end), and the grammar's mask for each
    row of the verification: before the draft, then after each kept token. The matcher ends where it began."""
    masks = [next_token_bitmask(matcher, vocab_size)]
    kept: list[int] = []
    for token in draft:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        kept.append(token)
        masks.append(next_token_bitmask(matcher, vocab_size))
    if kept:
        matcher.rollback(len(kept))
    return kept, masks[: len(kept) + 1]


@register_drafter("ngram")
def ngram_drafter(deployment, settings) -> Drafter:
    """Prompt lookup: for each sequence, the tokens that followed the latest earlier occurrence of its last
    ``ngram_max`` tokens (then ``ngram_max - 1``, … ``ngram_min``). No weights; strong where the output quotes
    its prompt (code edits, summaries, retrieval answers)."""
    return PromptLookup(settings.ngram_min, settings.ngram_max)


class PromptLookup:
    """``lookup`` over each sequence's tokens, kept as a numpy array that grows with the sequence (the host's work a
    step is one vectorised comparison per suffix length, not a Python loop over the context)."""

    def __init__(self, smallest: int, largest: int):
        self.smallest, self.largest = smallest, largest
        self._arrays: dict[int, tuple[object, np.ndarray]] = {}  # seq_id → (the sequence, its tokens so far)

    def __call__(self, sequences: list, limits: list[int]) -> list[list[int]]:
        live = {sequence.seq_id for sequence in sequences}
        for seq_id in [i for i, (s, _) in self._arrays.items() if i not in live and s.finish_reason is not None]:
            del self._arrays[seq_id]
        return [lookup(self._tokens(sequence), limit, self.smallest, self.largest) for sequence, limit in zip(sequences, limits)]

    def _tokens(self, sequence) -> np.ndarray:
        tokens = sequence.token_ids
        _, known = self._arrays.get(sequence.seq_id, (None, np.empty(0, dtype=np.int64)))
        if len(known) > len(tokens) or (len(known) and known[-1] != tokens[len(known) - 1]):
            known = np.empty(0, dtype=np.int64)  # not a prefix any more (a beam, a recomputed sequence): start over
        if len(known) < len(tokens):
            known = np.concatenate([known, np.asarray(tokens[len(known):], dtype=np.int64)])
        self._arrays[sequence.seq_id] = (sequence, known)
        return known


def lookup(tokens, limit: int, smallest: int, largest: int) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of ``tokens``' last ``n`` tokens, for the
    largest ``n`` from ``largest`` down to ``smallest`` that occurs earlier; [] when none does.

    >>> lookup([1, 2, 3, 9, 1, 2], 3, 1, 2)
    [3, 9, 1]
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    length = len(tokens)
    if length < 2:
        return []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])  # where an earlier n-gram could end: its last token
    for n in range(min(largest, length - 1), smallest - 1, -1):
        candidates = ends[ends >= n - 1]
        if not len(candidates):
            continue
        grams = tokens[candidates[:, None] - np.arange(n - 1, -1, -1)]  # the n tokens ending at each candidate
        matches = candidates[(grams == tokens[length - n:]).all(axis=1)]
        if len(matches):
            start = int(matches[-1]) + 1  # after the latest occurrence
            return tokens[start : start + limit].tolist()
    return []
