"""A fixed sample of the coverage sweep (scripts/coverage_sweep.py → notes/coverage.md): each entry must keep
its result — exact (logits and greedy tokens equal HF eager), or refused with a typed error that names the
construct. None may ever be served wrong."""

import pytest

from autodeploy import autodeploy
from autodeploy.errors import ExportError, UnsupportedModelError
from tests.sweep_models import FIXES, sweep_one, tiny_model

EXACT = [
    "gpt2", "bloom", "mpt", "phi", "olmo2", "granite", "cohere2", "gpt_bigcode", "falcon", "codegen", "deepseek_v3",
    "granite_swa", "mimo_v2_flash", "bart (seq2seq)", "mbart (seq2seq)", "t5 (seq2seq)", "bert", "xlm-roberta",
]
REFUSED = {
    "mamba": "recurrent or state-space layers",
    "bart": "encoder-decoder architecture",  # BartForCausalLM: the decoder alone (the whole model is served: "bart (seq2seq)")
    "roformer": "not all canonical bidirectional_attention",  # an encoder served as an embedder whose attention cannot be packed
    "diffllama": "more than one attention per layer",
}


@pytest.mark.parametrize("model_type", EXACT)
def test_served_exactly(model_type):
    entry = sweep_one(model_type)
    assert entry["status"] == "exact", entry


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_naming_the_construct(model_type):
    entry = sweep_one(model_type)
    assert entry["status"] == "refused" and REFUSED[model_type] in entry["detail"], entry


def test_falcon_variants_are_exact():
    """Multi-query Falcon indexed its key/value heads with Python lists, which export on meta captured as
    value-less constants: NaN logits that changed between calls. The new-decoder variant (Falcon-40B) too."""
    for fixes in ({"multi_query": True}, {"new_decoder_architecture": True, "num_kv_heads": 2}):
        FIXES["falcon"] = fixes
        try:
            entry = sweep_one("falcon")
        finally:
            del FIXES["falcon"]
        assert entry["status"] == "exact", (fixes, entry)


def test_a_constant_export_cannot_give_a_value_is_an_export_error(tmp_path):
    tiny_model("falcon").save_pretrained(tmp_path)
    patches = ["hf_no_kv_cache", "hf_sdpa_attention", "scalar_constants_on_cpu"]  # without list_indices_as_slices
    with pytest.raises(ExportError, match="tensor constants .* without their values: model.transformer.h.0.self_attention"):
        autodeploy(str(tmp_path), device="cpu", transforms={"export_to_fx": {"patches": patches}})


@pytest.mark.parametrize("config_class", ["PaliGemmaConfig", "Qwen2_5_VLConfig", "LlavaNextConfig", "Qwen2AudioConfig"])
def test_a_multimodal_model_it_does_not_serve_is_refused_before_anything_is_built(tmp_path, config_class):
    """LLaVA with CLIP or SigLIP towers and Gemma 3 are served (tests/test_vision_language*.py); other vision-language families and
    other modalities are refused by name."""
    import transformers

    getattr(transformers, config_class)().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"vision-language model of a family autodeploy does not serve yet|multimodal model \(audio"):
        autodeploy(str(tmp_path), device="meta", weights="random")


def test_attention_the_patterns_do_not_know_is_named(llama_dir):
    skip = {"match_patterns": {"skip": ["attention_sdpa"]}}
    with pytest.raises(UnsupportedModelError, match="the attention of LlamaAttention ×2 does not match a known attention form"):
        autodeploy(str(llama_dir), device="cpu", transforms=skip)
