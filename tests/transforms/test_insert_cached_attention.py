"""``insert_cached_attention``'s KV cache dtype: ``quantize.kv_cache: fp8`` stores the paged cache in
float8_e4m3fn, and the deploy stays within the rounding's own effect of Hugging Face."""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError

PROMPTS = [[3, 4, 5, 6, 7], list(range(40, 90))]


@pytest.fixture(scope="module")
def fp8_cache_llama(tiny_checkpoint):
    return autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"kv_cache": "fp8"})


def test_an_fp8_kv_cache_halves_the_bytes_a_block_and_verifies_within_its_rounding(fp8_cache_llama, tiny_checkpoint):
    llm = fp8_cache_llama
    assert {spec.dtype for spec in llm._kv_caches} == {torch.float8_e4m3fn}
    assert all(cache.dtype == torch.float8_e4m3fn for cache in llm.engine.caches.values())
    plain = autodeploy(str(tiny_checkpoint("llama")), device="cpu")
    assert llm._kv_caches[0].bytes_per_block(16) * 4 == plain._kv_caches[0].bytes_per_block(16)  # float32 here
    assert "quantized KV cache: tolerance" in llm.verification.note
    assert llm.verification.relative_error <= llm.verification.tolerance
    for got, want in zip(llm.logits(PROMPTS), plain.logits(PROMPTS)):
        relative = ((got - want).norm() / want.norm()).item()
        assert 0 < relative < 5e-2  # rounded, by about fp8's 3 mantissa bits
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert all(len(out.token_ids) == 8 for out in llm.generate(PROMPTS, params))


def test_a_deploy_with_an_fp8_cache_saves_and_reloads(fp8_cache_llama, tmp_path):
    reloaded = autodeploy(str(fp8_cache_llama.save(tmp_path / "fp8-kv")))
    assert {spec.dtype for spec in reloaded._kv_caches} == {torch.float8_e4m3fn}
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
