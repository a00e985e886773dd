"""Tiny random configs for every model type in transformers' causal-LM mapping, for the coverage sweep
(``scripts/coverage_sweep.py``) and its fixed sample in the test suite (``tests/test_coverage_sweep.py``),
and ``sweep_one``, which deploys one of them and classifies the result (exact / refused / wrong / n/a).

Every config is the model type's default with the usual size settings shrunk (4 layers, hidden 64, 4
query / 2 key-value heads, vocab 512, short sliding windows, 4 experts) wherever the config has them,
plus a few per-type fixes where the default sizes do not fit together. ``family(model_type)`` says
whether a type is a decoder-only text LM (what the sweep's coverage goal counts) or something else
(encoder-decoder, bidirectional encoder, multimodal). The served encoder–decoders and vision-language models are
compared by generating; a bidirectional encoder is served as an embedding model and compared by its hidden states
(``sweep_encoder_only``); every other one must be refused with a typed error.
"""

from __future__ import annotations

import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import AutoDeployError

SIZES = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, head_dim=16, initializer_range=0.1,
    sliding_window=6, attention_chunk_size=6,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# Per-type settings where the shrunk defaults do not fit together (values chosen to keep the
# architecture's distinctive features switched on).
FIXES: dict[str, dict] = {
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"hidden_size": 64, "ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
}

# Causal-LM classes of models that are not decoder-only text LMs, by how they attend.
# Decoders made to cross-attend an encoder's output (TrOCR: VisionEncoderDecoderModel's text decoder).
ENCODER_DECODER_DECODERS = {"trocr"}
BIDIRECTIONAL_ENCODERS = {
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta", "xlm-roberta-xl", "xmod",
}
_NON_TEXT_SUBCONFIGS = ("vision", "audio", "vq", "patcher", "encoder", "depth_decoder", "text_encoder")


SHAPES = ((1, 1), (2, 9), (3, 17))  # (batch, seq): one token, and sequences longer than the tiny windows
GREEDY_TOKENS = 8
TOLERANCE = 1e-4  # verify.tolerance.float32


# Vision-language families autodeploy serves: swept as tests/tiny_vision_models.py builds them, with images
# (sweep_vision_language). LLaVA is not in the causal-LM mapping; it joins the sweep here.
VISION_LANGUAGE = {"gemma3": None, "llava": "clip", "llava (siglip)": "siglip"}
# Encoder–decoders (``…ForConditionalGeneration``; their causal-LM classes are the decoder alone, refused above): swept
# as tests/tiny_seq2seq_models.py builds them, greedy against Hugging Face's ``generate``.
ENCODER_DECODERS = {"bart (seq2seq)": "bart", "mbart (seq2seq)": "mbart", "t5 (seq2seq)": "t5", "t5_v1_1 (seq2seq)": "t5_v1_1",
                    "mt5 (seq2seq)": "mt5"}


def sweep_model_types() -> list[str]:
    return sorted({*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *VISION_LANGUAGE, *ENCODER_DECODERS})


def family(model_type: str) -> str:
    """``decoder`` (a decoder-only text LM), ``encoder-decoder``, ``encoder`` or ``multimodal``."""
    if model_type in VISION_LANGUAGE:
        return "multimodal"
    if model_type in ENCODER_DECODERS:
        return "encoder-decoder"
    if model_type in BIDIRECTIONAL_ENCODERS:
        return "encoder"
    if model_type in ENCODER_DECODER_DECODERS:
        return "encoder-decoder"
    config_class = CONFIG_MAPPING[model_type]
    sub_configs = getattr(config_class, "sub_configs", {}) or {}
    if any(part in name for name in sub_configs for part in _NON_TEXT_SUBCONFIGS) or "text_config" in sub_configs:
        return "multimodal"
    try:
        if getattr(config_class(), "is_encoder_decoder", False):
            return "encoder-decoder"
    except Exception:  # a config that cannot be built with defaults is judged by its sweep entry
        pass
    return "decoder"


def _settable(config: PretrainedConfig, key: str) -> bool:
    """Whether the config has ``key`` as a plain setting (not a read-only property, not a per-layer one)."""
    attribute = getattr(type(config), key, None)
    if isinstance(attribute, property) and attribute.fset is None:
        return False
    try:
        return hasattr(config, key)
    except Exception:  # transformers raises for attributes that differ per layer (Gemma-4's head_dim)
        return False


