"""The few-row GEMMs on the card: the gated one (``skinny_gemm.skinny_gated_linear``) in bfloat16 at Llama-3-8B's gate/up shape and
a 32-row decode batch, against the float32 reference: ‖out − ref‖/‖ref‖ ≤ 1e-2. On Hopper it is the TMA
kernel with the activation in its epilogue, elsewhere the two-kernel fall-back. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autodeploy.custom_ops.triton import hopper_or_later
from autodeploy.custom_ops.triton.gated_activation import ACTIVATIONS
from autodeploy.custom_ops.triton.skinny_gemm import skinny_gated_linear
from tests.custom_ops.activation_formulas import ACTIVATION_FORMULAS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROWS, HIDDEN, INNER = 32, 4096, 14336


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_gate_up_at_llama_3_8b_shape(activation):
    x = torch.randn(ROWS, HIDDEN, device="cuda").to(torch.bfloat16)
    gate_up = (torch.randn(2 * INNER, HIDDEN, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
    got = skinny_gated_linear(x, gate_up, activation)
    gate, up = F.linear(x.float(), gate_up.float()).chunk(2, dim=-1)
    expected = ACTIVATION_FORMULAS[activation](gate) * up
    assert got.shape == (ROWS, INNER) and got.dtype == torch.bfloat16
    # One kernel on Hopper writes a fresh [rows, I]; the fall-back returns the gate half of [rows, 2I].
    assert (got.stride(0) == INNER) == hopper_or_later(x.device)
    error = ((got.float() - expected).norm() / expected.norm()).item()
    assert error <= 1e-2, f"relative error {error:.2e}"


def test_down_projection_split_on_the_card_sums_its_partials_in_the_kernel():
    # Llama-3-8B's down projection at 32 rows: on an H200 K is split in two and the last split of each
    # tile adds the partials (arrival counters); twice, so the counters' reset is exercised too.
    from autodeploy.custom_ops.triton.skinny_gemm import num_sms, skinny_config, skinny_linear

    x = torch.randn(ROWS, INNER, device="cuda").to(torch.bfloat16)
    down = (torch.randn(HIDDEN, INNER, device="cuda") / INNER**0.5).to(torch.bfloat16)
    bias = torch.randn(HIDDEN, device="cuda").to(torch.bfloat16)
    expected = F.linear(x.float(), down.float(), bias.float())
    config = skinny_config(ROWS, HIDDEN, INNER, num_sms(x.device), tma=hopper_or_later(x.device))
    for _ in range(2):
        got = skinny_linear(x, down, bias, config=config)
        error = ((got.float() - expected).norm() / expected.norm()).item()
        assert error <= 1e-2, f"relative error {error:.2e} ({config})"
