"""The Triton backend of autodeploy::cached_attention against its torch reference, on the same caches.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET),
which is slow, so the CPU shapes are tiny; the GPU-only cases use production head dims and long contexts.
Cache slots that no sequence owns hold NaN: a kernel that reads past a sequence's keys fails loudly.
"""

from __future__ import annotations

import re

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import canonical_ops
from autodeploy.custom_ops.cached_attention import cached_attention_reference
from autodeploy.custom_ops.triton.paged_attention import attend_over_cache, cached_attention_triton, check_supported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-sized shapes; the interpreter is too slow")
needs_gpu_for_bfloat16 = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter gets bfloat16 dots wrong (triton-lang/triton#11584)"
)


@pytest.fixture(autouse=True, scope="module")
def interpreter_loops_with_numpy_2_4():
    """Triton 3.6's interpreter turns a loop bound into an int with ``int(array)``, which numpy ≥ 2.4
    refuses for its one-element arrays, so no kernel with a data-dependent loop can be interpreted
    (triton-lang/triton#9171, fixed upstream by #9172). Apply the upstream fix while these tests run."""
    if torch.cuda.is_available():
        yield
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_scalar_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_patch_lang_tensor", patch_tensor_with_scalar_index)
        yield


def paged_batch(
    prefills: list[tuple[int, int]] = (),
    decodes: list[int] = (),
    *,
    q_heads: int = 2,
    kv_heads: int = 2,
    head_dim: int = 16,
    value_dim: int | None = None,
    block_size: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple:
    """Arguments of one cached_attention call: ``prefills`` as (q_len, kv_len) chunks, each on top of
    ``kv_len - q_len`` cached tokens, then one-token ``decodes`` of the given kv lens. Blocks are handed out
    from a random permutation, so no sequence's blocks are contiguous; every slot that no sequence owns,
    and the block that padded table entries point to, holds NaN."""
    gen = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    value_dim = value_dim or head_dim
    q_lens = [q_len for q_len, _ in prefills] + [1] * len(decodes)
    kv_lens = [kv_len for _, kv_len in prefills] + list(decodes)
    blocks_per_seq = [-(-kv_len // block_size) for kv_len in kv_lens]
    num_blocks = sum(blocks_per_seq) + 2  # a spare and the padding block
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(q_lens), max(blocks_per_seq) + 1), int(order[-1]), dtype=torch.int32)
    taken = 0
    for s, count in enumerate(blocks_per_seq):
        block_tables[s, :count] = order[taken : taken + count]
        taken += count

    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, kv_heads, value_dim), float("nan"), dtype=dtype)
    new_slots = []
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        positions = torch.arange(kv_len)
        slots = block_tables[s, positions // block_size].long() * block_size + positions % block_size
        cached = slots[: kv_len - q_len]
        k_cache.view(-1, kv_heads, head_dim)[cached] = random(len(cached), kv_heads, head_dim)
        v_cache.view(-1, kv_heads, value_dim)[cached] = random(len(cached), kv_heads, value_dim)
        new_slots.append(slots[kv_len - q_len :])

    tokens = sum(q_lens)
    q = random(1, tokens, q_heads, head_dim)
    k, v = random(1, tokens, kv_heads, head_dim), random(1, tokens, kv_heads, value_dim)
    seq_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    batch_info = torch.tensor([len(prefills), len(decodes), max(q_lens), max(kv_lens)], dtype=torch.int32)
    kv_len_tensor = torch.tensor(kv_lens, dtype=torch.int32)
    on_device = (q, k, v, k_cache, v_cache, seq_start, kv_len_tensor, block_tables, torch.cat(new_slots))
    return (*(t.to(DEVICE) for t in on_device), batch_info, head_dim**-0.5)


def assert_matches_reference(
    args: tuple, *, atol: float = 1e-4, num_decode_splits: int | None = None, **options
) -> None:
    """Run the reference and the Triton backend on their own copies of the caches: outputs and written
    caches must agree. ``options`` (sliding_window, logit_cap, sinks) go to both."""
    q, k, v, k_cache, v_cache, *metadata = args
    expected_caches = (k_cache.clone(), v_cache.clone())
    expected = cached_attention_reference(q, k, v, *expected_caches, *metadata, **options)
    caches = (k_cache.clone(), v_cache.clone())
    got = cached_attention_triton(q, k, v, *caches, *metadata, **options, num_decode_splits=num_decode_splits)
    assert got.dtype == q.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    for written, expected_cache in zip(caches, expected_caches):
        torch.testing.assert_close(written, expected_cache, atol=0, rtol=0, equal_nan=True)


def test_single_prefill():
    assert_matches_reference(paged_batch([(7, 7)]))


def test_prefills_of_different_lengths():
    # 70 tokens: two query blocks, and key tiles that every query of a block sees (the unmasked path).
    assert_matches_reference(paged_batch([(5, 5), (19, 19), (1, 1), (70, 70)]))


def test_chunked_prefill_after_a_cached_prefix():
    # A later chunk or a prefix-cache hit: the chunk's queries start at kv_len - q_len.
    assert_matches_reference(paged_batch([(6, 150), (3, 12), (40, 41), (1, 9)]))


@pytest.mark.parametrize("num_decode_splits", [None, 1, 3, 5])
def test_decode_batch(num_decode_splits):
    # Five splits of 64 keys over at most 200: the last is empty for every sequence, and most are for short ones.
    assert_matches_reference(paged_batch(decodes=[1, 8, 17, 200]), num_decode_splits=num_decode_splits)


def test_a_batch_that_fits_in_one_wave_walks_its_keys_in_128_key_tiles(monkeypatch):
    # With every (sequence, kv head) one resident program, the decode kernel steps 128 keys at a time; a
    # sequence of 200 keys ends inside its second tile, one of 1 inside its first.
    from autodeploy.custom_ops.triton import paged_attention

    chosen = []
    config = paged_attention._decode_config
    monkeypatch.setattr(paged_attention, "_decode_config", lambda *a: chosen.append(config(*a)) or chosen[-1])
    monkeypatch.setattr(paged_attention, "_multiprocessors", lambda device: 64)  # the card holds 128 programs
    assert_matches_reference(paged_batch([(3, 12)], [1, 130, 200], q_heads=4, kv_heads=2), num_decode_splits=None)
    assert chosen == [(128, 4, 2)]


def test_short_sequences_take_fewer_splits_than_the_grid(monkeypatch):
    # The grid is sized for the longest sequence; the others spread only over what fills the card (one split
    # in the interpreter) and write their output themselves, while the longest cuts its keys at the most a
    # split may hold (64 here): one split for 5 keys, two for 70, five for 300, with sinks, with a window.
    from autodeploy.custom_ops.triton import paged_attention

    monkeypatch.setattr(paged_attention, "_MIN_KEYS_PER_SPLIT", 64)
    monkeypatch.setattr(paged_attention, "_MAX_KEYS_PER_SPLIT", 64)
    batch = paged_batch([(4, 9)], [5, 70, 300], q_heads=4, kv_heads=2)
    assert_matches_reference(batch, sinks=torch.randn(4, device=DEVICE))
    assert_matches_reference(batch, sliding_window=100)


def test_the_merge_takes_splits_a_few_at_a_time(monkeypatch):
    # The last split to arrive merges: here two splits a step (a tile of 2 heads x 2 splits x 16 dims), so
    # five splits take three steps, the last one half empty; with sinks, which the merge adds once.
    from autodeploy.custom_ops.triton import paged_attention

    monkeypatch.setattr(paged_attention, "_MERGE_TILE", 64)
    batch = paged_batch(decodes=[300, 70], q_heads=4, kv_heads=2)
    assert_matches_reference(batch, num_decode_splits=5, sinks=torch.randn(4, device=DEVICE))


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_decode_splits", [1, 2])
def test_mixed_batch_with_gqa(group, num_decode_splits):
    batch = paged_batch([(9, 9), (4, 90)], [33, 5, 130], q_heads=2 * group, kv_heads=2)
    assert_matches_reference(batch, num_decode_splits=num_decode_splits)


@pytest.mark.parametrize("window", [1, 5, 64, 1000])
def test_sliding_window(window):
    batch = paged_batch([(70, 70), (6, 150)], [200, 7], q_heads=4, kv_heads=2)
    assert_matches_reference(batch, sliding_window=window, num_decode_splits=3)


def test_logit_cap():
    batch = paged_batch([(20, 20), (5, 40)], [70, 3])
    q, *rest = batch
    assert_matches_reference((q * 4, *rest), logit_cap=2.5)  # larger logits, so the cap bites


@pytest.mark.parametrize("num_decode_splits", [1, 3])
def test_sinks(num_decode_splits):
    batch = paged_batch([(20, 20), (5, 40)], [150, 3], q_heads=4, kv_heads=2)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE)
    assert_matches_reference(batch, sinks=sinks, num_decode_splits=num_decode_splits)


