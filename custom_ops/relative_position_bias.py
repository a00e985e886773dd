"""``torch.ops.autodeploy.relative_position_bias``: T5's bucketed relative position bias, ``[1, H, Sq, Sk]``; and
``relative_position_bias_by_distance``: the same bias as a table by distance, ``[H, L]``.

T5 has no position embeddings: the first layer of each stack looks a learned ``table[num_buckets, H]`` up at the
bucket of every (query, key) distance, and every layer adds the result to its attention logits. The match stage
turns HF's ``T5Attention.compute_bias`` subgraph into ``relative_position_bias``, which the attention patterns take
as the ``bias`` of ``attention`` / ``bidirectional_attention``. A ``[B, H, Sq, Sk]`` tensor cannot be paged, but a
causal attention's bias depends only on how far back a key is: the cache stage turns the decoder's bias into
``relative_position_bias_by_distance`` (one row per head, one column per distance up to ``max_seq_len``), which
``cached_attention`` reads as its ``distance_bias``.
"""

import math

import torch
import torch.nn.functional as F

from .registry import register_op


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """The bucket of each ``key_position - query_position`` in ``relative_position`` (integers), as ``torch.long``.

    Equal to transformers' ``T5Attention._relative_position_bucket``. Bidirectional (an encoder): half of the buckets
    for keys before the query, half for keys after it; one-sided (a decoder): keys after the query share bucket 0.
    Within each half, distances below ``max_exact = half // 2`` have a bucket each; longer ones share buckets
    spaced logarithmically up to ``max_distance``, beyond which all fall in the last bucket. Elementwise integer
    math and one float32 ``log``, so a kernel can compute it per (query, key) pair.

    >>> relative_position_bucket(torch.tensor([-300, -9, -1, 0, 1, 9, 300]), True, 32, 128).tolist()
    [15, 8, 1, 0, 17, 24, 31]

    Raises ``ValueError`` for parameters where the logarithmic buckets are undefined (fewer than 4 buckets, or 2
    one-sided; ``max_distance`` not beyond the exact buckets).
    """
    half = num_buckets // 2 if bidirectional else num_buckets  # the buckets of one direction
    max_exact = half // 2
    if max_exact < 1 or max_distance <= max_exact:
        raise ValueError(
            f"relative_position_bucket: num_buckets={num_buckets} ({'bidirectional' if bidirectional else 'one-sided'})"
            f" leaves {max_exact} exact buckets, and max_distance={max_distance} must exceed that; use at least "
            f"{4 if bidirectional else 2} buckets and a larger max_distance (T5 uses 32 and 128)."
        )
    relative_position = relative_position.to(torch.long)
    if bidirectional:
        direction = torch.where(relative_position > 0, half, 0)
        distance = relative_position.abs()
    else:
        direction = 0
        distance = (-relative_position).clamp(min=0)
    # The same float32 expression as HF's, so buckets agree at every boundary; the clamp spares the small
    # distances (whose result is discarded) a log of 0.
    log_ratio = torch.log(distance.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    far = (max_exact + (log_ratio * (half - max_exact)).to(torch.long)).clamp(max=half - 1)
    return direction + torch.where(distance < max_exact, distance, far)


def relative_position_bias_reference(
    table: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    bidirectional: bool,
    max_distance: int,
) -> torch.Tensor:
    """``out[0, h, i, j] = table[bucket(key_positions[j] - query_positions[i]), h]`` → ``[1, H, Sq, Sk]``.

    ``table`` is ``[num_buckets, H]`` (HF's ``relative_attention_bias.weight``; ``num_buckets`` is its first dim),
    ``query_positions[Sq]`` and ``key_positions[Sk]`` are int32/int64, the bucket is
    :func:`relative_position_bucket`'s. The output is ``compute_bias``'s, leading 1 included, so it replaces that
    subgraph as it stands; a decoding step's queries start at ``past_seen_tokens``. A gather: exact in
    ``table``'s dtype, the bucket's log in float32.
    """
    if table.dim() != 2:
        raise ValueError(f"relative_position_bias: table must be [num_buckets, H]; got {tuple(table.shape)}.")
    for name, positions in (("query_positions", query_positions), ("key_positions", key_positions)):
        if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"relative_position_bias: {name} must be one-dimensional int32 or int64; "
                f"got {tuple(positions.shape)} {positions.dtype}."
            )
    relative_position = key_positions[None, :] - query_positions[:, None]
    bucket = relative_position_bucket(relative_position, bidirectional, table.shape[0], max_distance)
    return F.embedding(bucket, table).permute(2, 0, 1).unsqueeze(0).contiguous()


def relative_position_bias_fake(table, query_positions, key_positions, bidirectional, max_distance):
    return table.new_empty((1, table.shape[1], query_positions.shape[0], key_positions.shape[0]))


relative_position_bias = register_op(
    "relative_position_bias",
    relative_position_bias_reference,
    relative_position_bias_fake,
    example_inputs=(torch.ones(8, 2, dtype=torch.bfloat16), torch.arange(3), torch.arange(4), True, 16),
)


def relative_position_bias_by_distance_reference(
    table: torch.Tensor, length: int, bidirectional: bool, max_distance: int
) -> torch.Tensor:
    """``out[h, d] = table[bucket(-d), h]`` for distances ``d = query_position - key_position`` in ``0 … length - 1``
    → ``[H, length]``: ``relative_position_bias``'s value for every key at or before its query, which is all a causal
    attention sees (``cached_attention``'s ``distance_bias``). A gather, exact in ``table``'s dtype."""
    if table.dim() != 2 or length < 1:
        raise ValueError(f"relative_position_bias_by_distance: table must be [num_buckets, H] and length ≥ 1; got "
                         f"{tuple(table.shape)} and {length}.")
    distances = torch.arange(length, device=table.device)
    bucket = relative_position_bucket(-distances, bidirectional, table.shape[0], max_distance)
    return F.embedding(bucket, table).t().contiguous()


def relative_position_bias_by_distance_fake(table, length, bidirectional, max_distance):
    return table.new_empty((table.shape[1], length))


relative_position_bias_by_distance = register_op(
    "relative_position_bias_by_distance",
    relative_position_bias_by_distance_reference,
    relative_position_bias_by_distance_fake,
    example_inputs=(torch.ones(8, 2, dtype=torch.bfloat16), 5, False, 16),
)
