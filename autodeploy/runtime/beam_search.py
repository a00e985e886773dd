"""Beam search for one prompt, step for step the same as Hugging Face ``generate(num_beams=W, do_sample=False)``.

This is pure bookkeeping: the engine runs the model and hands each step the log-probabilities of every
running beam; ``BeamSearch`` picks the candidates, keeps the finished hypotheses and decides when to stop.
It mirrors ``GenerationMixin._beam_search`` in transformers 5.x, tensor op for tensor op where ranking
or float32 rounding could tell a difference, so the chosen sequences (and their scores) are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autodeploy.errors import InvalidRequestError

# HF's "minus infinity" for beams that must not be chosen; kept finite (not -inf) exactly as HF does,
# since float32 rounding of ``-1e9 + logprob`` decides ties among such beams.
_NEG = -1.0e9


@dataclass
class Beam:
    """A running beam: the engine computes its next-token log-probabilities."""

    token_ids: list[int]  # generated tokens, prompt excluded
    logprob: float  # cumulative log-probability of token_ids
    # Row of the previous ``running`` list this beam extends (-1: the prompt itself); the engine
    # forks/reorders its KV cache with it, as HF's ``reorder_cache(beam_idx)`` does.
    parent: int = -1


@dataclass
class BeamResult:
    """A finished hypothesis, as ``generate(..., num_return_sequences=n)`` returns it."""

    token_ids: list[int]  # generated tokens, ending with the EOS token when one finished it
    logprob: float  # cumulative log-probability of token_ids
    score: float  # logprob / len(token_ids) ** length_penalty, HF's ``sequences_scores``


class BeamSearch:
    """Beam search state machine for a single prompt.

    Example (a "model" whose next-token distribution never changes):

    >>> search = BeamSearch(beam_width=2, max_tokens=3, eos_token_ids={0})
    >>> while not search.done:
    ...     rows = torch.tensor([[-0.5, -1.0, -2.0, -3.0, -4.0]]).expand(len(search.running), 5)
    ...     search.step(rows)
    >>> [r.token_ids for r in search.best(2)]
    [[0], [1, 0]]
    """

    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        eos_token_ids: set[int] | frozenset[int],
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ) -> None:
        if beam_width < 1:
            raise InvalidRequestError(f"beam_width must be >= 1, got {beam_width}")
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1 for beam search, got {max_tokens}")
        if not (isinstance(early_stopping, bool) or early_stopping == "never"):
            raise InvalidRequestError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        # HF's generate() runs greedy search, not beam search, when num_beams == 1; greedy equals
        # one-beam search that ends at its first finished hypothesis, i.e. early_stopping=True.
        self.early_stopping = True if beam_width == 1 else early_stopping
        self._eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
        # Candidates kept per step: enough that W non-finished ones remain even if every beam's
        # top candidates are EOS tokens.
        self._candidates = max(2, 1 + len(eos_token_ids)) * beam_width
        self._generated = 0  # tokens generated so far by every running beam

        self._running = [Beam(token_ids=[], logprob=0.0)]
        # HF starts from W copies of the prompt, all but the first at -1e9 so step 0 picks from the
        # first only; we ask the engine for one row and widen it to W in the first step.
        self._running_scores = torch.full((beam_width,), _NEG)
        self._running_scores[0] = 0.0

        # The W best finished hypotheses, best first. Slots not (yet) filled hold -1e9 and whatever
        # candidate HF's merge put there; ``_finished_flags`` tells real ones apart.
        self._finished_tokens: list[list[int]] = [[] for _ in range(beam_width)]
        self._finished_logprobs: list[float] = [_NEG] * beam_width
        self._finished_scores = torch.full((beam_width,), _NEG)
        self._finished_flags = torch.zeros(beam_width, dtype=torch.bool)
        # HF's is_early_stop_heuristic_unsatisfied: once no running beam can beat the worst finished
        # hypothesis it stays False, and no more hypotheses are accepted.
        self._improvement_possible = torch.tensor(True)
        self._done = False

    @property
    def running(self) -> list[Beam]:
        """Beams that need next-token log-probabilities: one before the first step, W after, none when done."""
        return [] if self._done else list(self._running)

    @property
    def done(self) -> bool:
        return self._done

    def step(self, logprobs: torch.Tensor) -> None:
        """Advance one token. ``logprobs``: [len(running), vocab] float32 log_softmax, rows in ``running`` order."""
        if self._done:
            raise RuntimeError("BeamSearch.step() called after the search finished")
        width = self.beam_width
        if logprobs.dim() != 2 or logprobs.shape[0] != len(self._running):
            raise ValueError(f"logprobs must be [{len(self._running)}, vocab], got {list(logprobs.shape)}")
        vocab = logprobs.shape[1]
        if vocab < self._candidates:
            raise InvalidRequestError(f"beam search keeps {self._candidates} candidates but vocab is only {vocab}")
        logprobs = logprobs.float().expand(width, vocab)  # the first step's one row stands for HF's W copies

        # Top candidates over all beams × vocab (HF's _get_top_k_continuations), on the logprobs' device;
        # only the K winners come back to the CPU.
        accumulated = (logprobs + self._running_scores.to(logprobs.device)[:, None]).reshape(1, width * vocab)
        top_logprobs, top_indices = (t[0].cpu() for t in torch.topk(accumulated, k=self._candidates))
        candidates = list(zip((top_indices // vocab).tolist(), (top_indices % vocab).tolist()))
        generated = self._generated + 1
        hits_stop = torch.isin(top_indices % vocab, self._eos) | (generated >= self.max_tokens)

        # Both updates read the beams running before this step, so the finished set is merged first.
        self._merge_finished(top_logprobs, hits_stop, candidates, generated)
        self._select_running(top_logprobs, hits_stop, candidates)
        self._generated = generated
        self._update_stopping(hits_stop)

    def best(self, n: int = 1) -> list[BeamResult]:
        """The ``n`` best finished hypotheses, best first (HF's ``num_return_sequences=n``)."""
        if not self._done:
            raise RuntimeError("BeamSearch.best() called before the search finished")
        if not 1 <= n <= self.beam_width:
            raise InvalidRequestError(f"n must be between 1 and beam_width={self.beam_width}, got {n}")
        return [
            BeamResult(
                token_ids=list(self._finished_tokens[i]),
                logprob=self._finished_logprobs[i],
                score=float(self._finished_scores[i]),
            )
            for i in range(n)
        ]

    def _extend(self, candidate: tuple[int, int]) -> list[int]:
        """Token ids of a (parent row, token) candidate; built only for candidates that are kept."""
        parent, token = candidate
        return self._running[parent].token_ids + [token]

    def _select_running(
        self, top_logprobs: torch.Tensor, hits_stop: torch.Tensor, candidates: list[tuple[int, int]]
    ) -> None:
        """The W best candidates that did not stop keep running (HF's _get_running_beams_for_next_iteration)."""
        running_logprobs = top_logprobs + hits_stop.to(torch.float32) * _NEG
        keep = torch.topk(running_logprobs, k=self.beam_width)[1]
        self._running_scores = running_logprobs[keep]
        self._running = [
            Beam(token_ids=self._extend(candidates[i]), logprob=float(running_logprobs[i]), parent=candidates[i][0])
            for i in keep.tolist()
        ]

    def _merge_finished(
        self, top_logprobs: torch.Tensor, hits_stop: torch.Tensor, candidates: list[tuple[int, int]], generated: int
    ) -> None:
        """Add candidates that just finished to the W best hypotheses (HF's _update_finished_beams)."""
        width = self.beam_width
        # Only the top W candidates may finish; the rest exist so that W beams can keep running.
        just_finished = hits_stop.clone()
        just_finished[width:] = False
        scores = top_logprobs / (generated**self.length_penalty)
        all_full = bool(self._finished_flags.all()) and self.early_stopping is True
        scores += torch.tensor(all_full).to(torch.float32) * _NEG
        scores += (~self._improvement_possible).to(torch.float32) * _NEG
        scores += (~just_finished) * _NEG

        merged_scores = torch.cat((self._finished_scores, scores))
        merged_flags = torch.cat((self._finished_flags, just_finished))
        merged_logprobs = self._finished_logprobs + top_logprobs.tolist()
        keep = torch.topk(merged_scores, k=width)[1].tolist()
        self._finished_scores = merged_scores[keep]
        self._finished_flags = merged_flags[keep]
        self._finished_tokens = [
            self._finished_tokens[i] if i < width else self._extend(candidates[i - width]) for i in keep
        ]
        self._finished_logprobs = [merged_logprobs[i] for i in keep]

    def _update_stopping(self, hits_stop: torch.Tensor) -> None:
        """HF's _check_early_stop_heuristic and _beam_search_has_unfinished_sequences."""
        # With early_stopping=False the best running beam is judged at its current length; "never"
        # with a positive length penalty assumes it could grow to max_tokens (longer scores better).
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self._generated
        best_running = self._running_scores[:1] / (best_length**self.length_penalty)
        worst_finished = torch.where(self._finished_flags, self._finished_scores.min(), _NEG)
        self._improvement_possible = self._improvement_possible & torch.any(best_running > worst_finished)

        all_finished = bool(self._finished_flags.all()) and self.early_stopping is True
        self._done = not bool(self._improvement_possible) or all_finished or bool(hits_stop.all())
