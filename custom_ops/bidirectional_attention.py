"""``torch.ops.autodeploy.bidirectional_attention``: every query sees every key of its sequence (an encoder's
attention: a vision tower's, a text encoder's; a decoder's cross-attention over the encoder's keys, which may be
more or fewer than its queries), with GQA and an optional additive bias (T5's relative position bias).

It is its own op rather than an option of the causal ``attention``: the cache stage turns ``attention`` into
paged, cached attention over the KV pool, and this one never is (an encoder's sequence is whole in one forward).

Packed sequences (``seq_start``): an embedding model (BERT, XLM-R) runs many texts of different lengths in one
forward with no padding, as one row ``q[1, T, Hq, D]``. ``seq_start[N + 1]`` (int32, or int64) holds the
cumulative starts: sequence ``s`` owns tokens ``seq_start[s] : seq_start[s + 1]`` (a repeated start is an empty
sequence), and each query sees exactly the keys of its own sequence (self-attention, block-diagonal).
Backends: ``sdpa`` (any device; one call with a block-diagonal mask) and ``varlen`` (CUDA; flash attention over the
packed row, only the keys of each sequence computed).

A bidirectional sliding window (``window = W``: ModernBERT's local layers) shows query ``i`` the keys ``j`` with
``|i - j| ≤ W`` only, within its own sequence when packed (a distance is the same in the row and in the text): the
``sdpa`` backend adds the band to its mask, ``varlen`` passes flash attention's ``window_size=(W, W)``.
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .attention import check_bias
from .compute_dtype import compute_dtype
from .registry import register_backend, register_op, register_tuning_input

SEQ_START_DTYPES = (torch.int32, torch.int64)
FLASH_MAX_HEAD_DIM = 256  # flash attention's largest head dim


def bidirectional_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                      bias: Optional[torch.Tensor] = None,
                                      seq_start: Optional[torch.Tensor] = None,
                                      window: Optional[int] = None) -> torch.Tensor:
    """``q[B, S, Hq, D]`` over ``k[B, Sk, Hkv, D]``, ``v[B, Sk, Hkv, Dv]`` → ``[B, S, Hq, Dv]``, no mask (or a window).

    ``softmax(scale · q_i · k_j + bias_ij) · v_j`` per head in float32 (float64 for float64 inputs), cast back to
    ``q``'s dtype; query head ``h`` reads kv head ``h // (Hq // Hkv)``. ``bias`` (optional) is ``[1 or B, 1 or Hq,
    S, Sk]``: T5's relative position bias (``relative_position_bias``).

    ``seq_start`` (optional, ``[N + 1]`` int32 or int64, non-decreasing from 0 to ``S``): ``N`` sequences packed along
    dim 1 of a batch of one (``B == 1``, ``Sk == S``); each attends over its own tokens only, computed sequence by
    sequence as above. It is read on the host (validated, then sliced by): the call syncs with the device. Not
    with a ``bias``.

    ``window`` (optional, ≥ 0; self-attention only, ``Sk == S``): query ``i`` sees key ``j`` iff ``|i - j| ≤ window``
    (0: itself only), the indices counted within its sequence when packed.
    """
    batch, _, q_heads, head_dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    if k.shape != (batch, keys, kv_heads, head_dim) or v.shape[:3] != (batch, keys, kv_heads):
        raise ValueError(f"bidirectional_attention: expected k [B, Sk, Hkv, D] and v [B, Sk, Hkv, Dv] matching q "
                         f"{tuple(q.shape)}; got k {tuple(k.shape)} and v {tuple(v.shape)}.")
    if q_heads % kv_heads != 0:
        raise ValueError(f"bidirectional_attention: query heads Hq={q_heads} must be a multiple of kv heads Hkv={kv_heads}.")
    check_bias("bidirectional_attention", bias, batch, q_heads, q.shape[1], keys)
    if window is not None and (window < 0 or keys != q.shape[1]):
        raise ValueError(f"bidirectional_attention: a window is a distance ≥ 0 within a sequence attending to itself "
                         f"(keys Sk = queries S); got window={window} with S={q.shape[1]}, Sk={keys}.")
    if seq_start is None:
        return _attend_every_key(q, k, v, scale, bias, window)
    starts = _packed_starts(q, k, bias, seq_start)
    return torch.cat([_attend_every_key(q[:, start:end], k[:, start:end], v[:, start:end], scale, window=window)
                      for start, end in zip(starts, starts[1:])], dim=1)


def _attend_every_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      bias: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    q_heads, kv_heads = q.shape[2], k.shape[2]
    dtype = compute_dtype(q.dtype)
    kv_head_of = torch.arange(q_heads, device=q.device) // (q_heads // kv_heads)
    logits = torch.einsum("bihd,bjhd->bhij", q.to(dtype), k.to(dtype)[:, :, kv_head_of]) * scale
    if bias is not None:
        logits = logits + bias.to(dtype)
    if window is not None:
        logits = logits.masked_fill(~within_window(q.shape[1], window, q.device), float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(logits, dim=-1), v.to(dtype)[:, :, kv_head_of])
    return out.to(q.dtype).contiguous()


def _packed_starts(q: torch.Tensor, k: torch.Tensor, bias: Optional[torch.Tensor], seq_start: torch.Tensor) -> list[int]:
    """``seq_start`` as a list, once it is checked to pack sequences into ``q``'s row; a ``ValueError`` otherwise."""
    op = "bidirectional_attention"
    if bias is not None:
        raise ValueError(f"{op}: a bias together with seq_start (packed sequences) is not supported; pass one or the other.")
    if q.shape[0] != 1:
        raise ValueError(f"{op}: seq_start packs sequences along dim 1 of a batch of one; q has B={q.shape[0]}.")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"{op}: packed sequences attend over themselves, so with seq_start the keys Sk={k.shape[1]} "
                         f"must be the queries S={q.shape[1]}.")
    if seq_start.dtype not in SEQ_START_DTYPES:
        raise ValueError(f"{op}: seq_start must be int32 (or int64); got {seq_start.dtype}.")
    if seq_start.dim() != 1 or seq_start.numel() < 2:
        raise ValueError(f"{op}: seq_start must be [N + 1] for N ≥ 1 sequences; got shape {tuple(seq_start.shape)}.")
    starts = seq_start.tolist()
    if starts[0] != 0:
        raise ValueError(f"{op}: seq_start must start at 0; got seq_start[0] = {starts[0]}.")
    if starts[-1] != q.shape[1]:
        raise ValueError(f"{op}: seq_start must end at the packed length S={q.shape[1]}; got seq_start[-1] = {starts[-1]}.")
    for index, (start, end) in enumerate(zip(starts, starts[1:])):
        if end < start:
            raise ValueError(f"{op}: seq_start must be non-decreasing; got seq_start[{index}] = {start} > "
                             f"seq_start[{index + 1}] = {end}.")
    return starts