def tiny_config(model_type: str) -> PretrainedConfig:
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    values = {key: value for key, value in SIZES.items() if _settable(defaults, key)}
    if hasattr(defaults, "qk_rope_head_dim"):  # multi-head latent attention: head dims come from the q/k/v parts,
        values.pop("head_dim", None)  # and every head has its own key and value
        values["num_key_value_heads"] = values["num_attention_heads"]
    values.update(FIXES.get(model_type, {}))
    return config_class(**values)


def tiny_model(model_type: str, seed: int = 0, attn_implementation: str = "eager") -> torch.nn.Module:
    """The tiny random HF model (fp32, eval) with eager attention: the reference the sweep compares with."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32, attn_implementation=attn_implementation)
    return model.eval()


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from full forwards (no HF cache: some HF cache paths differ from the model itself)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def relative_logit_error(model, llm) -> float:
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    vocab = model.config.get_text_config().vocab_size
    for batch, seq in SHAPES:
        input_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        with torch.no_grad():
            expected = model(input_ids=input_ids, use_cache=False).logits.float()
        ours = torch.stack(llm.logits(input_ids.tolist())).float()
        if ours.shape != expected.shape or not torch.isfinite(ours).all():
            return float("inf")
        worst = max(worst, ((ours - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item())
    return worst


def _deployed(directory: str, entry: dict, **settings):
    """The checkpoint in ``directory`` deployed on the CPU in float32: (the LLM, ``entry`` with the build's seconds
    and verification), or (None, ``entry`` refused with the typed error)."""
    start = time.perf_counter()
    try:
        llm = autodeploy(directory, device="cpu", dtype="float32", **settings)
    except AutoDeployError as error:
        return None, {**entry, "status": "refused", "detail": f"{type(error).__name__}: {error}", "seconds": time.perf_counter() - start}
    entry["seconds"] = time.perf_counter() - start
    entry["verify"] = str(llm.verification)
    entry["verify_seconds"] = llm.verification.seconds
    return llm, entry


def sweep_vision_language(model_type: str, entry: dict, reached_autodeploy) -> dict:
    """A served vision-language family: its tiny checkpoint deployed, text logits against Hugging Face's, and greedy
    tokens with one and two images against Hugging Face's ``generate`` with the same pixels (and Gemma 3's
    ``token_type_ids``)."""
    from tests.tiny_vision_models import (GEMMA3_IMAGE, GEMMA3_START, IMAGE_TOKEN_ID, random_image, write_tiny_gemma3,
                                          write_tiny_llava)

    with tempfile.TemporaryDirectory() as directory:
        gemma3 = model_type == "gemma3"
        model = write_tiny_gemma3(Path(directory)) if gemma3 else write_tiny_llava(Path(directory), VISION_LANGUAGE[model_type])
        reached_autodeploy()
        llm, entry = _deployed(directory, entry, max_seq_len=160)
        if llm is None:
            return entry
        entry["relative_error"] = relative_logit_error(model, llm)
        marker = GEMMA3_START if gemma3 else IMAGE_TOKEN_ID
        identical = True
        for images in ([random_image(1)], [random_image(2), random_image(3, (20, 64))]):
            prompt = [5, 6, *[marker, 7] * len(images), 8]
            output = llm.generate({"prompt": prompt, "images": images},
                                  SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True))[0]
            ids = torch.tensor([output.prompt_token_ids])
            pixels = llm.engine.vision.image_processor(images=images, return_tensors="pt")["pixel_values"]
            extra = {"token_type_ids": (ids == GEMMA3_IMAGE).long()} if gemma3 else {}
            expected = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                      attention_mask=torch.ones_like(ids), **extra)[0, ids.shape[1]:].tolist()
            identical &= output.outputs[0].token_ids == expected
        llm.shutdown()
    entry["greedy_identical"] = identical
    return entry


def sweep_encoder_decoder(model_type: str, entry: dict, reached_autodeploy) -> dict:
    """A served encoder–decoder family: its tiny checkpoint deployed (the build verifies the decoder's logits, its
    cross-attention reading the encoder's output, against Hugging Face's: the entry's relative error), and greedy
    tokens for three inputs against Hugging Face's ``generate`` of the checkpoint as Hugging Face loads it."""
    from transformers import AutoModelForSeq2SeqLM

    from tests.tiny_seq2seq_models import hf_generate_greedy, lively

    with tempfile.TemporaryDirectory() as directory:
        lively(ENCODER_DECODERS[model_type]).save_pretrained(directory)
        model = AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
        reached_autodeploy()
        llm, entry = _deployed(directory, entry)
        if llm is None:
            return entry
        entry["relative_error"] = llm.verification.relative_error
        prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(20, 60))]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True))
        entry["greedy_identical"] = all(o.outputs[0].token_ids == hf_generate_greedy(model, p, GREEDY_TOKENS)
                                        for p, o in zip(prompts, outputs))
    return entry