@pytest.mark.parametrize("num_decode_splits", [1, 3])
def test_alibi(num_decode_splits):
    # Bloom's slopes for 4 heads; prefills long enough for unmasked tiles, decodes split over many keys.
    batch = paged_batch([(70, 70), (5, 40)], [150, 3], q_heads=4, kv_heads=2)
    assert_matches_reference(batch, alibi_slopes=[0.25, 0.0625, 0.015625, 0.00390625], num_decode_splits=num_decode_splits)


def test_alibi_with_a_window_and_gqa():
    batch = paged_batch([(13, 13), (9, 100)], [150, 2], q_heads=8, kv_heads=2, block_size=16)
    assert_matches_reference(batch, sliding_window=24, alibi_slopes=[0.5 ** (i + 1) for i in range(8)], num_decode_splits=2)


def test_window_cap_sinks_and_gqa_together():
    batch = paged_batch([(13, 13), (9, 100)], [150, 2], q_heads=8, kv_heads=2, block_size=16)
    sinks = torch.linspace(-2, 2, 8, device=DEVICE)
    assert_matches_reference(batch, sliding_window=24, logit_cap=3.0, sinks=sinks, num_decode_splits=2)


def distance_bias_for(batch: tuple, spare: int = 5, seed: int = 3) -> torch.Tensor:
    """A ``distance_bias [Hq, L]`` for ``batch`` (T5's decoder), ``L`` ``spare`` past its longest sequence, of the
    order of the logits: random by distance (T5's buckets repeat one value over runs of distances, which would hide an
    off-by-one), in q's dtype, its rows strided past ``L`` (a view of a wider table)."""
    q, batch_info = batch[0], batch[9]
    longest = int(batch_info[3])
    table = torch.randn(q.shape[2], longest + spare + 7, generator=torch.Generator().manual_seed(seed)) * 2
    return table.to(q.dtype).to(DEVICE)[:, : longest + spare]


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("num_decode_splits", [None, 1, 3])
def test_distance_bias_in_prefill_chunks_after_cached_prefixes_and_split_decodes(group, num_decode_splits):
    # Prompt chunks fresh (70 tokens: tiles every row sees, unmasked) and after cached prefixes, and decodes up to 200
    # keys, cut into three splits that the merge combines; GQA or not.
    batch = paged_batch([(70, 70), (6, 150), (1, 9)], [200, 7, 1], q_heads=2 * group, kv_heads=2)
    bias = distance_bias_for(batch)
    assert_matches_reference(batch, distance_bias=bias, num_decode_splits=num_decode_splits)
    q, k, v, k_cache, v_cache, *metadata = batch
    unbiased = cached_attention_reference(q, k, v, k_cache.clone(), v_cache.clone(), *metadata)
    biased = cached_attention_reference(q, k, v, k_cache.clone(), v_cache.clone(), *metadata, distance_bias=bias)
    moved = (biased - unbiased).abs().amax(dim=(0, 2, 3))
    assert moved[1:-1].min() > 1e-2 and moved[[0, -1]].max() == 0  # all but the tokens that see one key alone


