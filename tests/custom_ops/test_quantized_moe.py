"""The quantized MoE ops (custom_ops/quantized_moe.py): experts quantized one by one, the reference equal to
``moe``'s over the dequantized experts, the ``torch`` backend equal to the reference."""

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops.quantized_linear import QuantScheme, dequantize_weight, quantize_weight

ops = torch.ops.autodeploy
SCHEMES = [QuantScheme("int8_wo"), QuantScheme("int4_wo", group_size=8)]


def experts(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 16, 32, generator=gen), torch.randn(4, 32, 8, generator=gen), torch.randn(5, 32, generator=gen),
            torch.randn(5, 4, generator=gen))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_experts_are_quantized_one_by_one(scheme):
    gate_up = experts()[0]
    stored = quantize_weight(scheme, gate_up)
    assert stored["qweight"].shape[0] == 4 and all(t.shape[:2] == (4, 16) for t in stored.values())
    for expert in range(4):
        alone = quantize_weight(scheme, gate_up[expert])
        assert all(torch.equal(stored[role][expert], alone[role]) for role in alone)
    assert torch.equal(dequantize_weight(scheme, stored)[2], dequantize_weight(scheme, quantize_weight(scheme, gate_up[2])))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_the_reference_is_moe_over_the_dequantized_experts_and_the_torch_backend_matches_it(scheme):
    gate_up, down, x, router_logits = experts(1)
    up_stored, down_stored = quantize_weight(scheme, gate_up), quantize_weight(scheme, down)
    args = [x, router_logits, *up_stored.values(), *down_stored.values(), 2]
    got = getattr(ops, f"moe_{scheme.name}")(*args)
    want = ops.moe(x.double(), router_logits, dequantize_weight(scheme, up_stored, torch.float64),
                   dequantize_weight(scheme, down_stored, torch.float64), 2)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    backend = getattr(ops, f"moe_{scheme.name}_torch")(*args)
    assert (backend.double() - got.double()).norm() / got.double().norm() <= 1e-5


def test_moe_experts_refuse_the_schemes_they_do_not_take():
    assert "MoE experts take int4_wo or int8_wo, not fp8" in QuantScheme("fp8").check_shape((4, 16, 32))
    with pytest.raises(ValueError, match="multiple of group_size 128"):
        quantize_weight(QuantScheme("int4_wo"), torch.zeros(2, 8, 64))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_one_rank_of_placed_quantized_experts_equals_the_quantized_moe(scheme):
    # Experts are quantized one by one, so quantizing them in the placement's order gives the same experts.
    gate_up, down, x, router_logits = experts(2)
    order = [2, 0, 3, 1]
    whole = [*quantize_weight(scheme, gate_up).values(), *quantize_weight(scheme, down).values()]
    placed = [*quantize_weight(scheme, gate_up[order]).values(), *quantize_weight(scheme, down[order]).values()]
    want = getattr(ops, f"moe_{scheme.name}")(x, router_logits, *whole, 2)
    got = getattr(ops, f"moe_expert_parallel_{scheme.name}")(x, router_logits, *placed, order, 2)
    assert torch.equal(got, want)
