"""Token-count buckets: the shapes the autotuner times, and the bucket an unseen token count falls in.

A flattened step has ``T`` new tokens: 1 … ``max_batch_size`` while decoding, up to ``max_num_tokens``
while prefilling. Powers of two cover both; a count between two buckets uses the next one up, and one
past the largest uses the largest.
"""

from __future__ import annotations

import bisect


def token_buckets(max_batch_size: int, max_num_tokens: int) -> tuple[int, ...]:
    """Powers of two from 1 through ``max_batch_size`` (decode), then on through ``max_num_tokens`` (prefill);
    each limit is itself a bucket.

    >>> token_buckets(32, 2048)
    (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    >>> token_buckets(6, 100)
    (1, 2, 4, 6, 8, 16, 32, 64, 100)
    """
    limit = max(max_batch_size, max_num_tokens, 1)
    buckets = {max_batch_size, limit}
    size = 1
    while size < limit:
        buckets.add(size)
        size *= 2
    return tuple(sorted(b for b in buckets if b >= 1))


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int:
    """The bucket whose decision serves ``num_tokens``: the smallest bucket ≥ it, else the largest."""
    index = bisect.bisect_left(buckets, num_tokens)
    return buckets[min(index, len(buckets) - 1)]
