"""The canonical causal ``attention`` in its packed form (``seq_start``): texts of one row, each causal within itself — a
decoder embedding model's graph (transforms/pack_bidirectional_attention.py) — and its ``varlen`` backend on a GPU."""

from __future__ import annotations

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401

LENGTHS = [5, 1, 0, 9, 3]


def _packed(lengths, heads=4, kv_heads=2, dim=16, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(1, total, h, dim, generator=generator).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, starts


def _each_alone(q, k, v, starts, **options):
    rows = []
    for first, last in zip(starts[:-1].tolist(), starts[1:].tolist()):
        if last > first:
            rows.append(torch.ops.autodeploy.attention(q[:, first:last], k[:, first:last], v[:, first:last], 0.25, **options))
    return torch.cat(rows, dim=1)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 3}, {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}])
def test_packed_texts_attend_causally_each_to_itself(options):
    q, k, v, starts = _packed(LENGTHS)
    packed = torch.ops.autodeploy.attention(q, k, v, 0.25, **options, seq_start=starts)
    torch.testing.assert_close(packed, _each_alone(q, k, v, starts, **options), atol=1e-6, rtol=1e-6)


def test_one_text_changed_leaves_the_others_alone():
    q, k, v, starts = _packed([4, 6])
    before = torch.ops.autodeploy.attention(q, k, v, 0.25, seq_start=starts)
    k2 = k.clone()
    k2[:, 4:] += 1.0
    after = torch.ops.autodeploy.attention(q, k2, v, 0.25, seq_start=starts)
    torch.testing.assert_close(after[:, :4], before[:, :4])
    assert not torch.allclose(after[:, 4:], before[:, 4:])


@pytest.mark.parametrize("starts", [[1, 4], [0, 3], [0, 3, 2, 4], [0]])
def test_malformed_starts_are_refused(starts):
    q, k, v, _ = _packed([4])
    with pytest.raises(ValueError, match="seq_start must be the non-decreasing starts"):
        torch.ops.autodeploy.attention(q, k, v, 0.25, seq_start=torch.tensor(starts, dtype=torch.int32))


def test_the_varlen_backend_refuses_what_it_cannot_compute():
    supports = [b for b in autodeploy.custom_ops.registry.canonical_ops()["attention"].backends if b.name == "varlen"][0].supports
    q, k, v, starts = _packed([4], dtype=torch.bfloat16)
    assert "CUDA" in supports(q, k, v, 0.25, seq_start=starts, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 3])
def test_gpu_varlen_backend_equals_the_reference(window):
    q, k, v, starts = _packed(LENGTHS, dtype=torch.bfloat16, device="cuda")
    reason = [b for b in autodeploy.custom_ops.registry.canonical_ops()["attention"].backends if b.name == "varlen"][0].supports(
        q, k, v, 0.25, window, seq_start=starts, device="cuda")
    if reason is not True:
        pytest.skip(reason)
    got = torch.ops.autodeploy.attention_varlen(q, k, v, 0.25, window, seq_start=starts)
    want = torch.ops.autodeploy.attention(q, k, v, 0.25, window, seq_start=starts)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
