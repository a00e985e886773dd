"""``insert_cached_attention``'s KV cache dtype: ``quantize.kv_cache: fp8`` stores the paged cache in
float8_e4m3fn, and the deploy stays within the rounding's own effect of Hugging Face."""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError

PROMPTS = [[3, 4, 5, 6, 7], list(range(40, 90))]


FP8_CACHE = {"kv_cache": "fp8", "calibration": {"samples": 4, "seq_len": 64}}


CALIBRATED: list[dict] = []  # the statistics each calibration of fp8_cache_llama's build computed


@pytest.fixture(scope="module")
def fp8_cache_llama(tiny_checkpoint, tmp_path_factory):
    from autodeploy.transforms import calibration

    original = calibration.graph_statistics
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("calibration")))
        patch.setattr(calibration, "graph_statistics", lambda *a, **k: CALIBRATED.append(original(*a, **k)) or CALIBRATED[-1])
        return autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=FP8_CACHE)


def test_an_fp8_kv_cache_halves_the_bytes_a_block_and_verifies_within_its_rounding(fp8_cache_llama, llama_llm):
    llm = fp8_cache_llama
    assert {spec.dtype for spec in llm.deployment.signature.kv_caches} == {torch.float8_e4m3fn}
    assert all(cache.dtype == torch.float8_e4m3fn for cache in llm.engine.caches.values())
    plain = llama_llm  # the session's default deploy of the same tiny Llama (read only here)
    assert llm.deployment.signature.kv_caches[0].bytes_per_block(16) * 4 == plain.deployment.signature.kv_caches[0].bytes_per_block(16)  # float32 here
    assert "quantized KV cache: tolerance" in llm.verification.note
    assert llm.verification.relative_error <= llm.verification.tolerance
    for got, want in zip(llm.logits(PROMPTS), plain.logits(PROMPTS)):
        relative = ((got - want).norm() / want.norm()).item()
        assert 0 < relative < 5e-2  # rounded, by about fp8's 3 mantissa bits
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert all(len(out.token_ids) == 8 for out in llm.generate(PROMPTS, params))


def test_each_layer_takes_scales_calibrated_from_its_key_and_value_projections(fp8_cache_llama):
    from autodeploy.transforms.calibration import kv_cache_scales

    # The tiny model's keys and values are small: every scale stays 1 (no kwargs on the nodes).
    assert all("k_scale" not in n.kwargs for n in fp8_cache_llama.graph.graph.nodes)
    projections = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "kv"]
    statistics = CALIBRATED[0]  # the deploy's own (its verification twin calibrates again)
    assert set(statistics) == set(projections)
    assert set(kv_cache_scales(statistics, projections).values()) == {(1.0, 1.0)}
    # Values 100 times larger would pass 448 / 16: their layer's scale keeps them below.
    for name in projections:
        statistics[name]["output_max_abs"] = statistics[name]["output_max_abs"] * 100
    scales = kv_cache_scales(statistics, projections)["model.layers.1.self_attn"]
    largest = float(statistics["model.layers.1.self_attn.k_proj"]["output_max_abs"]) * 2**0.5
    assert scales[0] == pytest.approx(largest * 16 / 448) and scales[0] > 1 and scales[1] > 1


def test_a_deploy_with_an_fp8_cache_saves_and_reloads(fp8_cache_llama, tmp_path):
    reloaded = autodeploy(str(fp8_cache_llama.save(tmp_path / "fp8-kv")))
    assert {spec.dtype for spec in reloaded.deployment.signature.kv_caches} == {torch.float8_e4m3fn}
    assert all(torch.equal(a, b) for a, b in zip(reloaded.logits(PROMPTS), fp8_cache_llama.logits(PROMPTS)))


