"""The ops that write e4m3 rows for an fp8 GEMM (``custom_ops/fp8_activations.py``): their references are the
unfused ops' bits, their Triton kernels (interpreted on the CPU) the references' rounding, and the
pre-quantized linear's backends its product."""

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import candidates
from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_activations_fp8, quantize_weight
from tests.custom_ops.test_paged_attention_triton import DEVICE, interpreter_loops_with_numpy_2_4  # noqa: F401

ops = torch.ops.autodeploy


def _rows(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * scale
    x[..., -1, :] = 0  # an all-zero row: its scale is 1, not 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [True, False])
def test_the_fused_references_compute_the_unfused_ops_bits(dtype, per_channel):
    x, residual = _rows(2, 3, 48, dtype=dtype), _rows(2, 3, 48, dtype=dtype, seed=1)
    weight, bias = torch.rand(48) + 0.5, torch.randn(40).to(dtype)
    stored = quantize_weight(QuantScheme("fp8", per_channel=per_channel), torch.randn(40, 48))
    x_q, x_scale, total = ops.add_rms_norm_fp8(x, residual, weight, 1e-6, 0.0)
    normed, want_total = ops.add_rms_norm(x, residual, weight, 1e-6, 0.0)
    assert x_q.dtype == torch.float8_e4m3fn and x_scale.shape == (2, 3, 1) and torch.equal(total, want_total)
    assert torch.equal(x_scale[:, -1], torch.ones(2, 1))  # the all-zero rows (zero input, zero norm)
    got = ops.fp8_prequantized_linear(x_q, x_scale, stored["qweight"], stored["scale"], bias, dtype)
    assert torch.equal(got, ops.fp8_linear(normed, stored["qweight"], stored["scale"], bias))

    gate, up = _rows(5, 64, dtype=dtype, seed=2), _rows(5, 64, dtype=dtype, seed=3)
    x_q, x_scale = ops.gated_activation_fp8(gate, up, "gelu_tanh")
    want_q, want_scale = quantize_activations_fp8(ops.gated_activation(gate, up, "gelu_tanh"))
    assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(x_scale, want_scale)


def test_the_prequantized_linear_refuses_rows_that_are_not_e4m3_with_a_scale_each():
    stored = quantize_weight(QuantScheme("fp8"), torch.randn(8, 16))
    x_q, x_scale = quantize_activations_fp8(torch.randn(3, 16))
    with pytest.raises(ValueError, match="x_q must be float8_e4m3fn"):
        ops.fp8_prequantized_linear(x_q.float(), x_scale, stored["qweight"], stored["scale"], None, torch.float32)
    with pytest.raises(ValueError, match=r"x_scale \[..., 1\]"):
        ops.fp8_prequantized_linear(x_q, x_scale.flatten(), stored["qweight"], stored["scale"], None, torch.float32)


def _assert_same_rounding(x_q, x_scale, want_q, want_scale, dtype):
    """The kernel's rows against the reference's. In the interpreter, float32 and float16 give the same bits.
    Elsewhere a value may land one e4m3 step away where the norm or activation before it rounded an ulp
    apart: on the GPU (its rsqrt and sigmoid) a few in a hundred; in the interpreter's bfloat16, which
    truncates (numpy has no bfloat16), a few more."""
    assert x_q.dtype == torch.float8_e4m3fn and x_q.shape == want_q.shape and x_scale.shape == want_scale.shape
    x_q, x_scale = x_q.cpu(), x_scale.cpu()
    if DEVICE == "cpu" and dtype != torch.bfloat16:
        assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8))
        torch.testing.assert_close(x_scale, want_scale, rtol=1e-6, atol=0)
        return
    tolerance, mismatches = (3e-2, 0.1) if DEVICE == "cpu" else (1e-2, 0.02)
    torch.testing.assert_close(x_scale, want_scale, rtol=tolerance, atol=0)
    assert (x_q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() <= mismatches
    got, want = x_q.float() * x_scale, want_q.float() * want_scale
    assert ((got - want).norm() / want.norm()).item() <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden", "rows_per_program"), [(5, 96, 1), (7, 64, 4)])
def test_the_add_rms_norm_fp8_kernel_rounds_as_the_reference(dtype, rows, hidden, rows_per_program,
                                                             interpreter_rounds_to_fp8_correctly):
    from autodeploy.custom_ops.triton.norms import NormConfig, add_rms_norm_fp8_triton

    x, residual = _rows(rows, hidden, dtype=dtype), _rows(rows, hidden, dtype=dtype, seed=1, scale=3.0)
    residual[-1] = -x[-1]  # a zero sum: the row's scale is 1
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    want_q, want_scale, want_total = ops.add_rms_norm_fp8(x, residual, weight, 1e-6, 0.0)
    x_q, x_scale, total = add_rms_norm_fp8_triton(*(t.to(DEVICE) for t in (x, residual, weight)), 1e-6,
                                                 config=NormConfig(rows_per_program, 2))
    assert x_scale.shape == (rows, 1)  # (the interpreter's bfloat16 rounding: a tolerance, not bits)
    torch.testing.assert_close(total.cpu(), want_total, rtol=1e-2, atol=0)
    _assert_same_rounding(x_q, x_scale, want_q, want_scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("inner", "block"), [(200, 64), (96, 2048)])
def test_the_gated_activation_fp8_kernel_rounds_as_the_reference(dtype, inner, block, interpreter_rounds_to_fp8_correctly,
                                                                 interpreter_loops_with_numpy_2_4):
    from autodeploy.custom_ops.triton.gated_activation import gated_activation_fp8

    gate_up = _rows(4, 2 * inner, dtype=dtype, scale=2.0).to(DEVICE)  # the halves of one GEMM output: strided rows
    gate, up = gate_up[:, :inner], gate_up[:, inner:]
    want_q, want_scale = ops.gated_activation_fp8(gate.cpu(), up.cpu(), "silu")
    _assert_same_rounding(*gated_activation_fp8(gate, up, "silu", block=block, num_warps=2), want_q, want_scale, dtype)


@pytest.mark.parametrize(("rows", "split_k"), [(1, 1), (20, 1), (1, 3)])
def test_the_prequantized_tile_kernel_matches_the_reference(rows, split_k, interpreter_rounds_to_fp8_correctly):
    # float16 on the CPU: the interpreter garbles a bfloat16 tl.dot (see test_quantized_linear.py's tile test)
    from autodeploy.custom_ops.triton.quantized_gemv import TileLaunch, fp8_prequantized_gemm

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(rows)
    stored = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("fp8"), torch.randn(40, 96, generator=gen)).items()}
    x_q, x_scale = (t.to(DEVICE) for t in quantize_activations_fp8(_rows(rows + 1, 96, dtype=dtype)[1:]))
    bias = torch.randn(40, generator=gen).to(dtype).to(DEVICE)
    want = ops.fp8_prequantized_linear(x_q, x_scale, stored["qweight"], stored["scale"], bias, dtype).double()
    got = fp8_prequantized_gemm(x_q, x_scale, stored["qweight"], stored["scale"], bias, dtype,
                                launch=TileLaunch(block_n=16, block_k=32, split_k=split_k))
    assert got.dtype == dtype and got.shape == (rows, 40) and torch.isfinite(got).all()
    assert (got.double() - want).norm() / want.norm() <= 1e-2


def test_the_prequantized_scaled_mm_backend_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    stored = quantize_weight(QuantScheme("fp8"), torch.randn(48, 64, generator=gen))
    x_q, x_scale = quantize_activations_fp8(torch.randn(2, 5, 64, generator=gen).to(torch.bfloat16))
    args = [t.to(DEVICE) for t in (x_q, x_scale, stored["qweight"], stored["scale"], torch.randn(48).to(torch.bfloat16))]
    backend = next(b for b in candidates("fp8_prequantized_linear") if b.name == "torch")
    refused = backend.check([*args, torch.bfloat16], torch.device(DEVICE))
    if refused:
        pytest.skip(refused)
    want = ops.fp8_prequantized_linear(*args, torch.bfloat16).double()
    got = backend.op(*args, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 48)
    assert (got.double() - want).norm() / want.norm() <= 1e-2
