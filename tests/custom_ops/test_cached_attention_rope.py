"""cached_attention_rope: its reference is rope's and cached_attention's references composed; the Triton
backend (rotation inside the cache write, or inside the decode kernel for a batch of decodes alone, through
Triton's interpreter on the CPU) and the SDPA backend against it, on prefill/decode batches whose caches
hold NaN wherever no sequence owns a slot."""

from __future__ import annotations

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import canonical_ops
from autodeploy.custom_ops.cached_attention import cached_attention_reference
from autodeploy.custom_ops.cached_attention_rope import cached_attention_rope_reference, cached_attention_rope_sdpa
from autodeploy.custom_ops.rope import rope_reference
from autodeploy.custom_ops.triton import paged_attention_rope
from autodeploy.custom_ops.triton.paged_attention import attend_over_cache
from autodeploy.custom_ops.triton.paged_attention_rope import cached_attention_rope_triton
from tests.custom_ops.test_paged_attention_triton import (  # noqa: F401  (the fixture applies to these tests too)
    DEVICE,
    distance_bias_for,
    gpu_only,
    interpreter_loops_with_numpy_2_4,
    paged_batch,
    tree_rows,
    with_attend_until,
    with_tree_mask,
)


def angles(tokens: int, rotary_dim: int, interleaved: bool, dtype=torch.float32, seed: int = 1):
    """``cos``/``sin [1, T, R]`` in rope's layout: halves repeated (rotate-half) or pairs (interleaved)."""
    theta = torch.rand(1, tokens, rotary_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    theta = theta.repeat_interleave(2, dim=-1) if interleaved else theta.repeat(1, 1, 2)
    return theta.cos().to(dtype).to(DEVICE), theta.sin().to(dtype).to(DEVICE)


def with_angles(batch: tuple, rotary_dim: int | None = None, interleaved: bool = False) -> tuple:
    """``paged_batch``'s cached_attention arguments → cached_attention_rope's."""
    q, k, v, *rest = batch
    cos, sin = angles(q.shape[1], rotary_dim or q.shape[-1], interleaved, q.dtype)
    return (q, k, v, cos, sin, interleaved, *rest)


def run(kernel, args: tuple, **options):
    """The kernel's output and the caches it wrote, on its own copies of them."""
    q, k, v, cos, sin, interleaved, k_cache, v_cache, *metadata = args
    caches = (k_cache.clone(), v_cache.clone())
    return kernel(q, k, v, cos, sin, interleaved, *caches, *metadata, **options), caches


def assert_matches_reference(kernel, args: tuple, *, atol: float = 1e-4, launch=None, **options) -> None:
    """``kernel`` against the reference on ``args``; ``options`` (sliding_window, …) go to both, ``launch`` to
    the kernel only."""
    expected, expected_caches = run(cached_attention_rope_reference, args, **options)
    got, caches = run(kernel, args, **options, **(launch or {}))
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    for written, want in zip(caches, expected_caches):  # the rotated keys, the values, and NaN everywhere else
        torch.testing.assert_close(written, want, atol=atol, rtol=atol, equal_nan=True)


@pytest.mark.parametrize("rotary_dim, interleaved", [(16, False), (8, True)])
def test_the_reference_is_rope_then_cached_attention(rotary_dim, interleaved):
    args = with_angles(paged_batch([(5, 9)], [4, 12], q_heads=4), rotary_dim, interleaved)
    q, k, v, cos, sin, _, k_cache, v_cache, *metadata = args
    caches = (k_cache.clone(), v_cache.clone())
    expected = cached_attention_reference(
        rope_reference(q, cos, sin, interleaved), rope_reference(k, cos, sin, interleaved), v, *caches, *metadata
    )
    got, written = run(cached_attention_rope_reference, args)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    for ours, theirs in zip(written, caches):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0, equal_nan=True)


@pytest.fixture
def rope_write_launches(monkeypatch) -> list:
    """The grids the rope/write kernel is launched over while the test runs (it still runs)."""
    grids = []
    kernel = paged_attention_rope._rope_write_kv_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(paged_attention_rope, "_rope_write_kv_kernel", Recorder())
    return grids


@pytest.mark.parametrize("num_decode_splits", [1, 3])
def test_triton_mixed_batch_with_gqa(num_decode_splits, rope_write_launches):
    # Prompt chunks (one after a cached prefix) and decodes; 2 query heads per kv head. With prefills in the
    # batch, the rope/write kernel rotates and writes all 16 new tokens before attention.
    args = with_angles(paged_batch([(9, 9), (4, 40)], [33, 5, 70], q_heads=4, kv_heads=2))
    assert_matches_reference(cached_attention_rope_triton, args, launch=dict(num_decode_splits=num_decode_splits))
    assert rope_write_launches == [(16, 2)]