def test_distance_bias_joins_the_logits_before_the_cap_beside_a_window_sinks_alibi_and_a_tree():
    batch = paged_batch([(13, 13), (9, 100)], [150, 2], q_heads=8, kv_heads=2, block_size=16)
    q, *rest = batch
    batch = (q * 4, *rest)  # larger logits, so the cap bites
    bias = distance_bias_for(batch)
    sinks = torch.linspace(-2, 2, 8, device=DEVICE)
    assert_matches_reference(batch, distance_bias=bias, sliding_window=24, logit_cap=3.0, sinks=sinks, num_decode_splits=2)
    assert_matches_reference(batch, distance_bias=bias, alibi_slopes=[0.5 ** (i + 1) for i in range(8)], num_decode_splits=2)
    tree = paged_batch([(5, 12)], [9], q_heads=4)
    rows = tree_rows([-1, 0, 0, 2, 1]) + [-1]
    assert_matches_reference(tree, distance_bias=distance_bias_for(tree), tree_mask=with_tree_mask(tree, rows))


def test_distance_bias_in_half_precision():
    batch = paged_batch([(20, 20), (5, 40)], [150, 3], q_heads=4, kv_heads=2, dtype=torch.float16)
    assert_matches_reference(batch, atol=2e-2, distance_bias=distance_bias_for(batch), num_decode_splits=2)


