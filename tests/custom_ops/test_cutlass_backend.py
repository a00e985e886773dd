"""The ``cutlass`` backend of ``linear``: its refusals (with the reason the select report shows) and, where
``torch._grouped_mm`` runs (its CPU fallback here, CUTLASS on an H200), its result against the reference."""

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import candidates, canonical_ops
from autodeploy.custom_ops.cutlass_backends import linear_cutlass

META = dict(device="meta", dtype=torch.bfloat16)


def cutlass():
    return next(b for b in candidates("linear") if b.name == "cutlass")


def test_cutlass_competes_after_cublas_so_the_default_stays_torch():
    names = [b.name for b in candidates("linear")]
    assert names.index("torch") < names.index("cutlass") < names.index("reference")


def test_a_cpu_deploy_never_gets_cutlass_and_is_told_why():
    reason = cutlass().check((torch.empty(3, 64, **META), torch.empty(32, 64, **META), None), torch.device("cpu"))
    assert "NVIDIA GPUs only" in reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "x_shape, weight_shape, dtype, why",
    [
        ((3, 64), (32, 64), torch.float16, "bfloat16"),
        ((3, 60), (32, 60), torch.bfloat16, "multiples of 8"),
        ((3, 64), (36, 64), torch.bfloat16, "multiples of 8"),
    ],
)
def test_refusals_on_the_gpu(x_shape, weight_shape, dtype, why):
    meta = dict(device="meta", dtype=dtype)
    reason = cutlass().check((torch.empty(*x_shape, **meta), torch.empty(*weight_shape, **meta), None), torch.device("cuda"))
    capability = torch.cuda.get_device_capability()[0]
    assert why in reason if capability in (9, 10) else "Hopper or Blackwell" in reason


@pytest.mark.parametrize("leading", [(), (5,), (2, 7), (1, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_group_gemm_equals_the_reference(leading, bias):
    torch.manual_seed(len(leading))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(*leading, 64, device=device).to(torch.bfloat16)
    weight = (torch.randn(48, 64, device=device) / 8).to(torch.bfloat16)
    b = torch.randn(48, device=device).to(torch.bfloat16) if bias else None
    got = linear_cutlass(x, weight, b)
    expected = canonical_ops()["linear"].reference(x, weight, b)
    assert got.shape == expected.shape == (*leading, 48) and got.dtype == torch.bfloat16
    if expected.numel():
        error = ((got.double() - expected.double()).norm() / expected.double().norm()).item()
        assert error <= 1e-2