def test_triton_tree_chunk_after_a_cached_prefix(rope_write_launches):
    # The attention kernels take the op's tree_mask: a prompt chunk, a tree chunk (parents -1, 0, 0, 1, 2) and
    # decodes, against the reference, through the backend op as a graph calls it (every argument positional).
    batch = paged_batch([(9, 9), (5, 40)], [33, 5], q_heads=4, kv_heads=2)
    tree_mask = with_tree_mask(batch, [-1] * 9 + tree_rows([-1, 0, 0, 1, 2]) + [-1] * 2)
    args = with_angles(batch)
    assert_matches_reference(cached_attention_rope_triton, args, tree_mask=tree_mask)
    options = (None, None, None, None, 1.0, 1.0, tree_mask)
    expected, _ = run(cached_attention_rope_reference, (*args, *options))
    got, _ = run(backend("triton").op, (*args, *options))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert rope_write_launches == [(16, 2), (16, 2)]


def test_triton_bidirectional_blocks_after_a_cached_prefix(rope_write_launches):
    # The attention kernels take the op's attend_until: a prompt chunk with a block, a chunk after 30 cached tokens
    # that starts inside a block (26 … 35) and decodes, against the reference and through the backend op as a graph
    # calls it (every argument positional, attend_until last); then decodes alone, naming their own positions
    # (the decode kernel rotates), and supports() refusing int32 rows.
    batch = paged_batch([(20, 20), (9, 39)], [33, 5], q_heads=4, kv_heads=2)
    attend_until = with_attend_until(batch, [[(3, 14)], [(26, 35)]])
    args = with_angles(batch)
    assert_matches_reference(cached_attention_rope_triton, args, attend_until=attend_until)
    options = (None, None, None, None, 1.0, 1.0, None, attend_until)
    expected, _ = run(cached_attention_rope_reference, (*args, *options))
    got, _ = run(backend("triton").op, (*args, *options))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    causal, _ = run(cached_attention_rope_triton, args)
    assert not torch.allclose(got[:, 3:14], causal[:, 3:14], atol=1e-3)
    assert rope_write_launches == [(31, 2)] * 3
    decodes = with_angles(paged_batch(decodes=[33, 5], q_heads=4, kv_heads=2))
    assert_matches_reference(cached_attention_rope_triton, decodes, attend_until=torch.tensor([32, 4], device=DEVICE))
    assert rope_write_launches == [(31, 2)] * 3
    node, cuda = [*as_meta(args), None, None, None, None, 1.0, 1.0, None], torch.device("cuda")
    assert "attend_until must be" in backend("triton").check([*node, attend_until.to("meta", torch.int32)], cuda)
    assert backend("triton").check([*node, attend_until.to("meta")], cuda) is None


@pytest.mark.parametrize("num_decode_splits", [1, 3])
def test_triton_distance_bias_with_and_without_the_rope_write_kernel(num_decode_splits, rope_write_launches):
    # A relative position bias (cached_attention's distance_bias) in a mixed batch (the rope/write kernel, then the
    # prefill and decode kernels) and in decodes alone (the decode kernel rotates), through the backend op as a graph
    # calls it (distance_bias by name).
    batch = paged_batch([(9, 9), (4, 40)], [33, 5, 70], q_heads=4, kv_heads=2)
    args, launch = with_angles(batch), dict(num_decode_splits=num_decode_splits)
    assert_matches_reference(cached_attention_rope_triton, args, launch=launch, distance_bias=distance_bias_for(batch))
    decodes = paged_batch(decodes=[1, 9, 70, 150], q_heads=4, kv_heads=2)
    bias = distance_bias_for(decodes)
    assert_matches_reference(cached_attention_rope_triton, with_angles(decodes), launch=launch, distance_bias=bias)
    assert rope_write_launches == [(16, 2)]
    expected, _ = run(cached_attention_rope_reference, with_angles(decodes), distance_bias=bias)
    got, _ = run(backend("triton").op, with_angles(decodes), distance_bias=bias)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    node = [*as_meta(with_angles(decodes)), None, None, None, None, 1.0, 1.0, None, None, bias.to("meta")]
    assert backend("triton").check(node, torch.device("cuda")) is None


def first_decode_as_a_prefill(args: tuple) -> tuple:
    """A decode-only batch's arguments with batch_info calling its first decode a one-token prefill: the
    same attention, through the rope/write kernel and the prefill kernel."""
    *rest, batch_info, scale = args
    _, num_decode, _, max_kv_len = batch_info.tolist()
    return (*rest, torch.tensor([1, num_decode - 1, 1, max_kv_len], dtype=torch.int32), scale)


