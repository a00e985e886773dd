"""The Triton slot-cache kernels (``custom_ops/triton/slot_attention.py``) against the PyTorch paths they replace:
the gathered attention of ``SlotCache.attend`` and the indexed stores of ``SlotCache.write``. Without a GPU the kernel runs in Triton's interpreter (``tests/conftest.py``), so
the shapes are tiny; they still cover grouped heads, several queries a sequence, key and value widths that are not
powers of two, rings longer than a tile, padding sequences on the pad slot and rows that see nothing."""

from __future__ import annotations

import pytest
import torch

from autodeploy.runtime.hidden_state_heads import EMPTY, SlotCache
from autodeploy.custom_ops.triton.slot_attention import slot_attention, slot_store
from autodeploy.runtime.hidden_state_heads import _check_slot_kernels, fill_randomly
from tests.custom_ops.test_paged_attention_triton import interpreter_loops_with_numpy_2_4  # noqa: F401  (autouse)


def filled_cache(kv_heads: int, key_dim: int, value_dim: int, window: int, chain: int, seed: int) -> SlotCache:
    """Three slots (and the pad slot) as writes up to positions 70, 30, 9 and 50 leave them."""
    cache = SlotCache(3, kv_heads, key_dim, value_dim, window, chain, torch.device("cpu"), torch.float32)
    fill_randomly(cache, torch.tensor([70, 30, 9, 50]), torch.Generator().manual_seed(seed))
    return cache


@pytest.mark.parametrize("heads, kv_heads, n, key_dim, value_dim, window", [
    (4, 2, 1, 16, 16, 24),  # a chain step, grouped heads
    (3, 3, 3, 24, 20, 40),  # a feed of three positions, widths not powers of two, a ring longer than a tile
    (2, 1, 2, 16, 32, 5),  # a short window: most entries out of it
])
def test_the_kernel_attends_as_the_gathered_attention_does(heads, kv_heads, n, key_dim, value_dim, window):
    cache = filled_cache(kv_heads, key_dim, value_dim, window, chain=4, seed=heads + n)
    generator = torch.Generator().manual_seed(7)
    slots = torch.tensor([1, 0, cache.pad])  # the last a padding sequence, on the pad slot
    positions = torch.randint(5, 60, (3, 1), generator=generator) + torch.arange(n)
    q = torch.randn(3, n, heads, key_dim, generator=generator).transpose(1, 2)  # strided, as the fused head's
    for scale in (None, 0.3):
        want = cache.attend(q, slots, positions, scale)
        got = slot_attention(q, cache.k, cache.v, cache.positions, slots, positions, window, scale)
        assert got.shape == want.shape == (3, heads, n, value_dim)
        torch.testing.assert_close(got, want.nan_to_num(0.0), atol=1e-5, rtol=1e-5)


def test_rings_of_several_tiles_wrapped_and_not():
    """A ring of 104 entries (two tiles): a query past it reads the whole ring, wrapped; one at a position below it
    reads only the entries up to its position (the rest hold later positions or none)."""
    cache = SlotCache(3, 2, 16, 16, 100, 4, torch.device("cpu"), torch.float32)
    fill_randomly(cache, torch.tensor([250, 60, 9, 50]), torch.Generator().manual_seed(2))
    slots, positions = torch.tensor([0, 1, 2]), torch.tensor([[240, 241], [55, 56], [9, 10]])
    q = torch.randn(3, 4, 2, 16, generator=torch.Generator().manual_seed(3))
    want = cache.attend(q, slots, positions)
    torch.testing.assert_close(slot_attention(q, cache.k, cache.v, cache.positions, slots, positions, 100), want,
                               atol=1e-5, rtol=1e-5)


def test_a_row_that_sees_nothing_gives_zeros():
    cache = filled_cache(1, 16, 16, 8, chain=2, seed=3)
    cache.positions[0] = EMPTY
    q = torch.randn(1, 2, 1, 16)
    out = slot_attention(q, cache.k, cache.v, cache.positions, torch.tensor([0]), torch.tensor([[30]]), 8)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("kv_heads, key_dim, value_dim", [(2, 16, 16), (3, 24, 20)])
def test_the_store_kernel_writes_what_the_indexed_stores_do(kv_heads, key_dim, value_dim):
    """Valid rows into their slots' ring entries (wrapping), padding rows into the pad slot, the positions held."""
    cache = filled_cache(kv_heads, key_dim, value_dim, 6, chain=2, seed=5)
    worst, stored = _check_slot_kernels(cache, kv_heads * 2, None, slot_attention, slot_store)
    assert stored and worst < 1e-5


def test_the_cache_takes_the_kernel_only_where_triton_runs():
    cache = filled_cache(2, 16, 16, 8, chain=2, seed=4)
    assert cache.use_kernel(heads=4).startswith("slot attention gathered (Triton kernels need a CUDA device")
    assert cache.kernel is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_the_cache_checks_and_takes_the_kernel(dtype):
    cache = SlotCache(4, 2, 64, 64, 64, 4, torch.device("cuda"), dtype)
    kept = cache.positions.clone()
    assert cache.use_kernel(heads=8).startswith("slot attention and stores in one kernel each")
    assert cache.kernel is slot_attention and cache.store_kernel is slot_store
    assert torch.equal(cache.positions, kept)  # the check's random entries are gone
