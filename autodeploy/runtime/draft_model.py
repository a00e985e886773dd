"""The ``draft`` drafter: a smaller model, deployed through the same pipeline, proposes the next tokens greedily.

The draft model is a deployment of its own (``Deployment.draft``: its graph, serving signature, settings and
build report) run by a model runner of its own, with its own KV pool and, on a GPU, its own CUDA graphs. For
each sequence it keeps the tokens it has in its cache; a proposal first computes what the sequence gained
since (its prompt, the tokens the model accepted, the model's own token: one forward for all the sequences),
then runs ``k - 1`` one-token steps, each token the draft's argmax, fed to the next step on the device (the host
reads the draft's tokens once, after the last step, instead of waiting for each). Tokens the model rejected are dropped from
the draft's cache by comparing it with the sequence again at the next proposal.

    drafter = DraftModel(deployment.draft)
    drafts = drafter(sequences, limits=[4] * len(sequences))
"""

from __future__ import annotations

import itertools
import logging

import torch

from autodeploy.errors import ConfigError
from autodeploy.runtime.model_runner import make_model_runner
from autodeploy.runtime.sampler import greedy_tokens
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.step_inputs import PendingTokens
from autodeploy.runtime.speculative import register_drafter

logger = logging.getLogger(__name__)


class _DraftSequence:
    """One sequence as the draft's cache holds it (what ``build_step_inputs`` reads of a sequence)."""

    _ids = itertools.count(-(2**40), -1)  # apart from the engine's probes' ids
    request = None  # no side inputs

    def __init__(self, target):
        self.target = target
        self.seq_id = next(self._ids)
        self.token_ids: list[int] = []
        self.num_computed = 0
        self.synced = 0  # the sequence's length at the last sync: its tokens up to there are ours too
        self.pending = 0  # drafted tokens still on the device (not in token_ids yet)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.pending


class DraftModel:
    """Greedy drafts from ``draft``'s graph (a ``Deployment``), on a KV pool of its own."""

    def __init__(self, draft, vocab_size: int):
        self.runner = make_model_runner(draft)
        self.runner.set_up(check_logits=True)
        self.pool = self.runner.pool
        self.vocab_size = vocab_size  # the model's: a draft token past it (padding of a wider head) ends the draft
        self._sequences: dict[int, _DraftSequence] = {}

    @torch.inference_mode()
    def __call__(self, sequences: list, limits: list[int]) -> list[list[int]]:
        self._forget_finished()
        drafts: list[list[int]] = [[] for _ in sequences]
        drafting = []
        for index, (sequence, limit) in enumerate(zip(sequences, limits)):
            if limit <= 0:
                continue
            state = self._synced(sequence)
            if self._reserve(state, len(state.token_ids) + limit - 1, keep={s.seq_id for s in sequences}):
                drafting.append((index, state, limit))
        # Each round's tokens stay on the device: the next round reads them there (pending, as a run-ahead decode
        # step does), and the host reads them all once at the end.
        rounds: list[tuple[torch.Tensor, list[tuple[int, _DraftSequence]]]] = []  # (tokens [rows], row owners)
        pending = None
        for round_ in range(max((limit for _, _, limit in drafting), default=0)):
            active = [(index, state) for index, state, limit in drafting if limit > round_]
            chunks = [ScheduledChunk(state, state.num_computed, state.num_tokens - state.num_computed) for _, state in active]
            order = sorted(range(len(chunks)), key=lambda i: chunks[i].length == 1)  # decodes last
            run, completing = self.runner.stage([chunks[i] for i in order], pending=pending)
            tokens = greedy_tokens(run())
            owners = [active[order[position]] for position in completing]
            for _, state in owners:
                state.num_computed = state.num_tokens
                state.pending += 1
            rounds.append((tokens, owners))
            pending = PendingTokens(tokens, {state.seq_id: row for row, (_, state) in enumerate(owners)})
        stopped: set[int] = set()  # drafts cut short by a token past the model's vocabulary
        for tokens, owners in zip((tokens.tolist() for tokens in _on_host([t for t, _ in rounds])), (o for _, o in rounds)):
            for token, (index, state) in zip(tokens, owners):
                state.pending -= 1
                if index in stopped or token >= self.vocab_size:
                    stopped.add(index)  # the draft ends; the draft's cache past here is cut at the next sync
                    continue
                state.token_ids.append(token)
                drafts[index].append(token)
        for _, state, _ in drafting:  # a cut draft's later tokens were computed but are not held: compute again
            state.num_computed = min(state.num_computed, len(state.token_ids))
        return drafts

    def _synced(self, sequence) -> _DraftSequence:
        """The draft's state of ``sequence``, its cached tokens cut to the prefix they still share."""
        state = self._sequences.get(sequence.seq_id)
        if state is None:
            state = self._sequences[sequence.seq_id] = _DraftSequence(sequence)
        tokens = sequence.token_ids  # only ever grows (no beams with speculation): compare past the last sync only
        limit = min(state.num_computed, len(tokens) - 1)  # at least the newest token is computed again
        shared = min(state.synced, limit)
        while shared < limit and state.token_ids[shared] == tokens[shared]:
            shared += 1
        state.num_computed = shared
        state.token_ids[shared:] = tokens[shared:]
        state.synced = len(tokens)
        self.pool.truncate(state.seq_id, shared)
        return state

    def _reserve(self, state: _DraftSequence, num_tokens: int, keep: set[int]) -> bool:
        """Blocks for ``num_tokens`` of ``state``; when the pool is full, the states of sequences not drafting
        now go first (they compute their tokens again later)."""
        while not self.pool.reserve(state.seq_id, num_tokens):
            idle = next((seq_id for seq_id in self._sequences if seq_id not in keep), None)
            if idle is None:
                return False
            self._drop(idle)
        return True

    def _forget_finished(self) -> None:
        for seq_id, state in list(self._sequences.items()):
            if state.target.finish_reason is not None or state.target.request.aborted:
                self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        self.pool.free(self._sequences.pop(seq_id).seq_id)


def _on_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (1-D, one device) copied to the host in one transfer."""
    if not tensors:
        return []
    return list(torch.cat(tensors).cpu().split([len(t) for t in tensors]))


@register_drafter("draft")
def draft_model_drafter(deployment, settings) -> DraftModel:
    if deployment.draft is None:
        raise ConfigError("speculative.method is 'draft' but the deployment holds no draft model: build it with "
                          "autodeploy(model, speculative={'method': 'draft', 'model': 'path/to/draft'})")
    return DraftModel(deployment.draft, deployment.vocab_size)