def sweep_encoder_only(model_type: str, entry: dict, reached_autodeploy) -> dict:
    """A bidirectional encoder, served as an embedding model: its base model (``AutoModel``) saved and deployed (the build
    verifies every hidden state of packed texts against Hugging Face's), then three texts embedded in one call, their
    mean-, [CLS]- and last-row vectors against Hugging Face's hidden states of each text alone (the entry's relative
    error; nothing is generated, so ``greedy_identical`` is None)."""
    from transformers import AutoModel

    try:
        torch.manual_seed(0)
        model = AutoModel.from_config(tiny_config(model_type), dtype=torch.float32, attn_implementation="eager").eval()
        texts = [torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(length)).tolist() for length in (1, 9, 17)]
        with torch.no_grad():
            rows = [model(input_ids=torch.tensor([text])).last_hidden_state[0] for text in texts]
    except Exception as error:
        return {**entry, "status": "n/a", "detail": f"transformers: {type(error).__name__}: {' '.join(str(error).split())[:200]}"}
    reached_autodeploy()
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        llm, entry = _deployed(directory, entry)
        if llm is None:
            return entry
        worst = 0.0
        for pooling, pick in (("mean", lambda r: r.mean(0)), ("cls", lambda r: r[0]), ("last", lambda r: r[-1])):
            expected = torch.stack([pick(r) for r in rows])
            ours = llm.embed(texts, pooling=pooling, normalize=False).vectors
            worst = max(worst, ((ours - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item())
        entry["relative_error"], entry["greedy_identical"] = worst, None
    return entry


def sweep_one(model_type: str, reached_autodeploy=lambda: None) -> dict:
    """One model type's entry; ``reached_autodeploy`` is called once transformers has run the tiny model."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    entry = {"model_type": model_type, "family": family(model_type)}
    if model_type in VISION_LANGUAGE or model_type in ENCODER_DECODERS or entry["family"] == "encoder":
        sweep = (sweep_vision_language if model_type in VISION_LANGUAGE else sweep_encoder_decoder if model_type in ENCODER_DECODERS
                 else sweep_encoder_only)
        entry = sweep(model_type, entry, reached_autodeploy)
        if entry.get("status") in ("refused", "n/a"):
            return entry
        return _classified(entry)
    try:
        model = tiny_model(model_type)
        with torch.no_grad():
            model(input_ids=torch.randint(3, 512, (2, 9)), use_cache=False)
    except Exception as error:
        return {**entry, "status": "n/a", "detail": f"transformers: {type(error).__name__}: {' '.join(str(error).split())[:200]}"}
    reached_autodeploy()
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        start = time.perf_counter()
        try:
            llm = autodeploy(directory, device="cpu")
        except AutoDeployError as error:
            return {**entry, "status": "refused", "detail": f"{type(error).__name__}: {error}",
                    "seconds": time.perf_counter() - start}
        except Exception as error:
            frame = traceback.extract_tb(error.__traceback__)[-1]
            return {**entry, "status": "wrong", "detail": f"raw {type(error).__name__} at {Path(frame.filename).name}:{frame.lineno}: "
                    f"{' '.join(str(error).split())[:300]}", "seconds": time.perf_counter() - start}
        entry["seconds"] = time.perf_counter() - start
        entry["verify"] = str(llm.verification) if llm.verification is not None else None
        entry["verify_seconds"] = llm.verification.seconds if llm.verification is not None else None
        try:
            entry["relative_error"] = relative_logit_error(model, llm)
            prompt = torch.randint(3, 512, (11,), generator=torch.Generator().manual_seed(1)).tolist()
            ours = llm.generate([prompt], SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True))[0].token_ids
            entry["greedy_identical"] = ours == hf_greedy(model, prompt, GREEDY_TOKENS)
        except Exception as error:
            return {**entry, "status": "wrong", "detail": f"serving raised {type(error).__name__}: {' '.join(str(error).split())[:300]}"}
    return _classified(entry)


def _classified(entry: dict) -> dict:
    exact = entry["relative_error"] <= TOLERANCE and entry["greedy_identical"] in (True, None)  # None: an encoder generates nothing
    entry["status"] = "exact" if exact else "wrong"
    if not exact:
        entry["detail"] = f"relative logit error {entry['relative_error']:.2g}, greedy identical: {entry['greedy_identical']}"
    return entry