def assert_decode_kernel_rotates_as_the_write_kernel(
    args: tuple, rope_write_launches: list, *, atol: float, num_decode_splits: int, **options
) -> None:
    """A decode-only batch (no rope/write launch) against the reference, and its caches bit for bit against
    those the rope/write kernel writes. ``options`` (the fp8 scales) go to the reference too."""
    expected, _ = run(cached_attention_rope_reference, args, **options)
    got, caches = run(cached_attention_rope_triton, args, **options, num_decode_splits=num_decode_splits)
    assert rope_write_launches == []
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    _, written_by_write_kernel = run(
        cached_attention_rope_triton, first_decode_as_a_prefill(args), **options, num_decode_splits=num_decode_splits
    )
    assert rope_write_launches == [(args[0].shape[1], 2)]
    for written, want in zip(caches, written_by_write_kernel):
        torch.testing.assert_close(written.view(torch.uint8), want.view(torch.uint8), atol=0, rtol=0)


@pytest.mark.parametrize("num_decode_splits", [1, 2, 3])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize(
    "head_dim, rotary_dim, interleaved, q_heads",
    [
        (16, 16, False, 4),  # 2 query heads per kv head
        (32, 12, True, 6),  # 3 per kv head (of a 16-row tile), 6 pairs interleaved, dims 12 … 31 passed through
    ],
)
def test_triton_decode_batch_rotates_inside_the_decode_kernel(
    num_decode_splits, dtype, atol, head_dim, rotary_dim, interleaved, q_heads, rope_write_launches
):
    # Decodes of 1 to 150 keys: over 3 splits of 64 keys the newest key lies in split 0, 1 or 2, and every
    # used split of a (sequence, kv head) rotates the same query heads.
    batch = paged_batch(decodes=[1, 9, 70, 150], q_heads=q_heads, kv_heads=2, head_dim=head_dim, dtype=dtype)
    assert_decode_kernel_rotates_as_the_write_kernel(
        with_angles(batch, rotary_dim, interleaved), rope_write_launches, atol=atol, num_decode_splits=num_decode_splits
    )


@pytest.mark.parametrize(
    "head_dim, rotary_dim, interleaved, q_heads",
    [
        (24, 24, False, 6),  # 12 pairs of a 16-wide tile, and 6 of 8 query heads: masked pairs and heads
        (24, 24, True, 3),
        (20, 8, False, 3),  # partial rotary: dims 8 … 19 pass through (a 16-wide tile, 12 of it used)
        (20, 12, True, 3),
    ],
)
def test_triton_head_dims_partial_and_interleaved_rotary(head_dim, rotary_dim, interleaved, q_heads):
    batch = paged_batch([(6, 6)], [11, 3], q_heads=q_heads, kv_heads=3 if q_heads == 3 else 2, head_dim=head_dim)
    assert_matches_reference(cached_attention_rope_triton, with_angles(batch, rotary_dim, interleaved))


def test_triton_strided_qkv_and_one_broadcast_angle_row():
    # q, k and v as slices of one fused projection, and the same angles for every token (cos/sin [1, 1, R]).
    q, k, v, *rest = paged_batch([(5, 7)], [9], q_heads=4, kv_heads=2)
    fused = torch.cat((q.flatten(2), k.flatten(2), v.flatten(2)), dim=-1)
    q, k, v = (part.unflatten(2, (-1, 16)) for part in fused.split([64, 32, 32], dim=-1))
    cos, sin = angles(1, 16, False)
    assert not q.is_contiguous()
    assert_matches_reference(cached_attention_rope_triton, (q, k, v, cos, sin, False, *rest))


def test_triton_half_precision():
    batch = paged_batch([(7, 12)], [20, 3], q_heads=4, kv_heads=2, dtype=torch.float16)
    assert_matches_reference(cached_attention_rope_triton, with_angles(batch), atol=2e-2, launch=dict(num_decode_splits=2))


def test_only_a_batch_without_prefills_takes_the_decode_kernels_rotation():
    # With prefills in the batch, their queries would be left unrotated: refused before any launch.
    q, _, _, k_cache, v_cache, seq_start, kv_lens, block_tables, _, batch_info, scale = paged_batch([(3, 3)], [5])
    with pytest.raises(ValueError, match="needs a batch without prefills"):
        attend_over_cache(q[0], k_cache, v_cache, seq_start, kv_lens, block_tables, batch_info, scale, rope={})


@gpu_only
@pytest.mark.parametrize("head_dim, rotary_dim, interleaved", [(128, 128, False), (128, 64, False), (64, 64, True), (256, 256, False)])
def test_triton_production_shapes(head_dim, rotary_dim, interleaved, rope_write_launches):
    batch = paged_batch(
        [(300, 300), (128, 1100), (1, 40)], [5000, 37, 1], q_heads=32, kv_heads=8, head_dim=head_dim,
        block_size=32, dtype=torch.bfloat16,
    )
    assert_matches_reference(cached_attention_rope_triton, with_angles(batch, rotary_dim, interleaved), atol=2e-2)
    # Decodes alone, the decode kernel rotating: a long one over several splits, and enough short ones to
    # fill the card.
    batch = paged_batch(
        [], [5000, 37, 1] + [150] * 80, q_heads=32, kv_heads=8, head_dim=head_dim, block_size=32, dtype=torch.bfloat16
    )
    assert_matches_reference(cached_attention_rope_triton, with_angles(batch, rotary_dim, interleaved), atol=2e-2)
    assert rope_write_launches == [(432, 2)]  # the mixed batch's 432 new tokens only