def bidirectional_attention_fake(q, k, v, scale, bias=None, seq_start=None, window=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


bidirectional_attention = register_op(
    "bidirectional_attention",
    bidirectional_attention_reference,
    bidirectional_attention_fake,
    example_inputs=(torch.ones(1, 3, 4, 8, dtype=torch.bfloat16), torch.ones(1, 3, 2, 8, dtype=torch.bfloat16),
                    torch.ones(1, 3, 2, 6, dtype=torch.bfloat16), 8**-0.5),
)


# The autotuner times packed attention on texts of this many tokens (the last one shorter): representative of what
# embedding jobs send, and the contest it decides — an S² block-diagonal mask against per-text flash blocks — has the
# same winner for shorter texts (the mask's cost does not shrink with them; the varlen kernel's does).
TUNING_TEXT_TOKENS = 128


def tuning_seq_start(num_tokens: int, device: torch.device) -> torch.Tensor:
    """``seq_start`` for a tuning problem of ``num_tokens`` packed tokens: texts of ``TUNING_TEXT_TOKENS``."""
    starts = list(range(0, num_tokens, TUNING_TEXT_TOKENS)) + [num_tokens]
    return torch.tensor(starts if len(starts) > 1 else [0, num_tokens], dtype=torch.int32, device=device)


register_tuning_input("bidirectional_attention", "seq_start", tuning_seq_start)
register_tuning_input("attention", "seq_start", tuning_seq_start)


def bidirectional_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 bias: Optional[torch.Tensor] = None,
                                 seq_start: Optional[torch.Tensor] = None,
                                 window: Optional[int] = None) -> torch.Tensor:
    """PyTorch's ``scaled_dot_product_attention`` (flash or memory-efficient kernels on a GPU) on ``[B, H, S, D]`` views;
    a ``bias`` is its float ``attn_mask`` (which SDPA adds to the scaled logits), a ``window`` a boolean band
    ``|i - j| ≤ window`` in it (``-inf`` outside the band where there is a bias).

    Packed sequences (``seq_start``) are one call with a boolean block-diagonal ``attn_mask`` (``[S, S]``, built on
    the device from ``seq_start``): no host sync, so a CUDA graph can capture it. It costs ``S²`` logits where the
    sequences need ``Σ len²`` and an ``S × S`` mask, and a mask rules out SDPA's flash kernel; on a GPU the
    ``varlen`` backend computes only each sequence's own keys.
    """
    mask = bias if seq_start is None else same_sequence_mask(seq_start, q.shape[1], q.device)
    if window is not None:
        band = within_window(q.shape[1], window, q.device)
        if mask is None:
            mask = band
        elif mask.dtype == torch.bool:
            mask = mask & band
        else:
            mask = mask.masked_fill(~band, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).contiguous()


