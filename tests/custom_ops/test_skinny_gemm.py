"""The few-row ``linear`` kernel (``custom_ops/triton/skinny_gemm.py``) against the float32 reference.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET), so the
shapes are tiny; they reach every edge the launch has: one row (the GEMV kernel) and several (the
``tl.dot`` kernel, rows past ``M`` masked), widths and depths that do not fill a block (masked loads),
``K`` split over programs (the partial-sum kernel), bias, strided rows of ``x``; and the gated kernel
(``skinny_gated_linear``: gate/up with the activation) against ``act(x·gateᵀ) · (x·upᵀ)``, with its
two-kernel fall-back. The interpreter's ``tl.dot`` garbles bfloat16 (numpy has no such type), so bfloat16
runs the dot kernels on the GPU only (``test_skinny_gemm_gpu.py``: the gated kernel at Llama-3-8B's shape).
Contract: ``‖out − ref‖ / ‖ref‖ ≤ 1e-2`` in half precision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autodeploy.custom_ops.triton import skinny_gemm
from autodeploy.custom_ops.triton.gated_activation import ACTIVATIONS
from autodeploy.custom_ops.triton.skinny_gemm import (
    SkinnyConfig, skinny_config, skinny_gated_config, skinny_gated_linear, skinny_linear)
from tests.custom_ops.activation_formulas import ACTIVATION_FORMULAS

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
        ((5, 96), 40, True, SkinnyConfig(16, 64, 32, swap=True)),          # weight tile as the left operand
        ((20, 256), 100, True, SkinnyConfig(32, 64, 32, 2, swap=True)),    # swapped, masked, K split
        ((5, 96), 40, True, SkinnyConfig(16, 64, 32, tma=True)),           # TMA tiles, zero past M, N and K
        ((20, 256), 100, False, SkinnyConfig(32, 64, 64, 3, tma=True)),    # TMA, K in three splits, one past K
        ((70, 256), 100, True, SkinnyConfig(64, 32, 64, 2, tma=True)),     # TMA split: two row blocks, bias
    ],
)
def test_several_rows(dtype, shape, out_features, bias, config):
    x = random(*shape, dtype=dtype, seed=0)
    weight = random(out_features, shape[-1], dtype=dtype, seed=1)
    check(x, weight, random(out_features, dtype=dtype, seed=2) if bias else None, config)


@pytest.mark.parametrize("config", [None, SkinnyConfig(16, 32, 32, tma=True)], ids=["own", "tma"])
def test_strided_rows_are_read_in_place(config):
    gate_up = random(5, 128, dtype=torch.float16, seed=0)
    gate = gate_up[:, :64]  # rows 128 apart: the gate half of a fused gate/up GEMM output
    check(gate, random(32, 64, dtype=torch.float16, seed=1), None, config)


def test_a_tma_split_launch_sums_its_partials_itself_and_leaves_its_counters_at_zero(monkeypatch):
    # The last split of each tile to arrive adds the partials (no second kernel): the sums are the
    # reference's, launch after launch, and every arrival counter is back at zero for the next one.
    from autodeploy.custom_ops.triton import launch

    x, weight, bias = (random(20, 256, dtype=torch.float16, seed=0), random(100, 256, dtype=torch.float16, seed=1),
                       random(100, dtype=torch.float16, seed=2))
    launches = []
    monkeypatch.setattr(skinny_gemm, "_split_sum_kernel", _Recorder(launches))
    for _ in range(2):
        check(x, weight, bias, SkinnyConfig(16, 32, 64, 4, tma=True))
    assert launches == []
    assert all(int(counters.abs().sum()) == 0 for counters in launch._ARRIVALS[x.device])


class _Recorder:
    """Stands in for a kernel: records each grid it is launched over."""

    def __init__(self, grids: list):
        self.grids = grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_tma_launches_fall_back_to_thread_loads_for_unaligned_rows():
    # 36-byte rows cannot be TMA tiles (16-byte strides): the swapped kernel serves the launch instead.
    x = random(4, 18, dtype=torch.float16, seed=0)
    check(x, random(24, 18, dtype=torch.float16, seed=1), None, SkinnyConfig(16, 16, 16, tma=True))


def test_empty_inputs():
    weight = random(16, 32, dtype=torch.float16, seed=1)
    assert skinny_linear(random(0, 32, dtype=torch.float16, seed=0), weight, None).shape == (0, 16)
    bias = random(16, dtype=torch.float16, seed=2)
    no_depth = skinny_linear(random(2, 0, dtype=torch.float16, seed=0), weight[:, :0], bias)
    torch.testing.assert_close(no_depth, bias.expand(2, 16))


def test_launches_split_k_only_when_the_weight_is_too_narrow_to_fill_the_card():
    # An H200 (132 SMs), Llama-3-8B's projections: q/k/v at one row is 768 programs, no split.
    qkv = skinny_config(1, 6144, 4096, 132)
    assert (qkv.block_m, qkv.block_n, qkv.split_k, qkv.swap) == (1, 8, 1, False)
    o_proj = skinny_config(20, 4096, 4096, 132)  # 64 programs, but splits of 2,048 columns measured slower
    assert (o_proj.block_m, o_proj.split_k, o_proj.swap) == (32, 1, True)
    down = skinny_config(20, 4096, 14336, 132)  # deep enough to split once
    assert down.split_k == 2
    narrow = skinny_config(1, 256, 14336, 132)
    assert narrow.split_k == 2
    shallow = skinny_config(1, 16, 64, 132)  # too short to split
    assert shallow.split_k == 1 and shallow.block_k == 64


def test_on_hopper_several_rows_take_the_tma_kernel_at_the_launches_the_sweep_found_best():
    qkv, o_proj, down, gate_up = (skinny_config(32, n, k, 132, tma=True)
                                  for n, k in [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096)])
    assert all(c.tma and not c.swap and c.block_m == 32 for c in (qkv, o_proj, down, gate_up))
    assert (qkv.block_n, qkv.block_k, qkv.split_k) == (64, 128, 1)
    assert (o_proj.block_n, o_proj.block_k, o_proj.split_k, o_proj.num_stages) == (64, 256, 1, 4)
    assert (down.block_k, down.split_k) == (256, 2)
    assert (gate_up.block_n, gate_up.block_k, gate_up.num_stages) == (128, 128, 3)
    assert not skinny_config(1, 6144, 4096, 132, tma=True).tma  # one row: the GEMV


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 32, 64, 512, 2048])
@pytest.mark.parametrize("out_features, in_features", [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_launches_fit_in_shared_memory(rows, out_features, in_features, tma):
    # The autotuner times the backend at every token bucket: a launch past the 227 KB a block may hold
    # would not compile there (64 rows and four 64 KB stages did, before the stages were counted).
    config = skinny_config(rows, out_features, in_features, 132, tma=tma)
    stage = (config.block_m + config.block_n) * config.block_k * 2
    assert config.num_stages >= 1 and stage * config.num_stages <= 200 << 10


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


@pytest.mark.parametrize("hopper", [False, True], ids=["two-kernels", "hopper"])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_fused_gated_mlp_with_few_row_gemms(rows, hopper, monkeypatch):
    # fused_gated_mlp's triton_skinny backend: both GEMMs here. As on Hopper, several rows take the gated TMA
    # kernel for gate/up and the activation; else the activation kernel runs over the gate half in place.
    from autodeploy.custom_ops.fused_gated_mlp import fused_gated_mlp_reference
    from autodeploy.custom_ops.triton.skinny_gemm import fused_gated_mlp_skinny

    monkeypatch.setattr(skinny_gemm, "hopper_or_later", lambda device: hopper)
    x = random(rows, 32, dtype=torch.float16, seed=0)
    gate_up, down = random(2 * 40, 32, dtype=torch.float16, seed=1), random(32, 40, dtype=torch.float16, seed=2)
    got = torch.ops.autodeploy.fused_gated_mlp_triton_skinny.default(x, gate_up, down, "silu")
    torch.testing.assert_close(got, fused_gated_mlp_skinny(x, gate_up, down, "silu"), rtol=0, atol=0)
    expected = fused_gated_mlp_reference(x.double(), gate_up.double(), down.double(), "silu")
    assert ((got.double() - expected).norm() / expected.norm()).item() <= 1e-2


def check_gated(x, gate_up_weight, activation, config=None):
    # act(x @ gateᵀ) * (x @ upᵀ) in float64; returns the result for its layout to be checked.
    got = skinny_gated_linear(x, gate_up_weight, activation, config=config)
    gate, up = F.linear(x.double(), gate_up_weight.double()).chunk(2, dim=-1)
    expected = ACTIVATION_FORMULAS[activation](gate) * up
    assert got.shape == expected.shape and got.dtype == x.dtype
    error = ((got.double() - expected).norm() / expected.norm()).item()
    assert error <= 1e-2, f"relative error {error:.2e}"
    return got


def one_kernel(out, inner):
    # The gated kernel writes a fresh [rows, I]; the two-kernel path returns the gate half of [rows, 2I].
    return out.stride(-2) == inner


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("rows, hidden, inner", [(2, 64, 64), (5, 96, 100), (32, 256, 320)])
def test_gated_kernel_at_its_hopper_launch(rows, hidden, inner, activation):
    # The launch Hopper takes, in the interpreter: 32 rows of each half a program; 100 and 320 columns leave
    # a last block past I (its gate tile reads up rows, its up tile zeros past 2I), 96 a K step past H.
    x = random(rows, hidden, dtype=torch.float16, seed=0)
    gate_up = random(2 * inner, hidden, dtype=torch.float16, seed=1) / hidden**0.5
    config = skinny_gated_config(rows, inner, hidden, 132, tma=True)
    assert one_kernel(check_gated(x, gate_up, activation, config), inner)


@pytest.mark.parametrize(
    "shape, inner, config",
    [
        ((2, 9, 128), 100, SkinnyConfig(32, 64, 32, num_stages=2, tma=True)),   # 18 rows; a tile of 64 per half
        ((5, 256), 72, SkinnyConfig(16, 16, 64, num_stages=3, tma=True)),       # narrow tiles, four K steps
    ],
)
def test_gated_kernel_at_other_launches(shape, inner, config):
    x = random(*shape, dtype=torch.float16, seed=0)
    gate_up = random(2 * inner, shape[-1], dtype=torch.float16, seed=1) / shape[-1] ** 0.5
    assert one_kernel(check_gated(x, gate_up, "silu", config), inner)


@pytest.mark.parametrize(
    "rows, hidden, config",
    [
        (1, 64, None),                                    # one row: the GEMV, then the activation kernel
        (5, 64, None),                                    # the own launch off Hopper is not TMA
        (5, 64, SkinnyConfig(16, 32, 32, tma=False)),
        (4, 18, SkinnyConfig(16, 16, 16, tma=True)),      # 36-byte rows: TMA cannot fetch them
    ],
)
def test_gated_linear_falls_back_to_two_kernels(rows, hidden, config, monkeypatch):
    monkeypatch.setattr(skinny_gemm, "hopper_or_later", lambda device: False)  # as on a CPU or an older GPU
    x = random(rows, hidden, dtype=torch.float16, seed=0)
    gate_up = random(2 * 40, hidden, dtype=torch.float16, seed=1) / hidden**0.5
    assert not one_kernel(check_gated(x, gate_up, "gelu_tanh", config), 40)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: skinny_gated_linear(random(2, 8, dtype=torch.float16, seed=0), random(8, 8, dtype=torch.float16, seed=1),
                                     "swish"), "unknown activation"),
        (lambda: skinny_gated_linear(random(2, 8, dtype=torch.float16, seed=0), random(7, 8, dtype=torch.float16, seed=1),
                                     "silu"), "odd"),
        (lambda: skinny_gated_linear(random(2, 32, dtype=torch.float16, seed=0), random(8, 32, dtype=torch.float16, seed=1),
                                     "silu", config=SkinnyConfig(16, 16, 16, 2, tma=True)), "whole sums"),
    ],
)
def test_gated_linear_refuses_what_it_cannot_compute(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_gated_launch_fetches_as_many_weight_rows_as_the_ungated_one_and_never_splits():
    # Llama-3-8B's gate/up at 32 rows on an H200: 64 rows of each half where the plain launch takes 128,
    # four stages (the sweep's best) where the plain launch's 128-row tiles fit three.
    gate_up = skinny_gated_config(32, 14336, 4096, 132, tma=True)
    assert (gate_up.block_n, gate_up.block_k, gate_up.num_stages, gate_up.split_k, gate_up.tma) == (64, 128, 4, 1, True)
    wide = skinny_gated_config(64, 14336, 4096, 132, tma=True)  # 64 rows of x: four stages still fit the budget
    assert wide.num_stages * (wide.block_m + 2 * wide.block_n) * wide.block_k * 2 <= 200 << 10
    assert skinny_config(32, 2 * 1024, 8192, 132, tma=True).split_k > 1  # narrow and deep: the plain launch splits
    assert skinny_gated_config(32, 1024, 8192, 132, tma=True).split_k == 1
