"""EncoderCache: least-recently-used order within a byte budget, its counts, and its bookkeeping under threads."""

from __future__ import annotations

import threading

import pytest
import torch

from autodeploy.errors import ConfigError
from autodeploy.runtime.encoder_cache import EncoderCache, key, tensor_bytes


def entry(n_floats: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((n_floats,), fill, dtype=torch.float32)  # 4 bytes each


def test_get_returns_what_was_put_and_counts_hits_and_misses():
    cache = EncoderCache(budget_bytes=1000)
    value = entry(10, 1.0)
    assert cache.put("a", value)
    assert cache.get("a") is value and cache.get("b") is None
    assert (cache.hits, cache.misses, cache.evictions) == (1, 1, 0)
    assert "a" in cache and "b" not in cache and len(cache) == 1
    assert cache.bytes_used == 40 == tensor_bytes(value)


def test_least_recently_used_is_evicted_first():
    cache = EncoderCache(budget_bytes=120)  # three 40-byte entries
    for name in "abc":
        cache.put(name, entry(10))
    cache.get("a")  # now b is the least recently used
    cache.put("d", entry(10))
    assert "b" not in cache and all(name in cache for name in "acd")
    cache.put("e", entry(20))  # 80 bytes: evicts c, then a
    assert set("de") == {name for name in "abcde" if name in cache}
    assert cache.evictions == 3 and cache.bytes_used == 120


def test_size_counts_bytes_not_elements():
    cache = EncoderCache(budget_bytes=100)
    cache.put("half", torch.zeros(40, dtype=torch.float16))  # 80 bytes
    cache.put("bytes", torch.zeros(20, dtype=torch.uint8))  # 20 bytes: fits beside it
    assert len(cache) == 2 and cache.bytes_used == 100 and cache.evictions == 0


def test_entry_larger_than_the_budget_is_not_stored():
    cache = EncoderCache(budget_bytes=100)
    cache.put("small", entry(10))
    assert not cache.put("huge", entry(26))  # 104 bytes
    assert "huge" not in cache and "small" in cache and cache.evictions == 0 and cache.bytes_used == 40


def test_putting_a_key_again_replaces_its_value():
    cache = EncoderCache(budget_bytes=200)
    cache.put("a", entry(10, 1.0))
    cache.put("b", entry(10, 2.0))
    assert cache.put("a", entry(20, 3.0))
    assert cache.get("a").shape == (20,) and cache.get("a")[0] == 3.0
    assert len(cache) == 2 and cache.bytes_used == 40 + 80 and cache.evictions == 0
    # a replacement too large for the budget takes the old value out with it
    assert not cache.put("a", entry(60))
    assert "a" not in cache and cache.bytes_used == 40


def test_replacing_the_oldest_entry_makes_it_the_newest():
    cache = EncoderCache(budget_bytes=80)
    cache.put("a", entry(10))
    cache.put("b", entry(10))
    cache.put("a", entry(10))
    cache.put("c", entry(10))
    assert "b" not in cache and "a" in cache and "c" in cache


def test_zero_budget_turns_the_cache_off():
    cache = EncoderCache(budget_bytes=0)
    assert not cache.put("a", entry(1)) and not cache.put("empty", entry(0))
    assert cache.get("a") is None and cache.get("empty") is None
    assert len(cache) == 0 and cache.bytes_used == 0 and cache.misses == 2


def test_negative_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="0 or more bytes .* got -1"):
        EncoderCache(budget_bytes=-1)


def test_key_separates_settings_and_images():
    keys = {key("aa", "11"), key("aa", "12"), key("ab", "11"), key("aa1", "1"), key("a", "a11")}
    assert len(keys) == 5
    assert key("aa", "11") == key("aa", "11")


def test_threads_keep_the_bookkeeping_consistent():
    cache = EncoderCache(budget_bytes=4000)
    failures = []

    def worker(seed: int):
        generator = torch.Generator().manual_seed(seed)
        try:
            for _ in range(500):
                name = f"k{int(torch.randint(0, 40, (1,), generator=generator))}"
                if cache.get(name) is None:
                    cache.put(name, entry(int(torch.randint(1, 200, (1,), generator=generator))))
        except Exception as error:  # surfaced below: an exception in a thread does not fail the test
            failures.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures and not any(thread.is_alive() for thread in threads)
    stored = [cache.get(f"k{i}") for i in range(40)]
    assert cache.bytes_used <= cache.budget_bytes
    assert cache.bytes_used == sum(tensor_bytes(value) for value in stored if value is not None)
    assert len(cache) == sum(value is not None for value in stored)
    assert cache.hits + cache.misses == 6 * 500 + 40