def same_sequence_mask(seq_start: torch.Tensor, tokens: int, device: torch.device) -> torch.Tensor:
    """``[tokens, tokens]`` booleans: whether tokens ``i`` and ``j`` of the packed row are in one sequence.

    A token's sequence is identified by how many starts are ≤ its index, which skips empty sequences.

    >>> same_sequence_mask(torch.tensor([0, 2, 2, 3]), 3, torch.device("cpu")).int().tolist()
    [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    seq_start = seq_start.to(device)
    sequence = torch.searchsorted(seq_start, torch.arange(tokens, device=device, dtype=seq_start.dtype), right=True)
    return sequence[:, None] == sequence[None, :]


def within_window(tokens: int, window: int, device: torch.device) -> torch.Tensor:
    """``[tokens, tokens]`` booleans: whether tokens ``i`` and ``j`` are at most ``window`` apart.

    >>> within_window(3, 1, torch.device("cpu")).int().tolist()
    [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    """
    index = torch.arange(tokens, device=device)
    return (index[:, None] - index[None, :]).abs() <= window


def _sdpa_supports(q, k, v, scale, bias=None, seq_start=None, window=None, *, device):
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k and v differ in dtype ({q.dtype}, {k.dtype}, {v.dtype})"
    if bias is not None and bias.dtype != q.dtype:  # SDPA takes a float mask in the queries' dtype only
        return f"the bias is {bias.dtype}, q {q.dtype}"
    if bias is not None and seq_start is not None:
        return "a bias together with packed sequences (seq_start) is not supported"
    if window is not None and k.shape[1] != q.shape[1]:
        return "a window needs self-attention (as many keys as queries)"
    return True


register_backend("bidirectional_attention", "sdpa", bidirectional_attention_sdpa, supports=_sdpa_supports)


@functools.lru_cache(maxsize=None)
def _flash_forward_keywords() -> frozenset[str]:
    """The arguments this torch's ``aten::_flash_attention_forward`` takes (``scale``, ``window_size_left``, …); none
    where it has no such op."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return frozenset(argument.name for argument in op.default._schema.arguments) if op is not None else frozenset()


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor, scale: float,
                 window: tuple[int, int] = (-1, -1), causal: bool = False) -> torch.Tensor:
    """Packed sequences ``[1, T, H, D]`` through flash attention's variable-length kernel, ``seq_start`` as both the
    queries' and the keys' starts: each query block reads its own sequence's keys only. ``window``: keys ``i - left …
    i + right`` (-1: unbounded); ``causal``: none after the query.

    It calls ``aten::_flash_attention_forward`` itself, the op ``torch.nn.attention.varlen.varlen_attn`` wraps: torch
    2.11's ``varlen_attn`` takes no ``scale=`` (2.13's does), the op does in both; fewer key/value heads than query
    heads (GQA) are the kernel's own. The longest sequence is passed as ``T`` (at least 2), an upper bound the kernel
    accepts (it sizes its grid by it, and blocks past a sequence's end exit at once), rather than ``max(len)``, which
    would read ``seq_start`` on the host: no sync, so a CUDA graph can capture it. At 1 the kernel takes a path that
    assumes every sequence has one query, which empty sequences break; 2 keeps it off."""
    cu_seqlens = seq_start.to(device=q.device, dtype=torch.int32).contiguous()
    longest = max(q.shape[1], 2)
    windowed = {} if window == (-1, -1) else {"window_size_left": window[0], "window_size_right": window[1]}
    out = torch.ops.aten._flash_attention_forward(q[0], k[0], v[0], cu_seqlens, cu_seqlens, longest, longest, 0.0, causal,
                                                  False, scale=scale, **windowed)[0]
    return out.unsqueeze(0)


