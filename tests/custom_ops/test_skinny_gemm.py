"""The few-row ``linear`` kernel (``custom_ops/triton/skinny_gemm.py``) against the float32 reference.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET), so the
shapes are tiny; they reach every edge the launch has: one row (the GEMV kernel) and several (the
``tl.dot`` kernel, rows past ``M`` masked), widths and depths that do not fill a block (masked loads),
``K`` split over programs (the partial-sum kernel), bias, strided rows of ``x``. The interpreter's
``tl.dot`` garbles bfloat16 (numpy has no such type), so bfloat16 runs the dot kernel on the GPU only.
Contract: ``‖out − ref‖ / ‖ref‖ ≤ 1e-2`` in half precision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autodeploy.custom_ops.triton.skinny_gemm import SkinnyConfig, skinny_config, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def check(x, weight, bias, config=None):
    got = skinny_linear(x, weight, bias, config=config)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == expected.shape and got.dtype == x.dtype
    error = ((got.double() - expected).norm() / expected.norm()).item()
    assert error <= 1e-2, f"relative error {error:.2e}"


def dot_dtypes():
    return [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "out_features, in_features, bias, config",
    [
        (48, 64, False, None),                       # the shape's own launch
        (50, 100, True, None),                       # neither dim fills a block: masked loads
        (64, 256, True, SkinnyConfig(1, 16, 32, 4)),  # K in four splits, summed with the bias after
        (40, 72, False, SkinnyConfig(1, 8, 32, 2)),   # splits that end past K
    ],
)
def test_one_row(dtype, out_features, in_features, bias, config):
    x = random(1, in_features, dtype=dtype, seed=0)
    weight = random(out_features, in_features, dtype=dtype, seed=1)
    check(x, weight, random(out_features, dtype=dtype, seed=2) if bias else None, config)


@pytest.mark.parametrize("dtype", dot_dtypes())
@pytest.mark.parametrize(
    "shape, out_features, bias, config",
    [
        ((3, 96), 40, True, None),                        # rows past M masked to zero
        ((2, 9, 256), 64, False, None),                    # leading dims flattened: 18 rows, a 32-row block
        ((17, 256), 64, True, SkinnyConfig(16, 16, 32, 2)),  # two row blocks, K split
        ((70, 48), 33, True, SkinnyConfig(64, 16, 32, 3)),   # three splits, one of them past K
    ],
)
def test_several_rows(dtype, shape, out_features, bias, config):
    x = random(*shape, dtype=dtype, seed=0)
    weight = random(out_features, shape[-1], dtype=dtype, seed=1)
    check(x, weight, random(out_features, dtype=dtype, seed=2) if bias else None, config)


def test_strided_rows_are_read_in_place():
    gate_up = random(5, 128, dtype=torch.float16, seed=0)
    gate = gate_up[:, :64]  # rows 128 apart: the gate half of a fused gate/up GEMM output
    check(gate, random(32, 64, dtype=torch.float16, seed=1), None)


def test_empty_inputs():
    weight = random(16, 32, dtype=torch.float16, seed=1)
    assert skinny_linear(random(0, 32, dtype=torch.float16, seed=0), weight, None).shape == (0, 16)
    bias = random(16, dtype=torch.float16, seed=2)
    no_depth = skinny_linear(random(2, 0, dtype=torch.float16, seed=0), weight[:, :0], bias)
    torch.testing.assert_close(no_depth, bias.expand(2, 16))


def test_launches_spread_a_narrow_weight_over_the_card():
    # An H200 (132 SMs), Llama-3-8B's projections at one row: hundreds of programs, K split only when narrow.
    qkv = skinny_config(1, 6144, 4096, 132)
    assert qkv.block_m == 1 and 6144 // qkv.block_n * qkv.split_k >= 4 * 132
    wide = skinny_config(1, 128256, 4096, 132)
    assert wide.split_k == 1
    several = skinny_config(20, 4096, 4096, 132)
    assert several.block_m == 32 and 4096 // several.block_n * several.split_k >= 4 * 132


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: skinny_linear(random(2, 8, dtype=torch.float32, seed=0), random(4, 8, dtype=torch.float32, seed=1), None),
         "one dtype of"),
        (lambda: skinny_linear(random(2, 8, dtype=torch.float16, seed=0), random(8, 4, dtype=torch.float16, seed=1).t(), None),
         "contiguous rows"),
        (lambda: skinny_linear(random(2, 8, dtype=torch.float16, seed=0), random(4, 8, dtype=torch.float16, seed=1), None,
                               config=SkinnyConfig(1, 8, 32)), "one row"),
    ],
)
def test_unsupported_inputs_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()
