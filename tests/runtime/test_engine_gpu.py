"""The engine on a GPU with the Triton paged-attention kernels (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from tests.logit_comparison import deployed_max_logit_diff
from tests.runtime.test_engine import hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_engine_logits_match_hf(tiny_checkpoint, arch):
    llm = autodeploy(str(tiny_checkpoint(arch)), device="cuda", dtype="float32")
    assert "triton" in llm.pipeline_report() or "_triton_backend" in llm.pipeline_report()
    assert deployed_max_logit_diff(tiny_hf_model(arch), llm, ((1, 1, 0), (2, 37, 0), (1, 300, 0))) <= 5e-3


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_engine_serves_a_mixed_batch_like_hf(tiny_checkpoint, arch):
    llm = autodeploy(str(tiny_checkpoint(arch)), device="cuda", dtype="float32", scheduler={"max_num_tokens": 128})
    hf = tiny_hf_model(arch)
    prompts = random_prompts(24, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    agree = sum(o.token_ids == hf_greedy(hf, p, 8) for p, o in zip(prompts, outputs))
    assert agree == len(prompts), f"{agree}/{len(prompts)} requests equal HF greedy"
    assert llm.engine.pool.num_used_blocks == 0


def test_a_saved_gpu_deployment_reloads_with_identical_logits_and_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    # bf16 on the GPU: Triton kernels chosen by select, decode steps in CUDA graphs; the reload resolves
    # the kernels by name, captures its own graphs and must serve bit for bit what the build served.
    built = autodeploy(str(tiny_checkpoint("llama")), device="cuda", dtype="bfloat16")
    saved = built.save(tmp_path / "deployment")
    sequences = [list(range(3, 40)), [5], list(range(100, 117))]
    want = built.logits(sequences)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want_tokens = [o.token_ids for o in built.generate([[7, 8, 9], list(range(20, 60))], params)]
    monkeypatch.setattr("torch.export.export", lambda *a, **k: pytest.fail("a reload must not export"))
    reloaded = autodeploy(str(saved))
    for expected, got in zip(want, reloaded.logits(sequences)):
        assert torch.equal(expected, got)
    assert [o.token_ids for o in reloaded.generate([[7, 8, 9], list(range(20, 60))], params)] == want_tokens
    assert reloaded.pipeline_report() == built.pipeline_report()


QUANTIZED_GPU = {  # quantize settings → the ops its projections become (each must take a GPU kernel)
    "int8_wo": ({"default": "int8_wo"}, "int8_wo_linear"),
    "int4_wo": ({"default": "int4_wo", "int4_group_size": 32}, "int4_wo_linear"),
    # fuse_fp8_quantization: the norms and gated activations before q/k/v, gate/up and down round for them
    "fp8": ({"default": "fp8"}, ("fp8_linear", "fp8_prequantized_linear", "add_rms_norm_fp8", "gated_activation_fp8")),
    "fp8 static": ({"default": "fp8", "fp8_activations": "static", "calibration": {"samples": 4, "seq_len": 64}},
                   "fp8_static_linear"),
    "smoothquant": ({"default": "smoothquant", "calibration": {"samples": 4, "seq_len": 64}}, "int8_w8a8_linear"),
    "fp8 KV cache": ({"default": "int8_wo", "kv_cache": "fp8"}, "int8_wo_linear"),
}


@pytest.mark.parametrize("case", QUANTIZED_GPU)
def test_a_quantized_bf16_deploy_verifies_and_serves_with_gpu_kernels(tiny_checkpoint, case, tmp_path, monkeypatch):
    # Select picks among the scheme's GPU backends (Triton GEMVs, torch._scaled_mm / _int_mm) and the
    # reference; the build's verification holds the deploy to HF over the same quantized weights (and the
    # same rounding of activations and KV cache).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # calibration statistics
    settings, ops = QUANTIZED_GPU[case]
    ops = (ops,) if isinstance(ops, str) else ops
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cuda", dtype="bfloat16", quantize=settings)
    quantized = [n for n in llm.graph.graph.nodes if n.op == "call_function"
                 and str(n.target).removeprefix("autodeploy.").startswith(ops)]
    for op in ops:
        assert any(str(n.target).startswith(f"autodeploy.{op}") for n in quantized), f"no {op} in the served graph"
    report = llm.pipeline_report()
    # Quantized projections must not stop the rest of the decode path from taking its GPU kernels.
    kernels = {n.meta["autodeploy_kernel"].backend for n in quantized}
    assert "reference" not in kernels, report
    if settings.get("kv_cache") == "fp8":
        assert all(cache.dtype == torch.float8_e4m3fn for cache in llm.engine.caches.values())
    targets = {str(n.target) for n in llm.graph.graph.nodes if n.op == "call_function"}
    assert not any("cached_attention_rope_sdpa" in t for t in targets), report
    assert "decode stays eager" not in report, report
    assert llm.verification.relative_error <= llm.verification.tolerance
    out = llm.generate([[5, 6, 7, 8], list(range(30, 90))], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in out)
    assert llm.engine.pool.num_used_blocks == 0
