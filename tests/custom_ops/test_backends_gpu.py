"""Every backend of every canonical op against its reference at Llama-3-8B shapes on the GPU (bf16 and
fp16; float32 where the backend takes it), with the accuracy contract: ‖out − ref‖/‖ref‖ ≤ 1e-2 in half
precision, 1e-5 in float32. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from autodeploy.autotuner import relative_error, tolerance
from autodeploy.custom_ops import canonical_ops
from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, INNER, HEADS, HEAD_DIM = 4096, 14336, 32, 128


def weight(*shape, dtype):
    return (torch.randn(*shape, device="cuda") / shape[-1] ** 0.5).to(dtype)


def inputs(op: str, tokens: int, dtype: torch.dtype) -> tuple:
    x = torch.randn(1, tokens, HIDDEN, device="cuda", dtype=dtype)
    if op == "linear":
        return x, weight(HIDDEN, HIDDEN, dtype=dtype), None
    if op == "rms_norm":
        return x, 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=dtype), 1e-5
    if op == "add_rms_norm":
        return x, torch.randn_like(x), 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=dtype), 1e-5
    if op == "layer_norm":
        return x, torch.randn(HIDDEN, device="cuda", dtype=dtype), torch.randn(HIDDEN, device="cuda", dtype=dtype), 1e-5
    if op == "rope":
        angles = torch.rand(1, tokens, HEAD_DIM // 2, device="cuda") * 100
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
        return torch.randn(1, tokens, HEADS, HEAD_DIM, device="cuda", dtype=dtype), cos, sin
    if op == "gated_mlp":
        return x, weight(INNER, HIDDEN, dtype=dtype), weight(INNER, HIDDEN, dtype=dtype), weight(HIDDEN, INNER, dtype=dtype), "silu"
    if op == "fused_gated_mlp":
        return x, weight(2 * INNER, HIDDEN, dtype=dtype), weight(HIDDEN, INNER, dtype=dtype), "silu"
    if op == "mlp":
        return x, weight(INNER, HIDDEN, dtype=dtype), None, weight(HIDDEN, INNER, dtype=dtype), None, "gelu_tanh"
    if op == "moe":
        experts, inner = 8, 2048
        return (x[0], torch.randn(tokens, experts, device="cuda", dtype=dtype), weight(experts, 2 * inner, HIDDEN, dtype=dtype),
                weight(experts, HIDDEN, inner, dtype=dtype), 2)
    if op in QUANTIZED_EXPERTS:
        experts, inner = 8, 2048
        scheme = QuantScheme(QUANTIZED_EXPERTS[op])
        gate_up, down = (quantize_weight(scheme, weight(*shape, dtype=torch.float32)) for shape in
                         ((experts, 2 * inner, HIDDEN), (experts, HIDDEN, inner)))
        return (x[0], torch.randn(tokens, experts, device="cuda", dtype=dtype), *gate_up.values(), *down.values(), 2)
    if op in QUANTIZED:
        statistics = {key: torch.rand(HIDDEN, device="cuda") + 0.1 for key in ("mean_abs", "mean_square", "max_abs")}
        stored = quantize_weight(QuantScheme(QUANTIZED[op]), weight(HIDDEN, HIDDEN, dtype=torch.float32), statistics)
        return (x, *stored.values(), None)
    raise KeyError(op)


QUANTIZED = {"int8_wo_linear": "int8_wo", "int4_wo_linear": "int4_wo", "int4_awq_linear": "int4_awq", "fp8_linear": "fp8",
             "int8_w8a8_linear": "smoothquant"}
QUANTIZED_EXPERTS = {"moe_int8_wo": "int8_wo", "moe_int4_wo": "int4_wo"}
OPS = ("linear", "rms_norm", "add_rms_norm", "layer_norm", "rope", "gated_mlp", "fused_gated_mlp", "mlp", "moe",
       *QUANTIZED, *QUANTIZED_EXPERTS)
CASES = [(op, backend.name) for op in OPS for backend in canonical_ops()[op].backends]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("op, backend_name", CASES, ids=[f"{o}-{b}" for o, b in CASES])
def test_backend_matches_the_reference_on_the_gpu(op, backend_name, tokens, dtype):
    torch.manual_seed(tokens)
    backend = next(b for b in canonical_ops()[op].backends if b.name == backend_name)
    args = inputs(op, tokens, dtype)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    if backend.check(meta, torch.device("cuda")) is not None:
        pytest.skip(f"{backend_name} does not take {op} in {dtype}: {backend.check(meta, torch.device('cuda'))}")
    expected = canonical_ops()[op].reference(*args)
    got = backend.op(*args)
    for have, want in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape
    assert relative_error(got, expected) <= tolerance(dtype)