def test_distance_bias_is_added_to_logits_an_fp8_caches_k_scale_has_scaled(interpreter_rounds_to_fp8_correctly):
    q, k, v, k_cache, v_cache, *metadata = batch = paged_batch([(20, 20), (5, 40)], [150, 3], q_heads=4, kv_heads=2)
    fp8 = (k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn))
    options = dict(k_scale=0.25, v_scale=3.0, distance_bias=distance_bias_for(batch))
    expected = cached_attention_reference(q, k, v, *(c.clone() for c in fp8), *metadata, **options)
    got = cached_attention_triton(q, k, v, *(c.clone() for c in fp8), *metadata, **options, num_decode_splits=2)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("change, message, at_build", [
    (lambda bias, until: dict(distance_bias=bias[:3]), r"distance_bias must be \[Hq=4, L\] with contiguous rows", True),
    (lambda bias, until: dict(distance_bias=bias.t().contiguous().t()), "with contiguous rows", True),
    (lambda bias, until: dict(distance_bias=bias.double()), "distance_bias must be one of", True),
    (lambda bias, until: dict(distance_bias=bias, attend_until=until), r"cannot bias keys after it \(attend_until\)", True),
    # only batch_info knows the longest sequence: the launch checks it, supports() cannot
    (lambda bias, until: dict(distance_bias=bias[:, :11]), r"distance_bias must be \[Hq, L ≥ 12 \(the longest sequence\)\]", False),
], ids=["three heads of four", "strided distances", "float64", "beside attend_until", "shorter than a sequence"])
def test_a_distance_bias_the_kernels_cannot_read_is_refused(change, message, at_build):
    batch = paged_batch([(3, 12)], [9], q_heads=4)
    options = change(distance_bias_for(batch), torch.full((4,), -1, device=DEVICE))
    with pytest.raises(ValueError, match=message):
        cached_attention_triton(*batch, **options)
    backend = next(b for b in canonical_ops()["cached_attention"].backends if b.name == "triton")
    node = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in batch]
    until, bias = (options.get(name) for name in ("attend_until", "distance_bias"))
    verdict = backend.check([*node, None, None, None, None, 1.0, 1.0, None, until, bias.to("meta")], torch.device("cuda"))
    assert (verdict is not None and re.search(message, verdict) is not None) if at_build else verdict is None


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_gpu_for_bfloat16), torch.float16])
def test_half_precision(dtype):
    batch = paged_batch([(20, 20), (5, 40)], [150, 3], q_heads=4, kv_heads=2, dtype=dtype)
    assert_matches_reference(batch, atol=2e-2, sinks=torch.zeros(4, device=DEVICE), num_decode_splits=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="only the interpreter gets bfloat16 dots wrong")
def test_interpreter_refuses_bfloat16():
    with pytest.raises(ValueError, match="bfloat16"):
        cached_attention_triton(*paged_batch([(3, 3)], dtype=torch.bfloat16))


@pytest.mark.parametrize("head_dim, value_dim", [(80, 80), (32, 16), (16, 48)])
def test_head_dims(head_dim, value_dim):
    batch = paged_batch([(9, 20)], [30], head_dim=head_dim, value_dim=value_dim)
    assert_matches_reference(batch, num_decode_splits=2)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size):
    assert_matches_reference(paged_batch([(10, 45)], [70], block_size=block_size), num_decode_splits=2)


def test_strided_queries():
    # q, k and v as slices of one fused projection: their token and head strides are not their shapes'.
    q, k, v, *rest = paged_batch([(9, 20)], [30], q_heads=4, kv_heads=2)
    fused = torch.cat((q.flatten(2), k.flatten(2), v.flatten(2)), dim=-1)
    q, k, v = (part.unflatten(2, (-1, 16)) for part in fused.split([64, 32, 32], dim=-1))
    assert not q.is_contiguous()
    assert_matches_reference((q, k, v, *rest))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=512), "head dims up to 256"),
        (dict(block_size=12), "power of 2"),
        (dict(dtype=torch.float64), "dtype"),
    ],
)
def test_unsupported_inputs_raise(change, message):
    batch = paged_batch([(3, 3)], **change)
    with pytest.raises(ValueError, match=message):
        cached_attention_triton(*batch)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=512), "head dims up to 256"),
        (dict(block_size=12), "power of 2"),
        (dict(q_heads=3), "multiple of kv heads"),
    ],
)
def test_the_backend_refuses_at_build_what_its_launch_would_not_check(change, message):
    # The backend op launches without argument checks: its supports() must have refused the node already.
    backend = next(b for b in canonical_ops()["cached_attention"].backends if b.name == "triton")
    cuda = torch.device("cuda")  # what a GPU deploy passes; supports() reads only the meta tensors

    def as_meta(batch):
        return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in batch]

    assert message in backend.check(as_meta(paged_batch([(3, 3)], **change)), cuda)
    assert backend.check(as_meta(paged_batch([(3, 3)])), cuda) is None


def test_offered_as_a_backend_of_cached_attention():
    backend = next(b for b in canonical_ops()["cached_attention"].backends if b.name == "triton")
    q, k, v, k_cache, v_cache, *metadata = paged_batch([(5, 12)], [9])
    expected = cached_attention_reference(q, k, v, k_cache.clone(), v_cache.clone(), *metadata)
    torch.testing.assert_close(backend.fn(q, k, v, k_cache, v_cache, *metadata), expected, atol=1e-4, rtol=1e-4)


def tree_rows(parents: list[int]) -> list[int]:
    """A tree chunk's ``tree_mask`` rows: token ``i`` (parent ``parents[i]``, -1 for the root) sees its
    ancestors and itself."""
    rows: list[int] = []
    for i, parent in enumerate(parents):
        rows.append((rows[parent] if parent >= 0 else 0) | 1 << i)
    return rows


def random_tree(nodes: int, seed: int = 0) -> list[int]:
    """``tree_rows`` of a random tree: each token after the root hangs from an earlier one."""
    gen = torch.Generator().manual_seed(seed)
    return tree_rows([-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, nodes)])