def flash_varlen_refusal(q, k, v, seq_start, device, windowed: bool) -> Optional[str]:
    """Why ``flash_varlen`` cannot run these packed ``q``, ``k``, ``v`` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"flash attention's varlen kernel runs on CUDA GPUs only (the deploy runs on {device.type})"
    if seq_start is None:
        return "the varlen kernel serves packed sequences (seq_start) only"
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"flash attention takes float16 or bfloat16 q, k and v (got {q.dtype}, {k.dtype}, {v.dtype})"
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    if value_dim != head_dim or head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return (f"flash attention needs one head dim for q, k and v, a multiple of 8 up to {FLASH_MAX_HEAD_DIM} "
                f"(got D={head_dim}, Dv={value_dim})")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "flash attention needs q, k and v with a contiguous last dim"
    keywords = _flash_forward_keywords()
    if "scale" not in keywords:
        return f"torch {torch.__version__} has no aten::_flash_attention_forward taking scale="
    if windowed and not {"window_size_left", "window_size_right"} <= keywords:
        return f"torch {torch.__version__}'s flash attention forward takes no window_size_left= / window_size_right= (a sliding window)"
    if not torch.backends.cuda.is_flash_attention_available():
        return f"this PyTorch build (torch {torch.__version__}) has no flash attention"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "flash attention needs an Ampere or later GPU (sm80+)"
    return None


def bidirectional_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                   bias: Optional[torch.Tensor] = None,
                                   seq_start: Optional[torch.Tensor] = None,
                                   window: Optional[int] = None) -> torch.Tensor:
    """Packed sequences through flash attention's varlen kernel (``flash_varlen``); a ``window`` is its window
    ``(window, window)``: keys ``i - window … i + window`` of the sequence. Needs ``seq_start`` and no ``bias``."""
    return flash_varlen(q, k, v, seq_start, scale, (-1, -1) if window is None else (window, window))


def _varlen_supports(q, k, v, scale, bias=None, seq_start=None, window=None, *, device):
    if bias is not None:
        return "flash attention's varlen kernel adds no bias"
    return flash_varlen_refusal(q, k, v, seq_start, device, window is not None) or True


register_backend("bidirectional_attention", "varlen", bidirectional_attention_varlen, supports=_varlen_supports)
