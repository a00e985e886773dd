"""Pick one next token for each row of a batch, each row with its own SamplingParams, on the logits' device.

``sample`` runs every step of every request through the same tensor ops, so a batch of 256 rows costs
one pass over ``[256, vocab]`` and one device→host copy, not 256 of each. Its randomness is a
counter-based hash of (seed, sample index, step, token index), so a seeded request draws the same tokens
whatever shares its batch and whatever anything else did to the device's global RNG, and the ``n``
samples of one request draw independently of each other and of every other seed's samples.

``launch_sample`` queues the same work without waiting for it: the engine feeds its device-side tokens
to the next forward and reads the host copy a step later (``PendingSample.result``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from autodeploy.runtime.device_copies import HostCopy, pinned_to_device, to_device
from autodeploy.runtime.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
# Token ids travel back to the host in the float32 result tensor, exact only up to 2**24.
_MAX_VOCAB = 2**24


@dataclass
class SamplingRow:
    """One sample's state as the sampler needs it."""

    params: SamplingParams
    seed: int  # the request's resolved seed (the engine draws one for unseeded requests)
    step: int  # tokens this sample generated so far: the RNG counter
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # what penalties count; a row without a penalty may carry [] (plan_sampling does)
    sample_index: int = 0  # which of the request's n samples this is
    # A grammar's allowed next tokens (runtime/structured_output.py): packed int32, bit t % 32 of word
    # t // 32 set when token t may come; None: every token may.
    token_bitmask: torch.Tensor | None = None


@dataclass
class SampleResult:
    """One entry per row. Log-probabilities are of the model's raw distribution (before penalties and temperature)."""

    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's logprob; None where the row did not ask for logprobs
    top_logprobs: list[dict[int, float] | None]  # the row's top-``logprobs`` tokens → logprob; None likewise


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """Choose the next token of every row: penalties → the grammar's mask → greedy argmax or temperature,
    top-k, top-p, min-p and a draw.

    ``logits`` is ``[len(rows), vocab]``, any float dtype, any device; the work happens there in
    float32. Requested log-probabilities are ``log_softmax`` of the raw logits in float32, so they
    describe the model, not the filtered distribution the token was drawn from.

    >>> row = SamplingRow(SamplingParams(temperature=0, logprobs=1), seed=0, step=0, prompt_token_ids=[0], output_token_ids=[])
    >>> result = sample(torch.tensor([[0.0, 2.0, 1.0]]), [row])
    >>> result.token_ids, list(result.top_logprobs[0])
    ([1], [1])
    """
    return launch_sample(logits, rows).result()


class PendingSample:
    """A sample computed (or being computed) on the device, its values on their way to the host.

    ``tokens`` (``[rows]`` int64, on the logits' device) can feed the next forward before the host has
    seen them; ``result()`` waits for the one device→host copy and unpacks it.
    """

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, rows: list[SamplingRow], top: int):
        self.tokens = tokens
        self._rows, self._top = rows, top
        self._copy = HostCopy(packed)

    def result(self) -> SampleResult:
        packed = self._copy.wait()
        count = len(self._rows)
        if packed.dim() == 1:  # token ids alone
            return SampleResult(packed.tolist(), [None] * count, [None] * count)
        host = packed.tolist()
        token_ids = [int(values[0]) for values in host]
        chosen_logprobs: list[float | None] = [None] * count
        top_logprobs: list[dict[int, float] | None] = [None] * count
        top = self._top
        for i, row in enumerate(self._rows):
            wanted = row.params.logprobs
            if wanted is None:
                continue
            values = host[i]
            chosen_logprobs[i] = values[1]
            top_logprobs[i] = {int(token): value for token, value in zip(values[2 : 2 + wanted], values[2 + top : 2 + top + wanted])}
        return SampleResult(token_ids, chosen_logprobs, top_logprobs)


def launch_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
    """``sample`` without waiting for the host: every operation is queued on the logits' device, its
    small host→device inputs come from pinned memory, and the result is copied back asynchronously."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
    if logits.shape[1] > _MAX_VOCAB:
        raise ValueError(f"vocabulary of {logits.shape[1]} tokens is larger than the sampler supports ({_MAX_VOCAB})")
    if all(_is_plain_greedy(row.params) for row in rows):
        tokens = greedy_tokens(_mask_disallowed(logits, rows))
        return PendingSample(tokens, tokens, rows, 0)

    raw = logits.float()
    penalized = _mask_disallowed(_apply_logit_bias(_apply_penalties(raw, rows), rows), rows)
    tokens = greedy_tokens(penalized)
    drawing = [i for i, row in enumerate(rows) if row.params.temperature > 0]
    if drawing:
        index = to_device(drawing, torch.long, logits.device)
        tokens = tokens.index_copy(0, index, _draw(penalized.index_select(0, index), [rows[i] for i in drawing]))
    return _packed(raw, tokens, rows)


# From this many rows on, one argmax (a block per row) beats the chunked one: on an H200 over Llama-3's
# 128,256 bf16 logits, 27.2 against 19.5 µs at 32 rows, 27.2 against 28.7 at 64 (scripts/time_argmax.py).
_ARGMAX_ROWS = 64


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[rows, vocab]`` logits, lowest index first among equal maxima.

    A plain argmax reduces each row in one thread block: on an H200, 29 µs for one row of Llama-3's
    128,256 logits, against 4.4 ms for the rest of the decode step. With few rows the vocabulary is cut
    into chunks (a divisor of it, :func:`_argmax_chunk`) reduced in parallel, then the chunk maxima:
    ``max`` returns the first maximum of each chunk and ``argmax`` the first chunk holding the row's
    maximum, so the token is the same.
    """
    rows, vocab = logits.shape
    chunk = _argmax_chunk(vocab)
    if chunk is None or rows >= _ARGMAX_ROWS:
        return logits.argmax(dim=-1)
    return chunked_argmax(logits, chunk)