def with_tree_mask(batch: tuple, rows: list[int]) -> torch.Tensor:
    """``rows`` (one per new token of ``batch``) as the op's ``tree_mask``."""
    assert len(rows) == batch[0].shape[1]
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("num_decode_splits", [1, 2])
def test_tree_chunks_see_their_ancestors_beside_prompt_chunks_and_decodes(num_decode_splits):
    # A prompt chunk, a tree chunk after a cached prefix (root, then nodes whose parents are 0, 0, 1, 2), a
    # tree chunk with nothing cached, and decodes: only the tree chunks' rows differ from causal attention.
    batch = paged_batch([(12, 12), (5, 40), (6, 6)], [33, 7], q_heads=4, kv_heads=2)
    trees = tree_rows([-1, 0, 0, 1, 2]) + tree_rows([-1, 0, 1, 1, 0, 4])
    tree_mask = with_tree_mask(batch, [-1] * 12 + trees + [-1] * 2)
    assert tree_mask[12:17].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10101]
    assert_matches_reference(batch, tree_mask=tree_mask, num_decode_splits=num_decode_splits)
    q, k, v, k_cache, v_cache, *metadata = batch
    causal = cached_attention_triton(q, k, v, k_cache.clone(), v_cache.clone(), *metadata)
    tree = cached_attention_triton(q, k, v, k_cache.clone(), v_cache.clone(), *metadata, tree_mask=tree_mask)
    differs = (tree - causal).abs().amax(dim=(0, 2, 3)) > 1e-3
    # Rows whose ancestors are all the tokens before them (a root, its first child, a chain) are causal rows.
    first_tree, second_tree = [False, False, True, True, True], [False, False, False, True, True, True]
    assert differs.tolist() == [False] * 12 + first_tree + second_tree + [False] * 2


def test_a_tree_mask_of_causal_rows_changes_nothing():
    batch = paged_batch([(9, 9), (40, 70), (5, 40)], [33, 7], q_heads=4, kv_heads=2)
    q, k, v, k_cache, v_cache, *metadata = batch
    causal = cached_attention_triton(q, k, v, k_cache.clone(), v_cache.clone(), *metadata)
    tree = cached_attention_triton(
        q, k, v, k_cache.clone(), v_cache.clone(), *metadata, tree_mask=with_tree_mask(batch, [-1] * q.shape[1])
    )
    torch.testing.assert_close(tree, causal)


@pytest.mark.parametrize("prefill_config", [None, (16, 16, 4, 3)], ids=["shipped", "16x16"])
def test_tiles_every_row_of_a_query_block_sees_still_take_a_tree_chunks_bits(prefill_config, monkeypatch):
    # Causally, a tile wholly before a query block's first row needs no mask; a tree chunk's keys in it still
    # do. Shipped (a 32-row query block over 64-key tiles): the chunk's first key (position 63) ends tile 0,
    # and rows 1 and 4 do not see it. 16 x 16: a 40-token random tree after 30 cached keys, whose third query
    # block (rows 32 … 39) reaches tiles 0 … 2 (chunk keys 0 … 17 among them) with every row.
    from autodeploy.custom_ops.triton import paged_attention

    if prefill_config is None:
        batch = paged_batch([(5, 68), (30, 30)], [9], q_heads=4, kv_heads=2)
        rows = [0b1, 0b10, 0b110, 0b1001, 0b10010] + [-1] * 30 + [-1]
    else:
        monkeypatch.setattr(paged_attention, "_prefill_config", lambda max_q_len, dim_pad: prefill_config)
        batch = paged_batch([(40, 70), (30, 30)], [9], q_heads=4, kv_heads=2)
        rows = random_tree(40) + [-1] * 30 + [-1]
    assert_matches_reference(batch, tree_mask=with_tree_mask(batch, rows), sinks=torch.randn(4, device=DEVICE))


def test_the_largest_tree_chunk_uses_bit_62():
    # 63 tokens over two 64-key tiles: the last row sees itself through bit 62.
    batch = paged_batch([(63, 100)], [20], q_heads=2, kv_heads=1)
    rows = random_tree(63, seed=3)
    assert rows[-1] >> 62 == 1
    assert_matches_reference(batch, tree_mask=with_tree_mask(batch, rows + [-1]))


def _tree_options(batch):
    return None, None, None, None, 1.0, 1.0, with_tree_mask(batch, tree_rows([-1, 0, 0, 2, 1]) + [-1])


def _attend_until_options(batch):
    return None, None, None, None, 1.0, 1.0, None, with_attend_until(batch, [[(2, 11)], [(8, 10)]])


