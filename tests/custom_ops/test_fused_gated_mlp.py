"""autodeploy::fused_gated_mlp: gated_mlp's reference over the two halves of one gate/up weight."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from tests.custom_ops.activation_formulas import ACTIVATION_FORMULAS

fused_gated_mlp = torch.ops.autodeploy.fused_gated_mlp
gated_mlp = torch.ops.autodeploy.gated_mlp


@settings(max_examples=20, deadline=None)
@given(
    leading=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    hidden=st.integers(1, 8),
    inner=st.integers(1, 10),
    activation=st.sampled_from(sorted(ACTIVATION_FORMULAS)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_equals_gated_mlp_over_the_split_weights(leading, hidden, inner, activation, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, hidden, generator=gen).to(dtype)
    gate, up = torch.randn(inner, hidden, generator=gen).to(dtype), torch.randn(inner, hidden, generator=gen).to(dtype)
    down = torch.randn(hidden, inner, generator=gen).to(dtype)
    out = fused_gated_mlp(x, torch.cat([gate, up]), down, activation)
    assert out.dtype == dtype and out.shape == x.shape
    # The same arithmetic over views of the concatenated weight; a CPU GEMM may still round differently when
    # the up half starts at an address of another alignment (hidden = inner = 5: 9.5e-7 apart in float32).
    torch.testing.assert_close(out, gated_mlp(x, gate, up, down, activation))


def test_gate_rows_come_first():
    x, down = torch.randn(2, 4), torch.randn(4, 3)
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    swapped = fused_gated_mlp(x, torch.cat([up, gate]), down, "silu")
    assert not torch.allclose(swapped, fused_gated_mlp(x, torch.cat([gate, up]), down, "silu"))
    torch.testing.assert_close(swapped, gated_mlp(x, up, gate, down, "silu"))


@pytest.mark.parametrize(
    "gate_up, down",
    [((7, 4), (4, 3)), ((6, 5), (4, 3)), ((8, 4), (4, 3))],
    ids=["odd-rows", "wrong-hidden", "rows-not-twice-inner"],
)
def test_rejects_mismatched_weights(gate_up, down):
    with pytest.raises(ValueError, match=r"fused_gated_mlp: expected gate_up \[2I, H=4\] and down \[H, I\]"):
        fused_gated_mlp(torch.randn(2, 4), torch.randn(*gate_up), torch.randn(*down), "silu")


def test_rejects_unknown_activation_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown activation 'swish'; allowed: 'silu', 'gelu_tanh', 'gelu', 'relu'"):
        fused_gated_mlp(torch.randn(2, 4), torch.randn(6, 4), torch.randn(4, 3), "swish")
