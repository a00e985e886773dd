"""A quantization scheme is one class plus its op: this file registers a toy scheme (int8 weights rounded toward
zero, inputs rounded to bfloat16) and deploys a tiny model with it through the normal pipeline (quantize,
load_weights, fuse_gemms, verification), against the Hugging Face model over the same weights and rounding."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from autodeploy import SamplingParams, autodeploy
from autodeploy.custom_ops import register_op
from autodeploy.custom_ops.quantized_linear import (
    INT8_MAX,
    QuantMethod,
    QuantScheme,
    dequantize_weight,
    quantize_weight,
    register_scheme,
    safe_scale,
    scheme_names,
)
from tests.runtime.test_engine import hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model


def _round_input(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def toy_int8_trunc_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(bf16(x), qweight · scale[:, None], bias)`` in float32."""
    weight = qweight.to(torch.float32) * scale[:, None]
    return F.linear(_round_input(x).to(torch.float32), weight, None if bias is None else bias.to(torch.float32)).to(x.dtype)


register_op("toy_int8_trunc_linear", toy_int8_trunc_linear_reference,
            lambda x, qweight, scale, bias: x.new_empty((*x.shape[:-1], qweight.shape[0])),
            example_inputs=(torch.ones(2, 8), torch.ones(4, 8, dtype=torch.int8), torch.ones(4), None))


@register_scheme
class Int8Trunc(QuantMethod):
    name = "toy_int8_trunc"

    def quantize(self, scheme, w, statistics):
        scale = safe_scale(w.abs().amax(dim=1) / INT8_MAX)
        return {"qweight": torch.trunc(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), "scale": scale}

    def dequantize(self, scheme, stored, dtype):
        return stored["qweight"].to(dtype) * stored["scale"].to(dtype)[:, None]

    def op(self, scheme):
        return torch.ops.autodeploy.toy_int8_trunc_linear.default

    def row_wise_ops(self):
        return {torch.ops.autodeploy.toy_int8_trunc_linear.default: ()}

    def round_input(self, scheme, stored):
        return _round_input


def test_a_scheme_registered_in_one_class_deploys_through_the_pipeline_and_matches_its_reference(tiny_checkpoint):
    assert "toy_int8_trunc" in scheme_names()
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"default": "toy_int8_trunc"})
    ops = [n for n in llm.graph.graph.nodes if n.op == "call_function" and n.target is torch.ops.autodeploy.toy_int8_trunc_linear.default]
    hf = tiny_hf_model("llama")
    untied_head = hf.lm_head.weight is not hf.get_input_embeddings().weight
    assert len(ops) == 2 * 4 + untied_head  # per layer q/k/v fused and gate/up fused (row-wise), o, down
    scheme = QuantScheme("toy_int8_trunc")
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and not (name == "lm_head" and not untied_head):
                stored = quantize_weight(scheme, module.weight)
                assert torch.equal(stored["qweight"], torch.trunc(stored["qweight"].float()).to(torch.int8))
                module.weight.copy_(dequantize_weight(scheme, stored))
                module.register_forward_pre_hook(lambda module, args: (_round_input(args[0]), *args[1:]))
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        assert output.token_ids == hf_greedy(hf, prompt, 8)
    assert "quantized activations" in llm.verification.note  # verification's reference rounded the inputs as the op does