@pytest.mark.parametrize("sequences, options", [
    ([(5, 12)], _tree_options),  # tree_mask last
    ([(20, 20), (6, 12)], _attend_until_options),  # attend_until after tree_mask
])
def test_the_backend_op_takes_its_masks_positionally_as_a_graph_calls_it(sequences, options):
    backend = next(b for b in canonical_ops()["cached_attention"].backends if b.name == "triton")
    q, k, v, k_cache, v_cache, *metadata = batch = paged_batch(sequences, [9])
    options = options(batch)
    expected = cached_attention_reference(q, k, v, k_cache.clone(), v_cache.clone(), *metadata, *options)
    got = backend.op(q, k, v, k_cache, v_cache, *metadata, *options)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_tree_mask_of_another_dtype_or_length_is_refused():
    # By the launch's checks, and at build by the backend's supports() on the node's meta tensors.
    batch = paged_batch([(3, 3)])
    backend = next(b for b in canonical_ops()["cached_attention"].backends if b.name == "triton")
    node = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in (*batch, None, None, None, None, 1.0, 1.0)]
    cuda = torch.device("cuda")
    for tree_mask in (torch.full((3,), -1, dtype=torch.int32), torch.full((4,), -1)):
        with pytest.raises(ValueError, match="tree_mask must be a contiguous int64"):
            cached_attention_triton(*batch, tree_mask=tree_mask.to(DEVICE))
        assert "tree_mask must be" in backend.check([*node, tree_mask.to("meta")], cuda)
    assert backend.check([*node, torch.full((3,), -1, device="meta")], cuda) is None


def new_positions(batch: tuple) -> list[tuple[int, int]]:
    """(sequence, absolute position) of each new token of ``batch``, in the row's order."""
    seq_start, kv_lens = batch[5].tolist(), batch[6].tolist()
    q_lens = [end - start for start, end in zip(seq_start, seq_start[1:])]
    return [(s, p) for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)) for p in range(kv_len - q_len, kv_len)]


def with_attend_until(batch: tuple, blocks: list[list[tuple[int, int]]]) -> torch.Tensor:
    """The op's ``attend_until`` for ``batch``: ``blocks[s]`` lists sequence ``s``'s bidirectional blocks as
    (first, last) absolute positions; a new token inside one names its last position, every other -1."""
    blocks = [*blocks, *[[]] * (len(batch[6]) - len(blocks))]
    rows = [next((last for first, last in blocks[s] if first <= p <= last), -1) for s, p in new_positions(batch)]
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


def with_prefill_config(monkeypatch, prefill_config) -> None:
    """``prefill_config`` (BLOCK_M, BLOCK_N, warps, stages) for every prefill launch; None keeps the shipped one."""
    if prefill_config is not None:
        from autodeploy.custom_ops.triton import paged_attention

        monkeypatch.setattr(paged_attention, "_prefill_config", lambda max_q_len, dim_pad: prefill_config)


@pytest.mark.parametrize("prefill_config", [None, (16, 16, 4, 3)], ids=["shipped", "16x16"])
def test_bidirectional_blocks_see_to_their_end_beside_causal_chunks_and_decodes(prefill_config, monkeypatch):
    # A prompt chunk with one block (5 … 17: across a 16-key tile and a 16-row query block, so rows 5 … 15 reach
    # a tile past their own); one with two (the second, 16 … 47, holds whole 16-row query blocks, which see tiles
    # 0 … 2 unmasked); a chunk after 28 cached tokens that starts inside a block (24 … 33) and holds another;
    # a one-token chunk and a decode naming their own positions, and a causal decode. GQA: 2 query heads a kv head.
    with_prefill_config(monkeypatch, prefill_config)
    batch = paged_batch([(30, 30), (50, 50), (12, 40), (1, 9)], [33, 7], q_heads=4, kv_heads=2)
    blocks = [[(5, 17)], [(3, 10), (16, 47)], [(24, 33), (36, 38)], [(8, 8)], [(32, 32)]]
    attend_until = with_attend_until(batch, blocks)
    assert attend_until[80:92].tolist() == [33] * 6 + [-1, -1, 38, 38, 38, -1]
    assert_matches_reference(batch, attend_until=attend_until, num_decode_splits=2)
    q, k, v, k_cache, v_cache, *metadata = batch
    causal = cached_attention_triton(q, k, v, k_cache.clone(), v_cache.clone(), *metadata)
    bidirectional = cached_attention_triton(
        q, k, v, k_cache.clone(), v_cache.clone(), *metadata, attend_until=attend_until
    )
    # Exactly the rows that see past themselves change: every row of a block but its last.
    differs = (bidirectional - causal).abs().amax(dim=(0, 2, 3)) > 1e-3
    assert differs.tolist() == [until > p for until, (_, p) in zip(attend_until.tolist(), new_positions(batch))]
    assert sum(differs.tolist()) == 12 + 7 + 31 + 5 + 2


