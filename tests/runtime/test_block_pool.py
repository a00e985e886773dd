"""KVBlockPool bookkeeping: no leaks, no double ownership, prefix hits and LRU eviction."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy.runtime.block_pool import KVBlockPool


def test_prefix_hit_shares_full_blocks_and_leaves_a_token_to_compute():
    pool = KVBlockPool(num_blocks=8, block_size=4)
    prompt = list(range(10))
    assert pool.acquire_prefix("a", prompt) == 0 and pool.reserve("a", 10)
    pool.register_full_blocks("a", prompt, 10)
    assert pool.acquire_prefix("b", prompt + [99]) == 8  # two full blocks shared
    assert pool.block_table("b")[:2] == pool.block_table("a")[:2]
    assert pool.acquire_prefix("c", prompt[:8]) == 4  # a fully cached prompt still computes its last block
    assert pool.stats.hit_tokens == 12


def test_freed_prefixes_are_parked_then_evicted_least_recently_used_first():
    pool = KVBlockPool(num_blocks=3, block_size=2)
    for name, tokens in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        pool.acquire_prefix(name, tokens)
        pool.reserve(name, 3)
        pool.register_full_blocks(name, tokens, 3)
        pool.free(name)
    assert pool.num_free_blocks == 3
    pool.acquire_prefix("x", [7, 8, 9])
    pool.reserve("x", 3)  # takes the never-used block, then evicts "a"'s prefix (older than "b"'s)
    assert pool.acquire_prefix("a2", [1, 2, 3]) == 0
    assert pool.acquire_prefix("b2", [4, 5, 6]) == 2


def test_reserve_is_all_or_nothing():
    pool = KVBlockPool(num_blocks=2, block_size=4)
    assert not pool.reserve("a", 9) and pool.block_table("a") == [] and pool.num_free_blocks == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "fork", "free"]), st.integers(0, 5), st.integers(1, 40)), max_size=60))
def test_any_operation_sequence_keeps_the_pool_consistent(operations):
    pool = KVBlockPool(num_blocks=12, block_size=4)
    tokens: dict[int, list[int]] = {}
    for action, seq, length in operations:
        if action == "add" and seq not in tokens:
            prompt = [t % 3 for t in range(length)]  # repetitive prompts: prefix hits happen
            cached = pool.acquire_prefix(seq, prompt)
            assert cached % 4 == 0 and cached < length
            if pool.reserve(seq, length):
                pool.register_full_blocks(seq, prompt, length)
                tokens[seq] = prompt
            else:
                pool.free(seq)
        elif action == "grow" and seq in tokens:
            new = tokens[seq] + [length]
            if pool.reserve(seq, len(new)):
                tokens[seq] = new
                pool.register_full_blocks(seq, new, len(new))
        elif action == "fork" and seq in tokens and seq + 10 not in tokens:
            shared = pool.fork(seq, seq + 10, len(tokens[seq]))
            tokens[seq + 10] = tokens[seq][:shared]
        elif action == "free":
            pool.free(seq)
            tokens.pop(seq, None)
        owners = Counter(block for s in tokens for block in pool.block_table(s))
        assert len(owners) == pool.num_used_blocks  # every used block has an owner; no leak
        assert all(block < 12 for block in owners)
    for seq in list(tokens):
        pool.free(seq)
    assert pool.num_free_blocks == 12


def test_reset_prefix_cache_forgets_parked_prefixes_only():
    pool = KVBlockPool(num_blocks=6, block_size=2)
    for name in ("parked", "held"):
        tokens = [1, 2, 3] if name == "parked" else [7, 8, 9]
        pool.acquire_prefix(name, tokens)
        pool.reserve(name, 3)
        pool.register_full_blocks(name, tokens, 3)
    pool.free("parked")
    pool.reset_prefix_cache()
    assert pool.num_free_blocks == 4
    assert pool.acquire_prefix("again", [1, 2, 3]) == 0
    assert pool.acquire_prefix("shared", [7, 8, 9]) == 2


def test_fork_of_a_parent_that_holds_no_blocks_shares_nothing():
    """A beam preempted while it waited for its group's step has no blocks; its children start afresh."""
    pool = KVBlockPool(num_blocks=4, block_size=2)
    assert pool.reserve("parent", 4)
    pool.free("parent")
    assert pool.fork("parent", "child", 4) == 0
    assert pool.block_table("child") == [] and pool.acquire_prefix("child", [1, 2, 3]) == 0