def test_kv_cache_bad_inputs_are_config_errors(tiny_checkpoint, monkeypatch):
    with pytest.raises(ConfigError, match="quantize.kv_cache must be 'fp8' or 'none'; got 'int8'"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"kv_cache": "int8"})
    from types import SimpleNamespace

    from autodeploy.transforms.insert_cached_attention import kv_cache_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    settings = SimpleNamespace(device="cuda", quantize=SimpleNamespace(kv_cache="fp8"))
    with pytest.raises(ConfigError, match=r"compute capability 8.9 .* this one is 8.0. Keep the KV cache"):
        kv_cache_dtype(settings)


def test_layers_with_scales_serve_and_verify_with_them(tiny_checkpoint, tmp_path, monkeypatch):
    # A headroom a million times the calibrated range forces scales past 1 on the tiny model's small values.
    from autodeploy.transforms import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "_KV_HEADROOM", 1e6)
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=FP8_CACHE)
    scales = [(n.kwargs["k_scale"], n.kwargs["v_scale"]) for n in llm.graph.graph.nodes if "cached_attention" in str(n.target)]
    assert len(scales) == 2 and len(set(scales)) == 2 and all(s > 1 for pair in scales for s in pair)
    assert llm.verification.relative_error <= llm.verification.tolerance
    reloaded = autodeploy(str(llm.save(tmp_path / "scaled")))
    assert all(torch.equal(a, b) for a, b in zip(reloaded.logits(PROMPTS), llm.logits(PROMPTS)))


def test_a_random_weight_config_without_a_tokenizer_serves_an_fp8_cache_at_scale_one(tmp_path):
    # The deploy does not calibrate random weights; its verification twin has nothing to calibrate on either
    # (no tokenizer), so both keep scale 1 instead of failing the build (as the H200 benchmark of the
    # Llama-3-8B config did).
    from tests.tiny_models import tiny_config

    tiny_config("llama").save_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", weights="random", quantize={"kv_cache": "fp8"})
    assert {spec.dtype for spec in llm.deployment.signature.kv_caches} == {torch.float8_e4m3fn}
    assert llm.verification.relative_error <= llm.verification.tolerance
    attention = [n for n in llm.graph.graph.nodes if "cached_attention" in str(n.target)]
    assert attention and not any("k_scale" in n.kwargs for n in attention)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert all(len(out.token_ids) == 4 for out in llm.generate(PROMPTS, params))


class _Biased(torch.nn.Module):
    """One causal attention whose logits get ``bias``: the input itself, or a relative position bias over positions
    shifted by ``shift`` (a T5 decoder's are the graph's own, 0 … T - 1)."""

    def __init__(self, shift: int | None):
        super().__init__()
        self.shift = shift
        self.table = torch.nn.Parameter(torch.randn(8, 2))

    def forward(self, q, k, v, bias):
        if self.shift is not None:
            positions = torch.arange(q.shape[1])
            bias = torch.ops.autodeploy.relative_position_bias(self.table, positions + self.shift, positions, False, 20)
        return torch.ops.autodeploy.attention(q, k, v, 1.0, None, None, None, None, bias)


@pytest.mark.parametrize("shift", [None, 1], ids=["any tensor", "other positions"])
def test_a_bias_the_cache_cannot_read_by_distance_is_refused(shift):
    from autodeploy.config import load_settings
    from autodeploy.errors import UnsupportedModelError
    from autodeploy.transforms.insert_cached_attention import InsertCachedAttention
    from autodeploy.transforms.registry import TransformConfig, TransformContext

    inputs = (*(torch.randn(1, 5, 2, 4) for _ in range(3)), torch.randn(1, 2, 5, 5))
    gm = torch.export.export(_Biased(shift), inputs).module()
    context = TransformContext(settings=load_settings(set_arguments=["device=cpu", "max_seq_len=16"]))
    with pytest.raises(UnsupportedModelError, match=r"adds a bias to its logits \(\w+\) other than a relative position bias"):
        InsertCachedAttention(TransformConfig()).apply(gm, context)