@pytest.mark.parametrize("prefill_config", [None, (16, 16, 4, 3)], ids=["shipped", "16x16"])
def test_a_window_shorter_than_a_block_still_counts_back_from_each_rows_own_position(prefill_config, monkeypatch):
    # Window 5 inside blocks of 27 and 13 tokens: a row sees keys p - 4 … the block's end, so the window's
    # lower bound and the block's upper bound both cut the same rows' tiles. 4 query heads a kv head.
    with_prefill_config(monkeypatch, prefill_config)
    batch = paged_batch([(40, 40), (20, 60)], [70], q_heads=8, kv_heads=2, block_size=16)
    attend_until = with_attend_until(batch, [[(4, 30)], [(45, 57)]])
    assert_matches_reference(batch, attend_until=attend_until, sliding_window=5, sinks=torch.randn(8, device=DEVICE))


def test_attend_until_naming_each_rows_own_position_changes_nothing():
    # Every new token, decodes included, naming its own position (or -1) is causal attention.
    batch = paged_batch([(9, 9), (40, 70), (1, 12)], [33, 7], q_heads=4, kv_heads=2)
    q, k, v, k_cache, v_cache, *metadata = batch
    attend_until = torch.tensor([p if p % 3 else -1 for _, p in new_positions(batch)], device=DEVICE)
    causal = cached_attention_triton(q, k, v, k_cache.clone(), v_cache.clone(), *metadata)
    own = cached_attention_triton(q, k, v, k_cache.clone(), v_cache.clone(), *metadata, attend_until=attend_until)
    torch.testing.assert_close(own, causal)


def test_an_attend_until_of_another_dtype_or_length_is_refused():
    # By the launch's checks, and at build by the backend's supports() on the node's meta tensors.
    batch = paged_batch([(3, 3)])
    backend = next(b for b in canonical_ops()["cached_attention"].backends if b.name == "triton")
    options = (None, None, None, None, 1.0, 1.0, None)  # … k_scale, v_scale, tree_mask
    node = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in (*batch, *options)]
    cuda = torch.device("cuda")
    for attend_until in (torch.full((3,), -1, dtype=torch.int32), torch.full((4,), -1)):
        with pytest.raises(ValueError, match="attend_until must be a contiguous int64"):
            cached_attention_triton(*batch, attend_until=attend_until.to(DEVICE))
        assert "attend_until must be" in backend.check([*node, attend_until.to("meta")], cuda)
    assert backend.check([*node, torch.full((3,), -1, device="meta")], cuda) is None


@gpu_only
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_tree_chunks_at_production_shapes(head_dim, block_size):
    # Long prompt chunks beside tree chunks of 20 and 63 tokens after long cached prefixes, and decodes.
    batch = paged_batch(
        [(300, 300), (20, 1100), (63, 1500), (1, 40)], [5000, 37, 1], q_heads=32, kv_heads=8,
        head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
    )
    rows = [-1] * 300 + random_tree(20, seed=1) + random_tree(63, seed=2) + [-1] * 4
    assert_matches_reference(batch, atol=2e-2, tree_mask=with_tree_mask(batch, rows))


@gpu_only
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("sliding_window", [None, 512])
def test_bidirectional_blocks_at_production_shapes(head_dim, sliding_window):
    # Gemma 3's images: 256-token blocks in a long prompt and in a chunk after a cached prefix that starts inside
    # one, beside a causal prompt and decodes; with a window longer than a block (a local layer's) or none.
    batch = paged_batch(
        [(1100, 1100), (300, 1500), (64, 64)], [5000, 37, 1], q_heads=16, kv_heads=8,
        head_dim=head_dim, block_size=16, dtype=torch.bfloat16,
    )
    attend_until = with_attend_until(batch, [[(10, 265), (600, 855)], [(1100, 1355), (1240, 1495)]])
    assert_matches_reference(batch, atol=2e-2, attend_until=attend_until, sliding_window=sliding_window)


@gpu_only
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_production_shapes(head_dim, block_size):
    # Long contexts with few decodes: the split count comes from the heuristic (several splits here).
    batch = paged_batch(
        [(300, 300), (128, 1100), (1, 40)], [5000, 37, 1], q_heads=16, kv_heads=4,
        head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
    )
    sinks = torch.randn(16, device=DEVICE)
    assert_matches_reference(batch, atol=2e-2)
    assert_matches_reference(batch, atol=2e-2, sliding_window=512, sinks=sinks)
    # Enough decodes to fill the card without splitting: the short ones keep to one split, the long one
    # still cuts its keys at _MAX_KEYS_PER_SPLIT.
    batch = paged_batch(
        [(64, 64)], [5000, 37, 1] + [150] * 80, q_heads=16, kv_heads=4,
        head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
    )
    assert_matches_reference(batch, atol=2e-2, sinks=sinks)


