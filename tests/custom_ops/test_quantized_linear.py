"""The quantized linear ops against float64 products over their dequantized weights, and the storage layouts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops.quantized_linear import (
    FP8_MAX,
    QuantScheme,
    dequantize_weight,
    pack_int4,
    quantize_activations_fp8,
    quantize_weight,
    share_smoothing,
    unpack_int4,
)

ops = torch.ops.autodeploy


def _dot(x: torch.Tensor, weight: torch.Tensor, bias):
    out = (x.double().unsqueeze(-2) * weight.double()).sum(-1)
    return out if bias is None else out + bias.double()


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 3), tokens=st.integers(1, 5), with_bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_each_scheme_equals_a_float64_product_over_its_dequantized_weight(rows, groups, tokens, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    columns = 8 * groups
    weight = torch.randn(rows, columns, generator=gen)
    x = torch.randn(tokens, columns, generator=gen)
    bias = torch.randn(rows, generator=gen) if with_bias else None
    for scheme in (QuantScheme("int8_wo"), QuantScheme("int4_wo", group_size=8), QuantScheme("fp8"),
                   QuantScheme("fp8", per_channel=False)):
        stored = quantize_weight(scheme, weight)
        dequantized = dequantize_weight(scheme, stored, torch.float64)
        if scheme.name == "fp8":
            x_q, x_scale = quantize_activations_fp8(x)
            activations = x_q.double() * x_scale.double()
            got = ops.fp8_linear(x, stored["qweight"], stored["scale"], bias)
        elif scheme.name == "int8_wo":
            activations = x
            got = ops.int8_wo_linear(x, stored["qweight"], stored["scale"], bias)
        else:
            activations = x
            got = ops.int4_wo_linear(x, stored["qweight"], stored["scale"], stored["zero"], bias)
        torch.testing.assert_close(got.double(), _dot(activations, dequantized, bias), rtol=1e-5, atol=1e-5)


def test_the_rounding_is_the_declared_one():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 256, generator=gen, dtype=torch.float64)
    int8 = quantize_weight(QuantScheme("int8_wo"), weight)
    # symmetric: at most half a step per element, the largest |w| of each row exact
    error = (dequantize_weight(QuantScheme("int8_wo"), int8, torch.float64) - weight).abs()
    assert (error <= int8["scale"].double()[:, None] / 2 + 1e-7).all()
    assert int8["qweight"].abs().amax(dim=1).eq(127).all()
    int4 = quantize_weight(QuantScheme("int4_wo", group_size=64), weight)
    error = (dequantize_weight(QuantScheme("int4_wo", group_size=64), int4, torch.float64) - weight).abs()
    step = int4["scale"].double().repeat_interleave(64, dim=1)
    assert (error <= step / 2 + 1e-6).all()
    assert int4["zero"].max() <= 15 and int4["scale"].shape == (16, 4)
    fp8 = quantize_weight(QuantScheme("fp8"), weight)
    relative = (dequantize_weight(QuantScheme("fp8"), fp8, torch.float64) - weight).abs() / weight.abs()
    assert relative[weight.abs() > fp8["scale"].double()[:, None] * 2**-6].max() <= 2**-4  # 3 mantissa bits
    assert fp8["qweight"].float().abs().amax(dim=1).eq(FP8_MAX).all()


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_packed_int4_round_trips(values):
    q = torch.tensor(values, dtype=torch.uint8).reshape(1, -1)
    packed = pack_int4(q)
    assert packed.shape == (1, len(values) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == values[0] | (values[1] << 4)  # the even k in the low nibble


def test_an_all_zero_row_stays_zero_and_finite():
    weight = torch.zeros(2, 16)
    weight[1] = torch.arange(16.0)
    for scheme in (QuantScheme("int8_wo"), QuantScheme("int4_wo", group_size=8), QuantScheme("fp8")):
        back = dequantize_weight(scheme, quantize_weight(scheme, weight))
        assert torch.isfinite(back).all() and torch.equal(back[0], torch.zeros(16))


def test_bad_schemes_and_shapes_are_value_errors():
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        QuantScheme("int3")
    with pytest.raises(ValueError, match="multiple of group_size 128"):
        quantize_weight(QuantScheme("int4_wo"), torch.randn(4, 100))
    with pytest.raises(ValueError, match="even number"):
        QuantScheme("int4_wo", group_size=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_torch_backend_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    stored = quantize_weight(QuantScheme("int4_wo", group_size=16), torch.randn(24, 64, generator=gen))
    x, bias = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
    want = ops.int4_wo_linear(x, *stored.values(), bias).float()
    got = ops.int4_wo_linear_torch(x, *stored.values(), bias)
    assert got.dtype == dtype
    assert (got.float() - want).norm() / want.norm() <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_torch_backend_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    stored = quantize_weight(QuantScheme("int8_wo"), torch.randn(24, 64, generator=gen))
    x, bias = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
    want = ops.int8_wo_linear(x, stored["qweight"], stored["scale"], bias).float()
    got = ops.int8_wo_linear_torch(x, stored["qweight"], stored["scale"], bias).float()
    assert got.dtype == want.dtype
    assert (got - want).norm() / want.norm() <= (1e-5 if dtype == torch.float32 else 1e-2)


# The dequantising GEMV kernels (custom_ops/triton/quantized_gemv.py): in Triton's interpreter on the CPU
# (tests/conftest.py sets TRITON_INTERPRET), on the GPU where there is one. Shapes reach the masked edges:
# widths that do not fill a block of 16 rows, depths that do not fill a 512-column step (int8). Their
# loops run to a runtime bound, which the interpreter needs the paged-attention tests' fixture for.
from tests.custom_ops.test_paged_attention_triton import DEVICE, interpreter_loops_with_numpy_2_4  # noqa: E402, F401


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features", "in_features", "with_bias"), [(1, 40, 96, True), (3, 16, 600, False)])
def test_the_int8_gemv_kernel_matches_the_reference(dtype, rows, out_features, in_features, with_bias):
    from autodeploy.custom_ops.triton.quantized_gemv import GemvLaunch, int8_wo_gemv

    gen = torch.Generator().manual_seed(rows)
    stored = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("int8_wo"), torch.randn(out_features, in_features, generator=gen)).items()}
    x = torch.randn(rows, in_features, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(out_features, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    want = ops.int8_wo_linear(x, stored["qweight"], stored["scale"], bias).double()
    got = int8_wo_gemv(x, stored["qweight"], stored["scale"], bias, launch=GemvLaunch())
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.double() - want).norm() / want.norm() <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features", "in_features", "group_size", "with_bias"),
                         [(1, 40, 128, 32, True), (2, 16, 256, 128, False), (1, 8, 64, 2, False), (3, 24, 96, 32, False)])
@pytest.mark.parametrize("launch", [{"words": 0}, {"words": 8}, {}])  # group-wise; word-wise (groups of 8 or more), the default
def test_the_int4_gemv_kernel_matches_the_reference(dtype, rows, out_features, in_features, group_size, with_bias, launch):
    from autodeploy.custom_ops.triton.quantized_gemv import GemvLaunch, int4_wo_gemv

    gen = torch.Generator().manual_seed(group_size)
    scheme = QuantScheme("int4_wo", group_size=group_size)
    stored = {k: v.to(DEVICE) for k, v in quantize_weight(scheme, torch.randn(out_features, in_features, generator=gen)).items()}
    x = (torch.randn(rows, 1, in_features, generator=gen) + 0.5).to(dtype).to(DEVICE)  # Σx ≠ 0: the zero points count
    bias = torch.randn(out_features, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    want = ops.int4_wo_linear(x, stored["qweight"], stored["scale"], stored["zero"], bias).double()
    got = int4_wo_gemv(x, stored["qweight"], stored["scale"], stored["zero"], bias, launch=GemvLaunch(**launch))
    assert got.dtype == dtype and got.shape == want.shape == (rows, 1, out_features)
    assert (got.double() - want).norm() / want.norm() <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features", "in_features", "per_channel", "with_bias"),
                         [(1, 40, 96, True, True), (3, 16, 600, False, False), (2, 8, 64, True, False)])
def test_the_fp8_gemv_kernel_matches_the_reference(dtype, rows, out_features, in_features, per_channel, with_bias,
                                                  interpreter_rounds_to_fp8_correctly):
    from autodeploy.custom_ops.triton.quantized_gemv import GemvLaunch, fp8_gemv

    gen = torch.Generator().manual_seed(rows + in_features)
    scheme = QuantScheme("fp8", per_channel=per_channel)
    stored = {k: v.to(DEVICE) for k, v in quantize_weight(scheme, torch.randn(out_features, in_features, generator=gen)).items()}
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    x[-1] = 0  # an all-zero row: its scale is 1, not 0
    x = x.to(DEVICE)
    bias = torch.randn(out_features, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    want = ops.fp8_linear(x, stored["qweight"], stored["scale"], bias).double()
    got = fp8_gemv(x, stored["qweight"], stored["scale"], bias, launch=GemvLaunch())
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
    assert (got.double() - want).norm() / want.norm() <= (1e-5 if dtype == torch.float32 else 1e-2)


# The few-row tile kernel (tl.dot over dequantized tiles; fp8 × fp8): Triton's interpreter garbles a bfloat16
# tl.dot (numpy has no such type), so bfloat16 runs on the GPU only. One row is padded to tl.dot's 16; 70
# rows take two 64-row blocks; TMA launches fetch tiles past the edges as zeros (96 columns: a partial step).
_TILE_DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


@pytest.mark.parametrize("dtype", _TILE_DTYPES)
@pytest.mark.parametrize("scheme", ["int8_wo", "int4_wo", "fp8", "fp8_static"])
@pytest.mark.parametrize(("rows", "out_features", "in_features", "launch"),
                         [(1, 40, 256, dict(block_k=256)), (2, 40, 256, None), (20, 16, 96, dict(block_n=16, block_k=32)),
                          (70, 72, 128, dict(block_n=64)), (3, 40, 96, dict(block_k=64, tma=True)),
                          (70, 72, 128, dict(block_n=64, tma=True)), (5, 40, 128, dict(packed_dequant=True)),
                          (3, 40, 256, dict(block_k=32, split_k=3)), (70, 40, 160, dict(block_k=32, split_k=2, tma=True))],
                         ids=str)
def test_the_tile_kernel_matches_the_reference(dtype, scheme, rows, out_features, in_features, launch,
                                               interpreter_rounds_to_fp8_correctly):
    from autodeploy.custom_ops.triton.quantized_gemv import TileLaunch, fp8_gemv, int4_wo_gemv, int8_wo_gemv

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = (torch.randn(rows, in_features, generator=gen) + 0.5).to(dtype).to(DEVICE)
    x[-1] = 0  # an all-zero row: fp8's scale is 1 there, not 0
    bias = torch.randn(out_features, generator=gen).to(dtype).to(DEVICE)
    config = TileLaunch(**(launch or {}))
    if scheme == "int4_wo":
        s = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("int4_wo", group_size=32), weight).items()}
        got = int4_wo_gemv(x, s["qweight"], s["scale"], s["zero"], bias, launch=config)
        want = ops.int4_wo_linear(x, s["qweight"], s["scale"], s["zero"], bias)
    elif scheme == "int8_wo":
        s = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("int8_wo"), weight).items()}
        got, want = int8_wo_gemv(x, s["qweight"], s["scale"], bias, launch=config), ops.int8_wo_linear(x, s["qweight"], s["scale"], bias)
    else:
        s = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("fp8"), weight).items()}
        if scheme == "fp8":
            got, want = fp8_gemv(x, s["qweight"], s["scale"], bias, launch=config), ops.fp8_linear(x, s["qweight"], s["scale"], bias)
        else:
            input_scale = torch.tensor([0.01], device=DEVICE)  # saturates the largest inputs: both must clamp alike
            got = fp8_gemv(x, s["qweight"], s["scale"], bias, input_scale, launch=config)
            want = ops.fp8_static_linear(x, s["qweight"], s["scale"], input_scale, bias)
    assert got.dtype == dtype and got.shape == want.shape == (rows, out_features) and torch.isfinite(got).all()
    assert (got.double() - want.double()).norm() / want.double().norm() <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_packed_int4_dequantisation_compiles_for_hopper(dtype):
    # Its inline PTX runs on a GPU only (the tile test above covers it there); here ptxas assembles it for sm_90.
    from autodeploy.custom_ops.triton import quantized_gemv
    from tests.hopper_compile import compile_for_hopper, describe_launch

    kernel = getattr(quantized_gemv._tile_kernel, "fn", quantized_gemv._tile_kernel)
    x, out = torch.empty(16, 256, dtype=dtype), torch.empty(16, 64, dtype=dtype)
    packed, scale, zero = torch.empty(64, 128, dtype=torch.uint8), torch.empty(64, 2), torch.empty(64, 2, dtype=torch.uint8)
    launch = describe_launch(kernel, (x, scale, packed, scale, zero, out, out, None, None, 16, 64, 256, 256, 128, 2), dict(
        SCHEME=1, GROUP=128, HAS_BIAS=False, TMA=False, PACKED_DEQUANT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
        USE_PDL=True, num_warps=4, num_stages=3))
    assert compile_for_hopper([launch]) == []


def test_several_rows_take_the_tile_kernel_and_one_row_or_float32_the_gemv(monkeypatch):
    from autodeploy.custom_ops.triton import quantized_gemv

    launched = []
    monkeypatch.setattr(quantized_gemv, "_tile", lambda *args: launched.append("tile"))
    weight = quantize_weight(QuantScheme("int8_wo"), torch.randn(16, 64))
    for rows, dtype in [(3, torch.float16), (1, torch.float16), (3, torch.float32)]:
        quantized_gemv.int8_wo_gemv(torch.randn(rows, 64, dtype=dtype).to(DEVICE), weight["qweight"].to(DEVICE),
                                    weight["scale"].to(DEVICE), None)
    assert launched == ["tile"]  # one row: the GEMV (default_launch); float32 rows: the GEMV (no float32 tensor-core dot)


def test_int4_launches_follow_the_sweep_split_packed_tiles_for_rows_and_for_gate_up():
    from autodeploy.custom_ops.triton.quantized_gemv import _INT4, GemvLaunch, TileLaunch, _gemv_launch, default_launch

    # An H200's 132 SMs at Llama-3-8B's projections (q/k/v 6,144 rows: wide; o_proj 4,096; gate/up 28,672).
    assert default_launch(_INT4, 32, 6144, 132) == TileLaunch(block_n=64, block_k=128, num_stages=5, tma=True,
                                                              packed_dequant=True, split_k=4)
    assert default_launch(_INT4, 8, 4096, 132) == TileLaunch(block_n=64, block_k=128, num_stages=3, tma=True,
                                                             packed_dequant=True, split_k=4)
    assert default_launch(_INT4, 32, 28672, 132).split_k == 2  # gate/up: 448 tiles fill the SMs already
    assert default_launch(_INT4, 64, 4096, 132) == TileLaunch(block_n=32, block_k=128, num_stages=5, packed_dequant=True)
    assert default_launch(_INT4, 1, 28672, 132) == TileLaunch(block_n=64, block_k=128, num_stages=3, tma=True,
                                                              packed_dequant=True, split_k=2)
    assert default_launch(_INT4, 1, 6144, 132) == default_launch(_INT4, 1, 4096, 132) == TileLaunch(
        block_n=64, block_k=128, num_stages=3, tma=True, packed_dequant=True, split_k=4)  # the GEMV lost at one row too
    assert _gemv_launch(_INT4, 6144, 132) == GemvLaunch(block_n=8, words=256)  # float32 rows, groups under 16


def test_fp8_splits_only_the_deep_narrow_weight_at_few_rows():
    from autodeploy.custom_ops.triton.quantized_gemv import _FP8, default_launch

    # The 2026-12-04 sweep: down (4,096 × 14,336) gains from two programs a tile at 1 and 32 rows; q/k/v,
    # o_proj and gate/up do not.
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for rows, name in [(1, "down"), (32, "down"), (1, "qkv"), (1, "o_proj"), (1, "gate_up"), (256, "down")]:
        assert default_launch(_FP8, rows, shapes[name][0], 132, shapes[name][1]).split_k == (
            2 if name == "down" and rows <= 32 else 1)


def test_fp8_takes_the_tile_kernel_at_any_rows_of_half_precision_and_the_gemv_for_float32(monkeypatch):
    from autodeploy.custom_ops.triton import quantized_gemv

    launched = []
    monkeypatch.setattr(quantized_gemv, "_tile", lambda *args: launched.append("tile"))
    weight = quantize_weight(QuantScheme("fp8"), torch.randn(16, 64))
    for rows, dtype in [(3, torch.bfloat16), (1, torch.bfloat16), (3, torch.float32), (1, torch.float32)]:
        quantized_gemv.fp8_gemv(torch.randn(rows, 64, dtype=dtype).to(DEVICE), weight["qweight"].to(DEVICE),
                                weight["scale"].to(DEVICE), None)
    assert launched == ["tile", "tile"]  # float32: the GEMV's float32 sums (Hopper's e4m3 MMA accumulates with fewer bits)


@pytest.mark.parametrize("launch", [dict(block_n=8, groups_per_step=2), dict(block_n=32, groups_per_step=4, num_stages=2),
                                    dict(block_n=16, block_k=32, num_warps=2)], ids=str)
def test_the_gemv_kernels_compute_the_same_under_every_launch_the_sweep_tries(launch, interpreter_rounds_to_fp8_correctly):
    # Four int4 groups a step over seven groups: the last step masks one; 32-column int8/fp8 steps over 224.
    from autodeploy.custom_ops.triton.quantized_gemv import GemvLaunch, fp8_gemv, int4_wo_gemv, int8_wo_gemv

    config = GemvLaunch(**launch)
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(40, 224, generator=gen)
    x = (torch.randn(2, 224, generator=gen) + 0.5).to(DEVICE)
    int4 = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("int4_wo", group_size=32), weight).items()}
    int8 = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("int8_wo"), weight).items()}
    fp8 = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("fp8"), weight).items()}
    pairs = [(int4_wo_gemv(x, int4["qweight"], int4["scale"], int4["zero"], None, launch=config),
              ops.int4_wo_linear(x, int4["qweight"], int4["scale"], int4["zero"], None)),
             (int8_wo_gemv(x, int8["qweight"], int8["scale"], None, launch=config),
              ops.int8_wo_linear(x, int8["qweight"], int8["scale"], None)),
             (fp8_gemv(x, fp8["qweight"], fp8["scale"], None, launch=config), ops.fp8_linear(x, fp8["qweight"], fp8["scale"], None))]
    for got, want in pairs:
        assert (got.double() - want.double()).norm() / want.double().norm() <= 1e-5


def test_the_triton_backends_serve_cuda_deploys_only_and_name_what_they_cannot_take():
    from autodeploy.custom_ops import candidates

    int4 = next(b for b in candidates("int4_wo_linear") if b.name == "triton")
    meta = dict(device="meta")
    x = torch.empty(1, 256, dtype=torch.bfloat16, **meta)
    args = (x, torch.empty(64, 128, dtype=torch.uint8, **meta), torch.empty(64, 2, **meta),
            torch.empty(64, 2, dtype=torch.uint8, **meta), None)
    assert int4.check(args, torch.device("cuda")) is None
    assert "CUDA" in int4.check(args, torch.device("cpu"))
    odd_groups = (x[:, :192], torch.empty(64, 96, dtype=torch.uint8, **meta), torch.empty(64, 2, **meta),
                  torch.empty(64, 2, dtype=torch.uint8, **meta), None)
    assert "power of two" in int4.check(odd_groups, torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [True, False])
def test_the_fp8_scaled_mm_backend_matches_the_reference(dtype, per_channel):
    gen = torch.Generator().manual_seed(2)
    stored = quantize_weight(QuantScheme("fp8", per_channel=per_channel), torch.randn(32, 64, generator=gen))
    x, bias = torch.randn(2, 3, 64, generator=gen).to(dtype), torch.randn(32, generator=gen).to(dtype)
    from autodeploy.custom_ops import candidates

    scaled_mm = next(b for b in candidates("fp8_linear") if b.name == "torch")
    refused = scaled_mm.check([x, stored["qweight"], stored["scale"], bias], torch.device("cpu"))
    if refused:
        pytest.skip(refused)
    want = ops.fp8_linear(x, stored["qweight"], stored["scale"], bias).double()
    got = ops.fp8_linear_torch(x, stored["qweight"], stored["scale"], bias)
    assert got.dtype == dtype and got.shape == want.shape == (2, 3, 32)
    assert (got.double() - want).norm() / want.norm() <= (1e-5 if dtype == torch.float32 else 1e-2)


def _awq_inputs(seed: int = 4):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(12, 64, generator=gen, dtype=torch.float64)
    activations = torch.randn(200, 64, generator=gen, dtype=torch.float64) * torch.logspace(-1, 1, 64, dtype=torch.float64)
    statistics = {"mean_abs": activations.abs().mean(0).float(), "mean_square": activations.square().mean(0).float()}
    return weight, activations, statistics


def test_int4_awq_equals_a_float64_product_over_its_effective_weight():
    weight, activations, statistics = _awq_inputs()
    scheme = QuantScheme("int4_awq", group_size=16)
    stored = quantize_weight(scheme, weight, statistics)
    assert set(stored) == {"qweight", "scale", "zero", "smooth"} and stored["smooth"].shape == (64,)
    x = activations[:5].float()
    got = ops.int4_awq_linear(x, *stored.values(), None)
    torch.testing.assert_close(got.double(), _dot(x, dequantize_weight(scheme, stored, torch.float64), None),
                               rtol=1e-5, atol=1e-5)


def test_int4_awq_never_reconstructs_the_layers_output_worse_than_round_to_nearest():
    weight, activations, statistics = _awq_inputs()
    errors = {}
    for name in ("int4_wo", "int4_awq"):
        scheme = QuantScheme(name, group_size=16)
        effective = dequantize_weight(scheme, quantize_weight(scheme, weight, statistics), torch.float64)
        errors[name] = ((activations @ effective.T - activations @ weight.T).square().sum()).item()
    # channels of very different scales: protecting the large ones pays
    assert errors["int4_awq"] < 0.9 * errors["int4_wo"], errors
    with pytest.raises(ValueError, match="needs the layer's calibration statistics"):
        quantize_weight(QuantScheme("int4_awq", group_size=16), weight)


def test_the_int4_awq_backends_match_the_reference():
    weight, activations, statistics = _awq_inputs(5)
    stored = {k: v.to(DEVICE) for k, v in quantize_weight(QuantScheme("int4_awq", group_size=16), weight, statistics).items()}
    x = activations[:3].float().to(DEVICE)
    want = ops.int4_awq_linear(x, *stored.values(), None).double()
    for backend in (ops.int4_awq_linear_torch, ops.int4_awq_linear_triton):
        got = backend(x, *stored.values(), None)
        assert (got.double() - want).norm() / want.norm() <= 1e-5


def test_int4_gptq_reconstructs_correlated_inputs_far_better_than_round_to_nearest():
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(32, 128, generator=gen)
    inputs = torch.randn(500, 16, generator=gen) @ torch.randn(16, 128, generator=gen) + 0.1 * torch.randn(500, 128, generator=gen)
    statistics = {"hessian": inputs.T @ inputs / len(inputs)}
    errors = {}
    for name in ("int4_wo", "int4_gptq"):
        scheme = QuantScheme(name, group_size=32)
        stored = quantize_weight(scheme, weight, statistics)
        assert set(stored) == {"qweight", "scale", "zero"}  # int4_wo's layout: the same op serves both
        errors[name] = ((inputs @ dequantize_weight(scheme, stored).T - inputs @ weight.T).square().sum()).item()
    assert errors["int4_gptq"] < 0.25 * errors["int4_wo"], errors
    with pytest.raises(ValueError, match="needs the layer's calibration Hessian"):
        quantize_weight(QuantScheme("int4_gptq", group_size=32), weight, {"mean_abs": torch.ones(128)})


# SmoothQuant (W8A8): int8 weights of w · diag(s), int8 activations of x · (1/s) per token.
def _outlier_inputs(tokens: int, columns: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, columns, generator=gen)
    x[:, :: max(1, columns // 4)] *= 40.0  # a few outlier channels, as LLM activations have
    return x


def test_smoothquant_stores_the_weight_times_s_and_its_effective_weight_is_the_original():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 64, generator=gen), _outlier_inputs(32, 64, 1)
    stored = quantize_weight(QuantScheme("smoothquant", alpha=0.5), w, {"max_abs": x.abs().amax(0)})
    assert stored["qweight"].dtype == torch.int8 and stored["smooth"].shape == (64,)
    s = x.abs().amax(0).sqrt() / w.abs().amax(0).sqrt()
    assert torch.allclose(1 / stored["smooth"], s, rtol=1e-6)
    effective = dequantize_weight(QuantScheme("smoothquant"), stored)  # (q · scale) · diag(smooth)
    step = (stored["scale"][:, None] * stored["smooth"][None, :]).double()
    assert ((effective.double() - w.double()).abs() <= step / 2 + 1e-6).all()


def test_the_w8a8_reference_rounds_activations_per_token_and_sums_exactly():
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(16, 48, generator=gen), _outlier_inputs(5, 48, 3)
    stored = quantize_weight(QuantScheme("smoothquant"), w, {"max_abs": x.abs().amax(0)})
    bias = torch.randn(16, generator=gen)
    got = ops.int8_w8a8_linear(x, stored["qweight"], stored["scale"], stored["smooth"], bias)
    smoothed = x * stored["smooth"]
    x_scale = smoothed.abs().amax(-1, keepdim=True) / 127
    x_q = torch.round(smoothed / x_scale).clamp(-127, 127)
    want = (x_q.double() @ stored["qweight"].double().T) * x_scale.double() * stored["scale"].double() + bias.double()
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)


def test_projections_over_one_input_share_one_smoothing_and_a_smoothed_input_needs_none():
    # q, k and v read one input: with their group's largest weights (share_smoothing), each finds the same s,
    # so the factors can move into the norm before them (fold_smoothing) and each op take x as it is.
    gen = torch.Generator().manual_seed(3)
    x = _outlier_inputs(8, 64, 2)
    weights = {name: torch.randn(rows, 64, generator=gen) * (i + 1) for i, (name, rows) in enumerate((("q", 32), ("k", 16), ("v", 16)))}
    statistics = {name: {"max_abs": x.abs().amax(0), "weight_max_abs": w.abs().amax(0)} for name, w in weights.items()}
    statistics["o"] = {"max_abs": torch.ones(64), "weight_max_abs": torch.ones(64)}
    shared = share_smoothing(statistics, [("q", "k", "v"), ("absent", "o")])
    assert shared["o"] is statistics["o"]  # a group of one known projection: as it was
    largest = torch.stack([w.abs().amax(0) for w in weights.values()]).amax(0)
    stored = {name: quantize_weight(QuantScheme("smoothquant"), w, shared[name]) for name, w in weights.items()}
    for name in "kv":
        assert torch.equal(stored[name]["smooth"], stored["q"]["smooth"])
    assert torch.allclose(1 / stored["q"]["smooth"], x.abs().amax(0).sqrt() / largest.sqrt(), rtol=1e-6)
    # The smoothed input, fed to the op without smoothing, gives what the op computes with its smoothing.
    smooth, stored_q = stored["q"]["smooth"], stored["q"]
    with_smoothing = ops.int8_w8a8_linear(x, stored_q["qweight"], stored_q["scale"], smooth, None)
    folded = ops.int8_w8a8_linear(x * smooth, stored_q["qweight"], stored_q["scale"], None, None)
    assert torch.equal(with_smoothing, folded)
    assert torch.equal(ops.int8_w8a8_linear_torch(x * smooth, stored_q["qweight"], stored_q["scale"], None, None),
                       ops.int8_w8a8_linear_torch(x, stored_q["qweight"], stored_q["scale"], smooth, None))



def test_projections_over_attention_share_smoothing_per_value_channel():
    # o_proj's inputs are [kv_heads, group, head_dim]: the query heads that share a key-value head take the
    # largest inputs and weights among them, so s is one per value channel (fold_smoothing: into v_proj).
    from autodeploy.custom_ops.quantized_linear import share_head_smoothing

    gen = torch.Generator().manual_seed(0)
    stats = {key: torch.rand(2 * 3 * 4, generator=gen) + 0.1 for key in ("max_abs", "weight_max_abs")}
    shared = share_head_smoothing({"o": {**stats, "mean_abs": torch.ones(24)}, "q": stats}, [("o", 2, 3, 4), ("absent", 1, 1, 1)])
    for key in ("max_abs", "weight_max_abs"):
        grouped = shared["o"][key].reshape(2, 3, 4)
        assert torch.equal(grouped, stats[key].reshape(2, 3, 4).amax(1, keepdim=True).expand(2, 3, 4))
    assert shared["q"] is stats and torch.equal(shared["o"]["mean_abs"], torch.ones(24))
    stored = quantize_weight(QuantScheme("smoothquant"), torch.randn(8, 24, generator=gen), shared["o"])
    smooth = stored["smooth"].reshape(2, 3, 4)
    assert torch.equal(smooth, smooth[:, :1].expand(2, 3, 4))

def test_smoothing_beats_plain_w8a8_on_activations_with_outlier_channels():
    # alpha = 0 leaves the activations' outliers where they are (s = 1 / max|w|), so each token's int8 grid is
    # set by its outliers; alpha = 0.5 moves half of their range into the weights.
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(64, 128, generator=gen) * 0.05, _outlier_inputs(64, 128, 5)
    want = x.double() @ w.double().T
    errors = {}
    for alpha in (0.0, 0.5):
        stored = quantize_weight(QuantScheme("smoothquant", alpha=alpha), w, {"max_abs": x.abs().amax(0)})
        got = ops.int8_w8a8_linear(x, stored["qweight"], stored["scale"], stored["smooth"], None)
        errors[alpha] = ((got.double() - want).norm() / want.norm()).item()
    assert errors[0.5] < 0.5 * errors[0.0], errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int_mm_backend_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(6)
    w, x = torch.randn(32, 64, generator=gen), _outlier_inputs(6, 64, 7).reshape(2, 3, 64)
    stored = quantize_weight(QuantScheme("smoothquant"), w, {"max_abs": x.reshape(-1, 64).abs().amax(0)})
    bias = torch.randn(32, generator=gen).to(dtype)
    args = (x.to(dtype), stored["qweight"], stored["scale"], stored["smooth"], bias)
    want = ops.int8_w8a8_linear(*args).double()
    got = ops.int8_w8a8_linear_torch(*args)
    assert got.dtype == dtype and got.shape == (2, 3, 32)
    assert (got.double() - want).norm() / want.norm() <= (1e-6 if dtype == torch.float32 else 1e-2)


# fp8 with static activation scales: one input_scale per layer, from calibration's max |x|.
def test_static_fp8_uses_one_scale_for_every_token_and_saturates_past_it():
    gen = torch.Generator().manual_seed(8)
    w, x = torch.randn(16, 32, generator=gen), torch.randn(4, 32, generator=gen)
    scheme = QuantScheme("fp8", static_activations=True)
    assert scheme.calibrated and scheme.op is ops.fp8_static_linear.default
    stored = quantize_weight(scheme, w, {"max_abs": torch.full((32,), 2.0)})
    assert torch.equal(stored["input_scale"], torch.tensor([2.0 / FP8_MAX]))
    x[0, 0] = 50.0  # past the calibrated range: saturates at 448 · input_scale = 2
    got = ops.fp8_static_linear(x, stored["qweight"], stored["scale"], stored["input_scale"], None)
    rounded = (x / stored["input_scale"]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * stored["input_scale"]
    assert rounded[0, 0] == 2.0
    want = rounded.double() @ dequantize_weight(QuantScheme("fp8"), stored, torch.float64).T
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def _static_fp8_case(dtype):
    gen = torch.Generator().manual_seed(9)
    stored = quantize_weight(QuantScheme("fp8", static_activations=True), torch.randn(32, 64, generator=gen),
                             {"max_abs": torch.full((64,), 3.0)})
    x, bias = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(32, generator=gen).to(dtype)
    return [t.to(DEVICE) for t in (x, stored["qweight"], stored["scale"], stored["input_scale"], bias)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_gemv_with_a_static_scale_matches_the_reference(dtype, interpreter_rounds_to_fp8_correctly):
    from autodeploy.custom_ops.triton.quantized_gemv import fp8_gemv

    x, qweight, scale, input_scale, bias = _static_fp8_case(dtype)
    want = ops.fp8_static_linear(x, qweight, scale, input_scale, bias).double()
    got = fp8_gemv(x, qweight, scale, bias, input_scale)
    assert got.dtype == dtype and (got.double() - want).norm() / want.norm() <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_static_fp8_scaled_mm_backend_matches_the_reference(dtype):
    from autodeploy.custom_ops import candidates

    args = _static_fp8_case(dtype)
    scaled_mm = next(b for b in candidates("fp8_static_linear") if b.name == "torch")
    refused = scaled_mm.check(args, torch.device(DEVICE))
    if refused:
        pytest.skip(refused)
    want = ops.fp8_static_linear(*args).double()
    got = ops.fp8_static_linear_torch(*args)
    assert got.dtype == dtype and (got.double() - want).norm() / want.norm() <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_the_triton_scaled_mm_backend_matches_the_reference(static, rows, interpreter_rounds_to_fp8_correctly):
    """The Triton row quantizer, then torch._scaled_mm: the per-token (or static) rounding's bits, the
    product the reference's up to bfloat16's output rounding."""
    from autodeploy.custom_ops import candidates

    op_name = "fp8_static_linear" if static else "fp8_linear"
    gen = torch.Generator().manual_seed(rows)
    stored = quantize_weight(QuantScheme("fp8", static_activations=static), torch.randn(48, 64, generator=gen),
                             {"max_abs": torch.full((64,), 3.0)} if static else None)
    x, bias = torch.randn(rows, 64, generator=gen).to(torch.bfloat16), torch.randn(48, generator=gen).to(torch.bfloat16)
    args = [t.to(DEVICE) for t in (x, stored["qweight"], stored["scale"], *([stored["input_scale"]] if static else []), bias)]
    backend = next(b for b in candidates(op_name) if b.name == "triton_scaled_mm")
    if DEVICE == "cuda":
        refused = backend.check(args, torch.device(DEVICE))
        if refused:
            pytest.skip(refused)
        got = backend.op(*args)
    else:  # the backend serves CUDA deploys only; its kernel runs in the interpreter, beside the CPU's _scaled_mm
        from autodeploy.custom_ops.quantized_linear import _cpu_takes_row_wise_scales
        from autodeploy.custom_ops.triton.quantized_gemv import fp8_scaled_mm

        if not _cpu_takes_row_wise_scales():
            pytest.skip(f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only")
        got = fp8_scaled_mm(*args[:3], args[-1], args[3] if static else None)
    want = getattr(ops, op_name)(*args).double()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    assert (got.double() - want).norm() / want.norm() <= 1e-2


def test_the_triton_scaled_mm_backend_names_what_it_cannot_take():
    from autodeploy.custom_ops import candidates

    backend = next(b for b in candidates("fp8_linear") if b.name == "triton_scaled_mm")
    meta = dict(device="meta")
    args = [torch.empty(3, 64, dtype=torch.float16, **meta), torch.empty(48, 64, dtype=torch.float8_e4m3fn, **meta),
            torch.empty(48, **meta), None]
    assert "CUDA" in backend.check(args, torch.device("cpu")) or "scaled" in backend.check(args, torch.device("cpu"))
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        assert "bfloat16" in backend.check(args, torch.device("cuda"))  # cuBLASLt's row-wise scaling writes bfloat16
