"""The Triton backends of rms_norm, add_rms_norm, layer_norm, rope, gated_activation, gated_mlp and fused_gated_mlp against
their float32 references (the few-row linear's kernel: ``test_skinny_gemm.py``); every backend's supports().

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``tests/conftest.py`` sets
TRITON_INTERPRET), which is slow, so the shapes are tiny; they still reach every masked edge: hidden
sizes and rotary dims that are not powers of 2, rows and heads that do not fill a program, partial
rotary, strided inputs (the two halves of one gate/up GEMM output). The accuracy contract:
``‖out − ref‖ / ‖ref‖`` at most 1e-5 in float32 and 1e-2 in float16 and bfloat16 (element-wise kernels,
so the interpreter handles bfloat16 too).
"""

from __future__ import annotations

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import canonical_ops, triton_backends
from autodeploy.custom_ops.add_rms_norm import add_rms_norm_reference
from autodeploy.custom_ops.fused_gated_mlp import fused_gated_mlp_reference
from autodeploy.custom_ops.gated_activation import gated_activation_reference
from autodeploy.custom_ops.gated_mlp import gated_mlp_reference
from autodeploy.custom_ops.layer_norm import layer_norm_reference
from autodeploy.custom_ops.rms_norm import rms_norm_reference
from autodeploy.custom_ops.rope import rope_reference
from autodeploy.custom_ops.triton import gated_activation, norms, rope, skinny_gemm, triton_unavailable
from tests.custom_ops.activation_formulas import ACTIVATION_FORMULAS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def random(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape and dtype, contiguous, and within the dtype's relative-error contract."""
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    error = ((got.double() - expected.double()).norm() / expected.double().norm()).item()
    assert error <= TOLERANCE[got.dtype], f"relative error {error:.2e} over {TOLERANCE[got.dtype]:.0e} ({got.dtype})"


# --- rms_norm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, weight_offset", [((2, 3, 40), 0.0), ((5, 64), 1.0), ((1, 1, 200), 0.0)])
def test_rms_norm(dtype, shape, weight_offset):
    x = random(*shape, dtype=dtype, scale=3.0)
    weight = random(shape[-1], dtype=dtype, seed=1) * 0.1 + (0.0 if weight_offset else 1.0)  # Gemma: weight - 1
    got = torch.ops.autodeploy.rms_norm_triton.default(x, weight, 1e-6, weight_offset)
    assert_matches(got, rms_norm_reference(x, weight, 1e-6, weight_offset))


def test_rms_norm_of_strided_rows():
    weight = random(48, seed=1)
    row_strided = random(4, 3, 100)[..., 10:58]  # a slice of a fused projection: rows 100 apart, read in place
    column_strided = random(4, 48, 3).transpose(1, 2)  # last dim not contiguous: copied first
    for x in (row_strided, column_strided):
        assert_matches(norms.rms_norm_triton(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))


def test_rms_norm_of_float32_weights_in_half_precision():
    # supports() admits only weights in x's dtype, but the kernel reads any weight in float32, as the reference.
    x, weight = random(3, 40, dtype=torch.float16), random(40, seed=1)
    assert_matches(norms.rms_norm_triton(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


# --- add_rms_norm ---------------------------------------------------------------------------------------


def assert_sum_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The sum output: bit-equal, except bfloat16 in Triton's interpreter, which truncates float32 to
    bfloat16 where a GPU rounds to nearest even (so there only the rounding contract holds)."""
    if got.dtype == torch.bfloat16 and DEVICE == "cpu":
        assert_matches(got, expected)
    else:
        assert torch.equal(got, expected) and got.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, weight_offset", [((1, 40), 0.0), ((5, 64), 1.0), ((2, 3, 200), 0.0)])
def test_add_rms_norm(dtype, shape, weight_offset):
    # One row; several rows that do not fill a program; hidden sizes that are not powers of 2; Gemma's offset.
    x, residual = random(*shape, dtype=dtype, scale=3.0), random(*shape, dtype=dtype, seed=2)
    weight = random(shape[-1], dtype=dtype, seed=1) * 0.1 + (0.0 if weight_offset else 1.0)
    normed, total = torch.ops.autodeploy.add_rms_norm_triton.default(x, residual, weight, 1e-6, weight_offset)
    expected_normed, expected_total = add_rms_norm_reference(x, residual, weight, 1e-6, weight_offset)
    assert_matches(normed, expected_normed)
    assert_sum_matches(total, expected_total)


def test_add_rms_norm_of_strided_rows():
    weight = random(48, seed=1)
    row_strided = random(4, 3, 100)[..., 10:58]  # read in place
    column_strided = random(4, 48, 3, seed=2).transpose(1, 2)  # copied first
    for x, residual in ((row_strided, column_strided), (column_strided, row_strided)):
        normed, total = norms.add_rms_norm_triton(x, residual, weight, 1e-5)
        expected_normed, expected_total = add_rms_norm_reference(x, residual, weight, 1e-5)
        assert_matches(normed, expected_normed)
        assert_sum_matches(total, expected_total)


# --- layer_norm -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, has_weight, has_bias",
    [(torch.float32, True, True), (torch.float16, True, True), (torch.bfloat16, True, True),
     (torch.float32, True, False), (torch.float32, False, True), (torch.float16, False, False)],
)
def test_layer_norm(dtype, has_weight, has_bias):
    x = random(2, 3, 40, dtype=dtype, scale=2.0)
    weight = random(40, dtype=dtype, seed=1) if has_weight else None
    bias = random(40, dtype=dtype, seed=2) if has_bias else None
    got = torch.ops.autodeploy.layer_norm_triton.default(x, weight, bias, 1e-5)
    assert_matches(got, layer_norm_reference(x, weight, bias, 1e-5))


def test_layer_norm_of_rows_far_from_zero():
    # Centring before squaring keeps the variance where E[x²] - E[x]² would cancel to nothing.
    x = random(6, 40) + 100.0
    weight, bias = random(40, seed=1), random(40, seed=2)
    assert_matches(norms.layer_norm_triton(x, weight, bias, 1e-5), layer_norm_reference(x, weight, bias, 1e-5))


def test_every_norm_config():
    x, weight, bias = random(7, 24), random(24, seed=1), random(24, seed=2)
    expected_rms, expected_layer = rms_norm_reference(x, weight, 1e-6), layer_norm_reference(x, weight, bias, 1e-5)
    residual = random(7, 24, seed=3)
    expected_normed, expected_total = add_rms_norm_reference(x, residual, weight, 1e-6)
    for config in norms.valid_configs(24):
        assert_matches(norms.rms_norm_triton(x, weight, 1e-6, config=config), expected_rms)
        assert_matches(norms.layer_norm_triton(x, weight, bias, 1e-5, config=config), expected_layer)
        normed, total = norms.add_rms_norm_triton(x, residual, weight, 1e-6, config=config)
        assert_matches(normed, expected_normed)
        assert_sum_matches(total, expected_total)


# --- rope -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (20, 12)])  # full; partial, 6 pairs, 8 passed through
def test_rope(dtype, interleaved, head_dim, rotary_dim):
    x = random(2, 3, 5, head_dim, dtype=dtype)
    # Arbitrary cos/sin, not HF's repeated halves: the kernel reads both dims of every pair, as the reference.
    cos, sin = random(2, 3, rotary_dim, dtype=dtype, seed=1), random(2, 3, rotary_dim, dtype=dtype, seed=2)
    got = torch.ops.autodeploy.rope_triton.default(x, cos, sin, interleaved)
    assert_matches(got, rope_reference(x, cos, sin, interleaved))


@pytest.mark.parametrize("angles_shape", [(1, 4, 8), (2, 1, 8), (1, 1, 8)])
def test_rope_broadcasts_angles(angles_shape):
    x = random(2, 4, 3, 8)
    cos, sin = random(*angles_shape, seed=1), random(*angles_shape, seed=2)
    assert_matches(rope.rope_triton(x, cos, sin), rope_reference(x, cos, sin))


def test_rope_of_strided_queries():
    # The rope patterns hand the op q.transpose(1, 2) of HF's [B, H, S, D]; cos in float32 with half x.
    x = random(2, 3, 4, 24, dtype=torch.float16).transpose(1, 2)
    cos, sin = random(2, 4, 16, seed=1), random(2, 4, 16, seed=2)
    assert not x.is_contiguous()
    for interleaved in (False, True):
        assert_matches(rope.rope_triton(x, cos, sin, interleaved), rope_reference(x, cos, sin, interleaved))


def test_every_rope_config():
    x, cos, sin = random(1, 2, 3, 12), random(1, 2, 8, seed=1), random(1, 2, 8, seed=2)
    expected = rope_reference(x, cos, sin)
    for config in rope.valid_configs(12, 8):
        assert_matches(rope.rope_triton(x, cos, sin, config=config), expected)


def test_default_configs_are_valid():
    for hidden in (1, 24, 896, 4096, 5120, 20480, norms.MAX_HIDDEN):
        for num_rows in (1, 3, 8192):
            assert norms.norm_config(num_rows, hidden) in norms.valid_configs(hidden)
    for heads in (1, 5, 32, 128):
        for head_dim, rotary_dim in ((64, 64), (80, 32), (128, 128), (256, 64), (rope.MAX_HEAD_DIM, 2)):
            assert rope.rope_config(heads, head_dim, rotary_dim) in rope.valid_configs(head_dim, rotary_dim)
    for num_rows in (1, 7, 8192, 1 << 17):
        for inner in (1, 300, 14336, 28672):
            assert gated_activation.activation_config(num_rows, inner) in gated_activation.CONFIGS
    assert len(norms.valid_configs(norms.MAX_HIDDEN)) > 0


# --- gated activation and gated_mlp ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", gated_activation.ACTIVATIONS)
def test_gated_activation(dtype, activation):
    gate, up = random(3, 333, dtype=dtype, scale=3.0), random(3, 333, dtype=dtype, seed=1)
    expected = (ACTIVATION_FORMULAS[activation](gate.float()) * up.float()).to(dtype)
    assert_matches(gated_activation.gated_activation(gate, up, activation), expected)


def test_gated_activation_in_place_and_every_config():
    gate, up = random(1000), random(1000, seed=1)
    expected = ACTIVATION_FORMULAS["silu"](gate) * up
    for config in gated_activation.CONFIGS:
        assert_matches(gated_activation.gated_activation(gate, up, "silu", config=config), expected)
    out = up.clone()
    assert gated_activation.gated_activation(gate, out, "silu", out=out) is out
    assert_matches(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp(dtype, activation):
    x = random(2, 3, 32, dtype=dtype)
    gate_w, up_w = random(48, 32, dtype=dtype, seed=1, scale=0.2), random(48, 32, dtype=dtype, seed=2, scale=0.2)
    down_w = random(32, 48, dtype=dtype, seed=3, scale=0.2)
    got = torch.ops.autodeploy.gated_mlp_triton.default(x, gate_w, up_w, down_w, activation)
    assert_matches(got, gated_mlp_reference(x, gate_w, up_w, down_w, activation))


@pytest.mark.parametrize("rows", [1, 5])
def test_gated_activation_over_the_halves_of_one_tensor_in_place(rows):
    # 300 columns: a 256-wide block and a masked one per row; rows 600 apart, read and written in place.
    gate_up = random(rows, 600, scale=3.0)
    gate, up = gate_up[:, :300], gate_up[:, 300:]
    expected = ACTIVATION_FORMULAS["gelu"](gate) * up
    untouched = up.clone()
    assert gated_activation.gated_activation(gate, up, "gelu", out=gate) is gate
    assert_matches(gate.contiguous(), expected)
    assert torch.equal(up, untouched)


def test_gated_activation_over_every_config_and_layout():
    gate_up = random(2, 2, 2 * 300, scale=3.0)  # 3-D halves: the leading dims fold into one row stride
    gate, up = gate_up[..., :300], gate_up[..., 300:]
    expected = ACTIVATION_FORMULAS["silu"](gate) * up
    for config in gated_activation.CONFIGS:
        assert_matches(gated_activation.gated_activation(gate, up, "silu", config=config), expected)
    # Columns that are not contiguous are copied first (no layout the graph produces, but still right).
    column_strided = random(333, 6).t()
    assert_matches(gated_activation.gated_activation(column_strided, column_strided, "relu"),
                   ACTIVATION_FORMULAS["relu"](column_strided) * column_strided)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gated_activation_op_over_the_halves_of_a_fused_projection(backend, dtype):
    # What quantize_linear emits between a gated MLP's quantized projections, once fuse_gemms has
    # concatenated gate and up: the two halves of one [1, T, 2I] output, rows 2I apart.
    gate_up = random(1, 3, 2 * 300, dtype=dtype, scale=3.0)
    gate, up = gate_up[..., :300], gate_up[..., 300:]
    got = getattr(torch.ops.autodeploy, f"gated_activation_{backend}").default(gate, up, "silu")
    expected = gated_activation_reference(gate, up, "silu")
    assert expected.is_contiguous() and expected.shape == (1, 3, 300)
    assert_matches(got.contiguous(), expected)
    assert torch.allclose(expected.double(), (ACTIVATION_FORMULAS["silu"](gate.double()) * up.double()),
                          rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_the_gated_activation_op_refuses_mismatched_halves():
    with pytest.raises(ValueError, match="gate and up must share one shape and dtype"):
        gated_activation_reference(random(2, 8), random(2, 6), "silu")
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        gated_activation_reference(random(2, 8), random(2, 8), "swish")


def test_gated_activation_refuses_an_out_it_cannot_write_through():
    gate, up = random(4, 8), random(4, 8, seed=1)
    with pytest.raises(ValueError, match="out must have contiguous rows"):
        gated_activation.gated_activation(gate, up, "silu", out=random(8, 4).t())
    with pytest.raises(ValueError, match=r"out must be \(4, 8\) torch.float32"):
        gated_activation.gated_activation(gate, up, "silu", out=random(4, 8, dtype=torch.float16))
    empty = random(0, 8)
    assert gated_activation.gated_activation(empty, empty, "silu").shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "x_shape, activation",
    [((1, 32), "silu"), ((2, 3, 32), "gelu_tanh"), ((5, 32), "gelu"), ((4, 32), "relu")],
)
def test_fused_gated_mlp(dtype, x_shape, activation):
    x = random(*x_shape, dtype=dtype)
    gate_up_w = random(2 * 300, 32, dtype=dtype, seed=1, scale=0.2)  # I = 300: a masked column block
    down_w = random(32, 300, dtype=dtype, seed=3, scale=0.1)
    got = torch.ops.autodeploy.fused_gated_mlp_triton.default(x, gate_up_w, down_w, activation)
    assert_matches(got, fused_gated_mlp_reference(x, gate_up_w, down_w, activation))


def test_fused_gated_mlp_of_a_strided_input():
    x = random(32, 3).t()
    gate_up_w, down_w = random(96, 32, seed=1, scale=0.2), random(32, 48, seed=2, scale=0.2)
    assert not x.is_contiguous()
    got = gated_activation.fused_gated_mlp_triton(x, gate_up_w, down_w, "silu")
    assert_matches(got, fused_gated_mlp_reference(x, gate_up_w, down_w, "silu"))


# --- unsupported inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: norms.rms_norm_triton(random(2, 8, dtype=torch.float64), random(8), 1e-6), "float64"),
        (lambda: norms.layer_norm_triton(random(2, 8), random(7), None, 1e-5), r"weight must be \[H=8\]"),
        (lambda: norms.add_rms_norm_triton(random(2, 8), random(8), random(8), 1e-6), "residual must have x's shape"),
        (lambda: rope.rope_triton(random(1, 2, 3, 8), random(1, 2, 6), random(1, 2, 6)[..., :5]), "cos, sin"),
        (lambda: rope.rope_triton(random(1, 2, 3, 8), random(1, 2, 10), random(1, 2, 10)), "at most D=8"),
        (lambda: gated_activation.gated_activation(random(4), random(4), "swish"), "unknown activation"),
        (lambda: gated_activation.fused_gated_mlp_triton(random(2, 8), random(12, 8), random(8, 5), "silu"),
         r"expected gate_up \[2I, H=8\]"),
        (lambda: gated_activation.fused_gated_mlp_triton(random(2, 8), random(12, 8, dtype=torch.float16),
                                                         random(8, 6), "silu"), "gate_up torch.float16"),
    ],
)
def test_unsupported_inputs_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- registration and supports() -----------------------------------------------------------------------


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


SUPPORTED_NODES = {
    "rms_norm": (meta(2, 7, 4096), meta(4096), 1e-6),
    "add_rms_norm": (meta(2, 7, 4096), meta(2, 7, 4096), meta(4096), 1e-6, 1.0),
    "layer_norm": (meta(7, 768), meta(768), None, 1e-5),
    "rope": (meta(1, 32, 7, 128).transpose(1, 2), meta(1, 7, 128), meta(1, 7, 128), False),
    "gated_mlp": (meta(7, 4096), meta(14336, 4096), meta(14336, 4096), meta(4096, 14336), "silu"),
    "fused_gated_mlp": (meta(7, 4096), meta(28672, 4096), meta(4096, 14336), "silu"),
    "linear": (meta(1, 7, 4096), meta(6144, 4096), None),
    "add_rms_norm_fp8": (meta(7, 4096), meta(7, 4096), meta(4096), 1e-6, 0.0),
    "gated_activation_fp8": (meta(7, 14336), meta(7, 14336), "silu"),
    "fp8_prequantized_linear": (meta(7, 4096, dtype=torch.float8_e4m3fn), meta(7, 1, dtype=torch.float32),
                                meta(6144, 4096, dtype=torch.float8_e4m3fn), meta(6144, dtype=torch.float32), None,
                                torch.bfloat16),
}


def triton_backend(op_name: str):
    """``op_name``'s ``triton`` backend; ``fused_gated_mlp_skinny`` names ``fused_gated_mlp``'s ``triton_skinny``."""
    op_name, name = ("fused_gated_mlp", "triton_skinny") if op_name == "fused_gated_mlp_skinny" else (op_name, "triton")
    return next(backend for backend in canonical_ops()[op_name].backends if backend.name == name)


@pytest.mark.parametrize("op_name", sorted(SUPPORTED_NODES))
def test_supports_cuda_deploys_only(op_name):
    backend = triton_backend(op_name)
    assert backend.op is getattr(torch.ops.autodeploy, f"{op_name}_triton").default
    assert backend.check(SUPPORTED_NODES[op_name], CUDA) is None
    assert backend.check(SUPPORTED_NODES[op_name], CPU) == triton_unavailable(CPU)


@pytest.mark.parametrize(
    "op_name, args, reason",
    [
        ("rms_norm", (meta(2, 64, dtype=torch.float64), meta(64, dtype=torch.float64), 1e-6), "float64"),
        ("rms_norm", (meta(2, 64), meta(64, dtype=torch.float32), 1e-6), "weight in x's dtype"),
        ("rms_norm", (meta(2, 32769), meta(32769), 1e-6), "hidden sizes up to 32768"),
        ("add_rms_norm", (meta(2, 64), meta(2, 64, dtype=torch.float32), meta(64), 1e-6), "residual in x's dtype"),
        ("add_rms_norm", (meta(2, 64), meta(2, 64), meta(64, dtype=torch.float16), 1e-6), "weight in x's dtype"),
        ("add_rms_norm", (meta(2, 32769), meta(2, 32769), meta(32769), 1e-6), "hidden sizes up to 32768"),
        ("layer_norm", (meta(2, 64), None, meta(64, dtype=torch.float16), 1e-5), "bias in x's dtype"),
        ("rope", (meta(1, 2, 4, 2048), meta(1, 2, 64), meta(1, 2, 64), False), "head dims up to 1024"),
        ("rope", (meta(1, 2, 4, 64), meta(1, 2, 64, dtype=torch.float64), meta(1, 2, 64), False), "cos and sin"),
        ("gated_mlp", (meta(2, 8), meta(6, 8), meta(6, 8, dtype=torch.float32), meta(8, 6), "silu"), "up_weight"),
        ("gated_mlp", (meta(2, 8), meta(6, 8), meta(6, 8), meta(8, 6), "gelu_quick"), "activations"),
        ("fused_gated_mlp", (meta(2, 8), meta(12, 8, dtype=torch.float32), meta(8, 6), "silu"), "gate_up_weight"),
        ("fused_gated_mlp", (meta(2, 8, dtype=torch.float64), meta(12, 8), meta(8, 6), "silu"), "float64"),
        ("fused_gated_mlp", (meta(2, 8), meta(12, 8), meta(8, 6), "gelu_quick"), "activations"),
        ("linear", (meta(2, 64, dtype=torch.float32), meta(32, 64, dtype=torch.float32), None), "float16 or bfloat16"),
        ("linear", (meta(2, 64), meta(32, 64), meta(32, dtype=torch.float16)), "one dtype"),
        ("linear", (meta(2, 64), meta(64, 32).t(), None), "contiguous rows"),
        ("fused_gated_mlp_skinny", (meta(2, 8), meta(12, 8).t().contiguous().t(), meta(8, 6), "silu"), "contiguous rows"),
        ("fused_gated_mlp_skinny", (meta(2, 8, dtype=torch.float32), meta(12, 8, dtype=torch.float32),
                                    meta(8, 6, dtype=torch.float32), "silu"), "float16 or bfloat16"),
        ("add_rms_norm_fp8", (meta(2, 32769), meta(2, 32769), meta(32769), 1e-6, 0.0), "hidden sizes up to 32768"),
        ("gated_activation_fp8", (meta(2, 8), meta(2, 8), "gelu_quick"), "activations"),
        ("fp8_prequantized_linear", (meta(2, 64, dtype=torch.float8_e4m3fn), meta(2, 1, dtype=torch.float32),
                                     meta(32, 64, dtype=torch.float8_e4m3fn), meta(32, dtype=torch.float32), None,
                                     torch.float32), "float16 or bfloat16"),
    ],
)
def test_supports_refuses_what_the_kernels_cannot_run(op_name, args, reason):
    assert reason in triton_backend(op_name).check(args, CUDA)


def test_supports_limits_match_the_kernels():
    # supports() restates the kernel modules' limits so as not to import them (and Triton) early.
    assert triton_backends._NORM_MAX_HIDDEN == norms.MAX_HIDDEN
    assert triton_backends._ROPE_MAX_HEAD_DIM == rope.MAX_HEAD_DIM
    assert triton_backends._SKINNY_DTYPES == skinny_gemm.DTYPES
    assert set(triton_backends._DTYPES) == set(norms.SUPPORTED_DTYPES) == set(rope.SUPPORTED_DTYPES)