def chunked_argmax(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` over ``[rows, vocab]`` through the maxima of ``chunk``-wide pieces (``chunk``
    divides ``vocab``): the first maximum of each piece, then the first piece holding the row's maximum."""
    rows, vocab = logits.shape
    values, within = logits.reshape(rows, vocab // chunk, chunk).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (best * chunk + within.gather(-1, best)).squeeze(-1)


@functools.cache
def _argmax_chunk(vocab: int) -> int | None:
    """The smallest divisor of ``vocab`` from 256 through 2,048 that still leaves 64 chunks, or None.

    >>> _argmax_chunk(128256), _argmax_chunk(32000), _argmax_chunk(50257)
    (256, 256, None)
    """
    return next((size for size in range(256, 2049) if vocab % size == 0 and vocab // size >= 64), None)


def _is_plain_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0 and params.logprobs is None and not has_penalty(params) and not params.logit_bias


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty on prompt + output tokens (HF), then presence/frequency on output tokens (OpenAI)."""
    penalized = [i for i, row in enumerate(rows) if has_penalty(row.params)]
    if not penalized:
        return logits
    vocab = logits.shape[1]
    # Rows without a repetition penalty only need their output tokens; prompts come first in each row.
    prompts = [rows[i].prompt_token_ids if rows[i].params.repetition_penalty != 1 else [] for i in penalized]
    sequences = [
        torch.tensor(list(prompt) + list(rows[i].output_token_ids), dtype=torch.long) for i, prompt in zip(penalized, prompts)
    ]
    # One padded [rows, length] host→device copy; padding points at an extra column `vocab` that is cut off.
    token_ids = pinned_to_device(pad_sequence(sequences, batch_first=True, padding_value=vocab), logits.device)
    prompt_lengths = to_device([len(prompt) for prompt in prompts], torch.long, logits.device)
    is_output = (torch.arange(token_ids.shape[1], device=logits.device) >= prompt_lengths[:, None]).float()
    seen = torch.zeros(len(penalized), vocab + 1, dtype=torch.bool, device=logits.device).scatter_(1, token_ids, True)[:, :vocab]
    counts = torch.zeros(len(penalized), vocab + 1, device=logits.device).scatter_add_(1, token_ids, is_output)[:, :vocab]

    repetition, presence, frequency = _row_columns(
        [rows[i].params for i in penalized], ("repetition_penalty", "presence_penalty", "frequency_penalty"), logits.device
    )
    index = to_device(penalized, torch.long, logits.device)
    values = logits.index_select(0, index)
    values = torch.where(seen, torch.where(values < 0, values * repetition, values / repetition), values)
    values = values - presence * (counts > 0) - frequency * counts
    return logits.index_copy(0, index, values)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's ``logit_bias`` added to its tokens' logits, in one host→device copy for the batch."""
    entries = [(i, token, bias) for i, row in enumerate(rows) if row.params.logit_bias for token, bias in row.params.logit_bias.items()]
    if not entries:
        return logits
    table = to_device([[i, token, bias] for i, token, bias in entries], torch.float64, logits.device)
    rows_index, tokens_index = table[:, 0].long(), table[:, 1].long()
    return logits.index_put((rows_index, tokens_index), table[:, 2].to(logits.dtype), accumulate=True)


def _mask_disallowed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """-inf for every token a row's grammar does not allow next (rows without a bitmask are left alone).

    The packed bitmasks go to the device in one copy and are unpacked there: word ``t >> 5``, bit ``t & 31``.
    """
    constrained = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
    if not constrained:
        return logits
    device = logits.device
    bitmask = pinned_to_device(torch.stack([rows[i].token_bitmask for i in constrained]), device)
    token = torch.arange(logits.shape[1], device=device)
    allowed = (bitmask[:, token >> 5] >> (token & 31)) & 1
    index = to_device(constrained, torch.long, device)
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(allowed == 0, float("-inf")))


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Gumbel-max over the tokens that temperature, top-k, top-p and min-p keep: one token per row."""
    temperature, top_k, top_p, min_p = _row_columns(
        [row.params for row in rows], ("temperature", "top_k", "top_p", "min_p"), logits.device
    )
    # Shifting by the row max keeps every value ≤ 0, so a tiny temperature gives -inf, never inf - inf.
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    dropped = scaled < torch.log(min_p)  # p < min_p · p_max  ⇔  log p - log p_max < log min_p
    sorting = [i for i, row in enumerate(rows) if row.params.top_k > 0 or row.params.top_p < 1]
    if sorting:
        index = to_device(sorting, torch.long, logits.device)
        top_dropped = _top_k_top_p_dropped(
            logits.index_select(0, index), scaled.index_select(0, index), top_k[index], top_p[index]
        )
        dropped = dropped.index_copy(0, index, dropped.index_select(0, index) | top_dropped)
    noise = _gumbel_noise(rows, logits.shape[1], logits.device)
    return (scaled.masked_fill(dropped, float("-inf")) + noise).argmax(dim=-1)


def _top_k_top_p_dropped(
    logits: torch.Tensor, scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Which tokens top-k, then nucleus filtering of what top-k left, drop. ``top_k`` 0 / ``top_p`` 1 are off.

    Both go by rank in a stable descending sort of the logits themselves, so ties are broken like
    ``argmax`` (lowest index first) and ``top_k=1`` keeps exactly the greedy token. ``scaled`` (the
    logits shifted and divided by the temperature) gives the probabilities; it is not sorted, because
    rounding in the shift can tie two logits that differ (1e-40 and 0 both become -1 below a max of 1).
    """
    vocab = scaled.shape[1]
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    sorted_values = scaled.gather(1, order)
    rank = torch.arange(vocab, device=scaled.device)
    dropped_sorted = rank >= torch.where(top_k > 0, top_k, vocab)
    probabilities = sorted_values.masked_fill(dropped_sorted, float("-inf")).softmax(dim=-1)
    # A token goes when the more likely tokens already reach top_p, so the top token always stays. Rows
    # with top_p = 1 skip this: a float32 cumsum can round past 1 and would drop their tail.
    before = probabilities.cumsum(dim=-1) - probabilities
    dropped_sorted |= (before >= top_p) & (top_p < 1)
    return torch.empty_like(dropped_sorted).scatter_(1, order, dropped_sorted)


def _gumbel_noise(rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[len(rows), vocab]``, a pure function of each row's (seed, sample index, step)
    and the token index.

    The token index is hashed once per call (1-D); the ``[rows, vocab]`` work is one hash of that
    with the row's key. Uniforms have 23 random bits, so the noise lies in about [-2.8, 16.6]: a
    token whose logit/T is more than ~19 below the best (probability < 4e-9) is never drawn.
    """
    keys = to_device([_row_key(row.seed, row.step, row.sample_index) for row in rows], torch.long, device)
    token_hashes = _mix32(torch.arange(vocab, device=device) ^ 0x9E3779B9)
    bits = _mix32(token_hashes ^ keys[:, None])
    uniform = ((bits >> 9).float() + 0.5) * 2.0**-23  # in [2^-24, 1 - 2^-24]: both logs stay finite
    return -torch.log(-torch.log(uniform))


def _row_key(seed: int, step: int, sample_index: int = 0) -> int:
    """A 32-bit key from all 64 bits of the seed, the step and the sample index.

    Sample 0's key is the seed's and step's alone, so sample 0 of a seeded request with ``n`` > 1 draws
    exactly what the same request with ``n=1`` draws. Later samples hash their index into the key:
    deriving them from ``seed + index`` would make seed s's sample i seed s+1's sample i-1.
    """
    seed &= 2**64 - 1
    key = _mix32(_mix32(_mix32(step & _MASK32) ^ (seed & _MASK32)) ^ (seed >> 32))
    return key if sample_index == 0 else _mix32(key ^ _mix32((sample_index & _MASK32) ^ 0x85EBCA6B))


def _mix32(x):
    """A 32-bit integer hash (a bijection on [0, 2^32)), on Python ints or int64 tensors alike.

    Every product stays below 2^32 · 0x45d9f3b < 2^59, so int64 never overflows.
    """
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _row_columns(params: list[SamplingParams], names: tuple[str, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """One ``[rows, 1]`` float32 column per named field, copied to the device in one go."""
    table = to_device([[float(getattr(p, name)) for name in names] for p in params], torch.float32, device)
    return tuple(table[:, i : i + 1] for i in range(len(names)))


def _packed(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
    """Tokens and any requested log-probabilities in one float32 tensor, for one copy to the host."""
    count = len(rows)
    wanting = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanting:
        return PendingSample(tokens, tokens, rows, 0)
    top = max(rows[i].params.logprobs for i in wanting)
    index = to_device(wanting, torch.long, raw.device)
    logprobs = torch.log_softmax(raw.index_select(0, index), dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])
    best = logprobs.topk(top, dim=-1)
    extra = torch.zeros(count, 1 + 2 * top, device=raw.device)
    extra = extra.index_copy(0, index, torch.cat([chosen, best.indices.float(), best.values], dim=1))
    return PendingSample(tokens, torch.cat([tokens.float()[:, None], extra], dim=1), rows, top)
