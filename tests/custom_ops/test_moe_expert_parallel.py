"""``moe_expert_parallel`` with one rank (no process group): ``moe``'s reference over the experts in the placement's
order. Two ranks (all-to-all, uneven and empty shares): ``tests/distributed/test_expert_parallel.py``."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

ops = torch.ops.autodeploy


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(0, 7),
    experts=st.integers(1, 6),
    data=st.data(),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renormalize=st.booleans(),
    activation=st.sampled_from(["silu", "gelu_tanh", "relu"]),
    seed=st.integers(0, 2**16),
)
def test_one_rank_equals_moe_over_the_placed_experts(tokens, experts, data, scoring, renormalize, activation, seed):
    top_k = data.draw(st.integers(1, experts))
    order = data.draw(st.permutations(range(experts)))
    generator = torch.Generator().manual_seed(seed)
    hidden, inner = 5, 3
    x, logits = torch.randn(tokens, hidden, generator=generator), torch.randn(tokens, experts, generator=generator)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=generator)
    down = torch.randn(experts, hidden, inner, generator=generator)
    want = ops.moe(x, logits, gate_up, down, top_k, scoring, renormalize, activation)
    got = ops.moe_expert_parallel(x, logits, gate_up[list(order)], down[list(order)], list(order), top_k, scoring,
                                  renormalize, activation)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_tokens_round_once_like_moe():
    generator = torch.Generator().manual_seed(0)
    x, logits = torch.randn(6, 8, generator=generator).bfloat16(), torch.randn(6, 4, generator=generator)
    gate_up, down = torch.randn(4, 12, 8, generator=generator).bfloat16(), torch.randn(4, 8, 6, generator=generator).bfloat16()
    got = ops.moe_expert_parallel(x, logits, gate_up, down, [0, 1, 2, 3], 2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ops.moe(x, logits, gate_up, down, 2), atol=0, rtol=0)


def test_a_placement_that_does_not_hold_every_expert_is_refused():
    x, logits = torch.randn(2, 4), torch.randn(2, 3)
    gate_up, down = torch.randn(3, 6, 4), torch.randn(3, 4, 3)
    for order in ([0, 1, 1], [0, 1]):
        with pytest.raises((ValueError, RuntimeError), match="expert_order must be a permutation"):
            ops.moe_expert_parallel(x, logits, gate_up, down, order, 1)