@gpu_only
def test_a_one_wave_decode_batch_at_production_shapes(monkeypatch):
    # As many (sequence, kv head) programs as the card holds at once (B = 33 on an H200): 128-key tiles,
    # short sequences and one past _MAX_KEYS_PER_SPLIT.
    from autodeploy.custom_ops.triton import paged_attention

    chosen = []
    config = paged_attention._decode_config
    monkeypatch.setattr(paged_attention, "_decode_config", lambda *a: chosen.append(config(*a)) or chosen[-1])
    decodes = 2 * torch.cuda.get_device_properties(0).multi_processor_count // 8
    lengths = [2500] + [190 + (i * 7) % 40 for i in range(decodes - 1)]
    batch = paged_batch([], lengths, q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert_matches_reference(batch, atol=2e-2)
    assert chosen == [(128, 4, 2)]


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distance_bias_at_production_shapes(dtype):
    # T5-base's decoder (12 heads of 64): a long prompt chunk after a cached prefix, and decodes up to 3000 keys beside
    # enough short ones to fill the card, the splits as the launch picks them.
    batch = paged_batch([(513, 700), (1, 40)], [3000, 37, 1] + [150] * 40, q_heads=12, kv_heads=12, head_dim=64,
                        block_size=16, dtype=dtype)
    assert_matches_reference(batch, atol=1e-4 if dtype == torch.float32 else 2e-2, distance_bias=distance_bias_for(batch))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_production_dtypes(dtype):
    batch = paged_batch(
        [(513, 700)], [3000, 4000, 10], q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=dtype
    )
    assert_matches_reference(batch, atol=1e-4 if dtype == torch.float32 else 2e-2, logit_cap=30.0)


@pytest.mark.parametrize(("num_decode_splits", "scales"), [(None, (1.0, 1.0)), (2, (1.0, 1.0)), (2, (0.25, 3.0))])
def test_fp8_caches_store_saturated_values_and_attend_over_them_read_back(num_decode_splits, scales,
                                                                          interpreter_rounds_to_fp8_correctly):
    # quantize.kv_cache: fp8. Some new keys and values lie past ±448 · scale and must saturate, in both backends alike.
    q, k, v, k_cache, v_cache, *metadata = paged_batch([(20, 20), (5, 40)], [150, 3], q_heads=4, kv_heads=2)
    q, k, v = q * 0.01, k * 200, v * 200  # logits of order 1 over keys of order 200
    fp8 = (k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn))
    options = dict(k_scale=scales[0], v_scale=scales[1])
    expected_caches = tuple(c.clone() for c in fp8)
    expected = cached_attention_reference(q, k, v, *expected_caches, *metadata, **options)
    caches = tuple(c.clone() for c in fp8)
    got = cached_attention_triton(q, k, v, *caches, *metadata, **options, num_decode_splits=num_decode_splits)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)
    for written, want in zip(caches, expected_caches):
        assert written.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(written.float(), want.float(), atol=0, rtol=0, equal_nan=True)
    assert expected_caches[0].float().nan_to_num().abs().max() == 448  # saturated, not infinite or NaN


def _bfloat16_queries_over_fp8_caches(prefills, decodes, q_multiplier=1.0):
    # The reference attends and writes this step's keys and values into the caches; the Triton kernels then
    # attend over the caches it wrote (attend_over_cache: the interpreter cannot run the bfloat16 write).
    q, k, v, k_cache, v_cache, seq_start, kv_lens, tables, slots, info, scale = paged_batch(
        prefills, decodes, q_heads=4, kv_heads=2, dtype=torch.bfloat16)
    caches = (k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn))
    expected = cached_attention_reference(q * q_multiplier, k, v, *caches, seq_start, kv_lens, tables, slots, info, scale)
    return expected, lambda **options: attend_over_cache(
        (q * q_multiplier)[0], *caches, seq_start, kv_lens, tables, info, scale, **options)


@pytest.mark.parametrize("num_decode_splits", [None, 2])
def test_bfloat16_queries_attend_over_fp8_caches_in_float16(num_decode_splits, interpreter_rounds_to_fp8_correctly):
    # bfloat16 queries against fp8 caches: both dots run in float16 (paged_attention.FP8_IN_F16), prefill
    # and decode rows alike, to the reference's result over the same caches within bfloat16's rounding.
    expected, attend = _bfloat16_queries_over_fp8_caches([(12, 20)], [150, 3])
    got = attend(num_decode_splits=num_decode_splits)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_bfloat16_queries_past_float16s_range_saturate_instead_of_turning_the_output_into_nan(
        interpreter_rounds_to_fp8_correctly):
    _, attend = _bfloat16_queries_over_fp8_caches([], [40, 9], q_multiplier=1e6)  # |q| ~ 1e6: infinite in float16
    assert attend().isfinite().all()


def test_alibi_with_a_logit_cap_is_refused_where_the_kernels_would_differ_from_the_reference():
    q, k, v, k_cache, v_cache, *_ = paged_batch(decodes=[5])
    with pytest.raises(ValueError, match="ALiBi slopes with a logit_cap"):
        check_supported(q, k, v, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32), None, 30.0, None, [0.5, 0.25],
                        device=q.device)
