"""A step's logits rows becoming tokens on its sequences: the sampling plan, its launch, the tokens applied.

Before the launch, ``plan_sampling`` gives each sequence that reaches its last token a sampling row (``n``
rows for a request about to fork its samples; a grammar's mask where it has one) or a beam row, and
``launch_sampling`` queues them on the device. Once the tokens are on the host, ``TokenApplier.apply``
appends them (stop conditions, grammar matchers, logprobs), forks the samples of ``n`` > 1 off their
parent, steps the beam groups whose beams are all in, and retires the requests that finished.

    plan = plan_sampling(completing_chunks, vocab_size)
    sample, beam_logprobs = launch_sampling(plan, logits)
    changed = applier.apply(chunks, plan, sample.result(), beam_logprobs, run_ahead=False, now=clock())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.device_copies import to_device
from autodeploy.runtime.outputs import CompletionOutput
from autodeploy.runtime.request import Request, Sequence
from autodeploy.runtime.sampler import PendingSample, SampleResult, SamplingRow, has_penalty, launch_sample
from autodeploy.runtime.scheduler import ScheduledChunk, Scheduler
from autodeploy.runtime.draft_trees import accepted_path, tree_depths, tree_path
from autodeploy.runtime.speculative import accepted_prefix
from autodeploy.runtime.structured_output import new_matcher, next_token_bitmask


@dataclass
class SamplingPlan:
    """How one step's logits rows become tokens: ``rows[i]`` samples logits row ``row_logits[i]``. Each owner (the
    sequence a row extends or forks from, and the completion index) takes ``1 + len(drafts[j])`` consecutive rows:
    one, or one per token of the draft it verifies and one after it (``runtime/speculative.py``). Beams separately."""

    rows: list[SamplingRow] = field(default_factory=list)
    row_logits: list[int] = field(default_factory=list)
    owners: list[tuple[Sequence, int]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per owner: the drafted tokens it verifies ([] for none)
    parents: list[list[int] | None] = field(default_factory=list)  # per owner: its draft's tree (None: a chain)
    beam_rows: list[tuple[Sequence, int]] = field(default_factory=list)
    # No beams, forks, penalties, grammars or drafts: the next step needs none of its tokens on the host.
    overlappable: bool = True


def plan_sampling(chunks: list[ScheduledChunk], vocab_size: int) -> SamplingPlan:
    """The sampling rows of the chunks that reach their sequence's last token, in logits-row order: one per
    chunk, ``n`` on one row for a request about to fork its samples, ``1 + len(draft)`` for a verification chunk."""
    plan = SamplingPlan()
    row = 0
    for chunk in chunks:
        sequence = chunk.sequence
        request = sequence.request
        if request.beam_search is not None:
            plan.beam_rows.append((sequence, row))
            row += 1
            continue
        if chunk.draft:  # each row sampled as that position would be without speculation
            penalized = has_penalty(request.params)  # only penalties read the output: copy it only for them
            output = sequence.output_token_ids if penalized else []
            generated = sequence.num_output_tokens
            parents = chunk.draft_parents
            depths = range(len(chunk.draft) + 1) if parents is None else [0, *tree_depths(parents)]
            for i, depth in enumerate(depths):
                bitmask = chunk.draft_bitmasks[i] if chunk.draft_bitmasks is not None else None
                before = (chunk.draft[:i] if parents is None else [chunk.draft[n] for n in tree_path(parents, i - 1)]) \
                    if penalized else []
                plan.rows.append(SamplingRow(request.params, request.seed, generated + depth, request.prompt_token_ids,
                                             output + before if penalized else output,
                                             sample_index=sequence.index, token_bitmask=bitmask))
                plan.row_logits.append(row + i)
            plan.owners.append((sequence, sequence.index))
            plan.drafts.append(chunk.draft)
            plan.parents.append(parents)
            plan.overlappable = False
            row += len(chunk.draft) + 1
            continue
        generated = sequence.num_output_tokens
        forking = request.params.n > 1 and len(request.sequences) == 1 and not generated
        # Only penalties read the output: it is copied for them alone (a copy a row and step grows with the output).
        output = sequence.output_token_ids if has_penalty(request.params) else []
        for index in range(request.params.n if forking else 1):
            index = index if forking else sequence.index
            # A constrained sequence never has a token in flight (its steps do not run ahead), so its
            # matcher has seen every token; forks start from the parent's state, the grammar's start.
            bitmask = next_token_bitmask(sequence.grammar, vocab_size) if sequence.grammar is not None else None
            plan.rows.append(
                SamplingRow(
                    request.params, request.seed, generated + sequence.num_pending,
                    request.prompt_token_ids, output, sample_index=index, token_bitmask=bitmask,
                )
            )
            plan.row_logits.append(row)
            plan.owners.append((sequence, index))
            plan.drafts.append([])
            plan.parents.append(None)
        plan.overlappable &= not forking and not has_penalty(request.params) and request.grammar is None
        row += 1
    plan.overlappable &= not plan.beam_rows
    return plan


def launch_sampling(plan: SamplingPlan, logits: torch.Tensor) -> tuple[PendingSample | None, torch.Tensor | None]:
    """Queue the plan's sampling on the device: the pending sample, and the beam rows' log-probabilities."""
    sample = beam_logprobs = None
    if plan.rows:
        picked = logits
        if plan.row_logits != list(range(logits.shape[0])):
            picked = logits.index_select(0, to_device(plan.row_logits, torch.long, logits.device))
        sample = launch_sample(picked, plan.rows)
    if plan.beam_rows:
        index = to_device([row for _, row in plan.beam_rows], torch.long, logits.device)
        beam_logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    return sample, beam_logprobs


class TokenApplier:
    """Applies steps' sampled tokens to their sequences, under the engine's lock; finished requests leave
    ``requests`` (the engine's live requests, shared)."""

    def __init__(self, pool: KVBlockPool, scheduler: Scheduler, requests: dict[str, Request], tokenizer,
                 on_verified: Callable[[int, int], None] | None = None,
                 accept: Callable[[list[int], list[int]], int] = accepted_prefix,
                 on_tree_path: Callable[[Sequence, int, list[int]], None] | None = None):
        self.pool = pool
        self.scheduler = scheduler
        self.requests = requests
        self.tokenizer = tokenizer
        self.on_verified = on_verified  # (drafted, accepted) of every verified draft: the speculator's statistics
        self.accept = accept  # (draft, sampled) -> how many draft tokens to keep: the prefix the model confirms
        self.on_tree_path = on_tree_path  # (sequence, newest position, kept nodes) of a verified tree: KV entries move

    def apply(self, chunks: list[ScheduledChunk], plan: SamplingPlan, result: SampleResult | None,
              beam_logprobs: torch.Tensor | None, run_ahead: bool, now: float) -> list[Request]:
        """Record what a step computed and append its tokens (or beam steps), for the requests still live;
        the requests that changed."""
        for chunk in chunks:
            sequence = chunk.sequence
            if not sequence.request.aborted:  # only tokens the host knows are hashed into the prefix cache
                self.pool.register_full_blocks(sequence.seq_id, sequence.token_ids, min(sequence.num_computed, len(sequence.token_ids)),
                                             sequence.request.content_spans)
        changed: dict[str, Request] = {}
        # Forks first: the parent's own first token may end it (EOS), which frees the blocks they share.
        targets = [sequence if index == sequence.index or sequence.request.aborted else self._fork(sequence, index)
                   for sequence, index in plan.owners]
        first_row = 0
        for (sequence, _), target, draft, parents in zip(plan.owners, targets, plan.drafts, plan.parents):
            rows = range(first_row, first_row + 1 + len(draft))
            first_row = rows.stop
            if run_ahead:
                sequence.num_pending -= 1
            if target.request.aborted or target.finish_reason is not None:
                continue  # cancelled mid-step, or stopped on the token before this (a wasted row)
            kept = []  # the draft's tokens the model confirms: a prefix of a chain, a path down a tree
            if draft:  # the draft's prefix the model confirms, then the model's own next token
                sampled = [result.token_ids[i] for i in rows]
                if parents is None:
                    kept = list(range(self.accept(draft, sampled)))
                    drafted = len(draft)
                else:
                    kept = accepted_path(draft, parents, sampled)
                    drafted = max(tree_depths(parents))
                    if self.on_tree_path is not None:
                        self.on_tree_path(target, len(target.token_ids) - 1, kept)
                rows = [rows[0], *(rows[0] + 1 + node for node in kept)]
                target.judged(drafted, len(kept))
                if self.on_verified is not None:
                    self.on_verified(drafted, len(kept))
            emitted = 0
            for i in rows:
                # An accepted draft token is the one sampled (only the replay benchmark keeps others).
                token = draft[kept[emitted]] if emitted < len(rows) - 1 else result.token_ids[i]
                emitted += 1
                target.append(token, self.tokenizer)
                if target.grammar is not None:
                    self._advance_grammar(target, token)
                if result.logprobs[i] is not None:
                    target.logprobs.append(result.logprobs[i])
                    target.top_logprobs.append(result.top_logprobs[i])
                if target.finish_reason is not None:
                    break
            if draft and target.finish_reason is None:  # the rejected tokens' KV entries are dropped
                target.num_computed = len(target.token_ids) - 1
                self.pool.truncate(target.seq_id, len(target.token_ids))
            self._after_token(target, now, changed, emitted)
        beams = [(s, logprobs) for (s, _), logprobs in zip(plan.beam_rows, beam_logprobs if beam_logprobs is not None else ())
                 if not s.request.aborted]
        for sequence, logprobs in beams:
            sequence.pending_logprobs = logprobs
            sequence.awaiting_beam_step = True
        for request in {id(s.request): s.request for s, _ in beams}.values():
            if all(s.awaiting_beam_step for s in request.sequences):
                self._beam_step(request, now)
                changed[request.request_id] = request
        return list(changed.values())

    def start_grammar(self, sequence: Sequence) -> None:
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
        self.start_grammar(child)
        child.num_computed = self.pool.fork(parent.seq_id, child.seq_id, len(request.prompt_token_ids))
        request.sequences.append(child)
        self.scheduler.running.append(child)
        return child

    def _after_token(self, sequence: Sequence, now: float, changed: dict[str, Request], count: int = 1) -> None:
        """``count`` tokens came to ``sequence`` now (several from a verified draft)."""
        request = sequence.request
        if sequence.index == 0:
            request.token_times.extend([now] * count)
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