def test_sdpa_backend_matches_the_reference():
    args = with_angles(paged_batch([(6, 6), (3, 10)], [7, 2], q_heads=4, kv_heads=2), 8, True)
    assert_matches_reference(cached_attention_rope_sdpa, args, sliding_window=5)


def backend(name: str):
    return next(b for b in canonical_ops()["cached_attention_rope"].backends if b.name == name)


def as_meta(args: tuple) -> list:
    return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]


def meta_node(head_dim: int = 16, rotary_dim: int = 16, angle_shape=None, angle_dtype=torch.float32) -> list:
    """A node's arguments as supports() sees them: meta tensors."""
    q, k, v, *rest = paged_batch([(3, 3)], head_dim=head_dim)
    theta = torch.zeros(angle_shape or (1, q.shape[1], rotary_dim), dtype=angle_dtype)
    return as_meta((q, k, v, theta, theta, False, *rest))


@pytest.mark.parametrize(
    "node, message",
    [
        (dict(rotary_dim=5), "rotary dim R=5 must be even"),
        (dict(rotary_dim=32), "at most D=16"),
        (dict(angle_dtype=torch.float64), "cos and sin must share one dtype"),
        (dict(angle_shape=(2, 3, 16)), "must both be [1, T or 1, R]"),
        (dict(head_dim=512, rotary_dim=512), "head dims up to 256"),
    ],
)
def test_triton_supports_refuses_at_build_what_the_kernel_cannot_take(node, message):
    # The backend launches without checks: supports() on the node's meta tensors must refuse these.
    cuda = torch.device("cuda")
    assert message in backend("triton").check(meta_node(**node), cuda)
    assert backend("triton").check(meta_node(rotary_dim=6), cuda) is None  # partial, an odd number of pairs
    assert "CUDA device" in backend("triton").check(meta_node(), torch.device("cpu"))


def test_sdpa_supports_refuses_sinks_and_soft_capping():
    args = as_meta(with_angles(paged_batch([(3, 3)])))
    cpu = torch.device("cpu")
    assert backend("sdpa").check(args, cpu) is None
    assert "soft-capping or sinks" in backend("sdpa").check([*args, None, 30.0], cpu)
    assert [b.name for b in canonical_ops()["cached_attention_rope"].backends] == ["triton", "sdpa", "invariant"]
    assert not backend("sdpa").capturable and backend("triton").capturable


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.5)])
@pytest.mark.parametrize("kernel", [cached_attention_rope_triton, cached_attention_rope_sdpa], ids=["triton", "sdpa"])
def test_fp8_caches_hold_the_rotated_keys_and_the_values(kernel, scales, interpreter_rounds_to_fp8_correctly):
    q, k, v, cos, sin, interleaved, k_cache, v_cache, *metadata = with_angles(
        paged_batch([(9, 9), (4, 40)], [33, 5], q_heads=4, kv_heads=2))
    args = (q, k, v, cos, sin, interleaved, k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn), *metadata)
    options = dict(k_scale=scales[0], v_scale=scales[1])
    expected, expected_caches = run(cached_attention_rope_reference, args, **options)
    got, caches = run(kernel, args, **options)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    for written, want in zip(caches, expected_caches):
        assert written.dtype == torch.float8_e4m3fn
        # A rotated key a last float32 bit from a rounding boundary may land one fp8 step over: rare.
        differ = ~(written.float().nan_to_num(7.0) == want.float().nan_to_num(7.0))
        assert differ.float().mean() < 0.01


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.5)])
def test_fp8_caches_of_a_decode_batch_hold_what_the_write_kernel_writes(
    scales, rope_write_launches, interpreter_rounds_to_fp8_correctly
):
    # The decode kernel's key and value writes go through the same saturating fp8 store, times 1 / scale.
    q, k, v, cos, sin, interleaved, k_cache, v_cache, *metadata = with_angles(
        paged_batch(decodes=[5, 70, 33], q_heads=4, kv_heads=2), 8, True)
    args = (q, k, v, cos, sin, interleaved, k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn), *metadata)
    assert_decode_kernel_rotates_as_the_write_kernel(
        args, rope_write_launches, atol=1e-3, k_scale=scales[0], v_scale=scales[1], num_decode_splits=2
    )
