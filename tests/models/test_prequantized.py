"""Pre-quantized checkpoints (autodeploy/models/prequantized.py): each format, written here (compressed-tensors
with its own compressors, AutoAWQ / GPTQ / ModelOpt layouts by hand) from the values our quantizer chose for
the tiny Llama, deploys with exactly the logits of the float checkpoint quantized here with the same scheme:
the same integers and scales, read from another layout. Then the bad checkpoints."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from autodeploy import SamplingParams, autodeploy
from autodeploy.custom_ops.quantized_linear import QuantScheme, dequantize_weight, quantize_weight, unpack_int4
from autodeploy.errors import CheckpointError, ConfigError

PROMPTS = [[3, 4, 5, 6, 7], list(range(40, 70))]
GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def decoder_linears(tensors: dict) -> list[str]:
    """The module paths of the tiny Llama's decoder-block projections (the LM head is tied to the embedding)."""
    return sorted(key.removesuffix(".weight") for key in tensors if ".layers." in key and key.endswith("_proj.weight"))


def pack_words(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """uint4 values [R, C] → int32 [R, C/8]: nibble j of a word holds column ``order[j]`` of its 8."""
    blocks = (values.to(torch.int64) & 0xF).reshape(values.shape[0], -1, 8)[..., list(order)]
    words = (blocks << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_layer(path: str, stored: dict) -> dict:
    q, zero, scale = unpack_int4(stored["qweight"]), stored["zero"], stored["scale"]  # [N, K], [N, K/G], [N, K/G]
    return {f"{path}.qweight": pack_words(q.t(), AWQ_ORDER), f"{path}.qzeros": pack_words(zero.t(), AWQ_ORDER),
            f"{path}.scales": scale.t().contiguous()}


def gptq_layer(zero_offset: int):
    """GPTQ's layout: qweight [K/8, N] packed along the inputs, qzeros [K/G, N/8] minus ``zero_offset`` (1 in the
    original gptq format), scales [K/G, N], g_idx [K]."""

    def write(path: str, stored: dict) -> dict:
        q, zero, scale = unpack_int4(stored["qweight"]), stored["zero"].to(torch.int16), stored["scale"]
        rows, columns = q.shape
        by_input = q.t().reshape(columns // 8, 8, rows).permute(0, 2, 1).reshape(columns // 8, rows * 8)
        return {f"{path}.qweight": pack_words(by_input), f"{path}.qzeros": pack_words((zero - zero_offset).t()),
                f"{path}.scales": scale.t().contiguous(), f"{path}.g_idx": torch.arange(columns, dtype=torch.int32) // GROUP}
    return write


def compressed_tensors_layer(scheme_name: str):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def write(path: str, stored: dict) -> dict:
        scheme = QuantScheme(scheme_name, group_size=GROUP)
        weight = dequantize_weight(scheme, stored)
        if scheme_name == "int4_wo":
            args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=GROUP, symmetric=False)
            state = {"weight": weight, "weight_scale": stored["scale"],
                     "weight_zero_point": (stored["zero"].to(torch.int16) - 8).to(torch.int8)}
            fmt = "pack-quantized"
        elif scheme_name == "int8_wo":
            args = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
            state, fmt = {"weight": weight, "weight_scale": stored["scale"][:, None]}, "int-quantized"
        else:
            args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
            state, fmt = {"weight": weight, "weight_scale": stored["scale"][:, None]}, "float-quantized"
        compressed = BaseCompressor.get_value_from_registry(fmt).compress(state, QuantizationScheme(targets=["Linear"], weights=args))
        static = {"input_scale": stored["input_scale"]} if "input_scale" in stored else {}
        return {f"{path}.{leaf}": tensor for leaf, tensor in {**compressed, **static}.items()}
    return write


def modelopt_layer(path: str, stored: dict) -> dict:
    return {f"{path}.weight": stored["qweight"], f"{path}.weight_scale": stored["scale"].reshape(()),
            f"{path}.input_scale": stored["input_scale"].reshape(())}


ROLES = {"qweight": "qweight", "scale": "weight_scale", "zero": "weight_zero", "input_scale": "input_scale"}


def deployed_values(llm, path: str) -> dict:
    """The tensors the quantize stage stored for the layer at ``path`` of a deploy, by role."""
    names = dict(llm.graph.named_parameters())
    return {role: names[f"model.{path}.{attribute}"].detach() for role, attribute in ROLES.items() if f"model.{path}.{attribute}" in names}


def write_prequantized(source: Path, out: Path, scheme: QuantScheme, write_layer, quantization_config: dict | None,
                       extra_files: dict | None = None, values=None) -> Path:
    """A copy of ``source`` whose decoder projections are stored as ``write_layer`` writes ``scheme``'s values
    (``values(path, weight)``; by default this scheme's quantization of the weight)."""
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    values = values or (lambda path, weight: quantize_weight(scheme, weight))
    for path in decoder_linears(tensors):
        tensors.update(write_layer(path, values(path, tensors.pop(f"{path}.weight"))))
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    for name, content in (extra_files or {}).items():
        (out / name).write_text(json.dumps(content))
    return out


def ct_config(weights: dict, inputs: dict | None = None, fmt: str = "pack-quantized") -> dict:
    group = {"targets": ["Linear"], "weights": weights, **({"input_activations": inputs} if inputs else {})}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP, "symmetric": False}
INT8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
FP8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
FP8_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
CALIBRATION = {"samples": 4, "seq_len": 64}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False}

FORMATS = {  # name → (our scheme, layer writer, quantization_config, extra files, the quantize settings that match)
    "compressed-tensors int4": ("int4_wo", compressed_tensors_layer("int4_wo"), ct_config(INT4), None, {"default": "int4_wo"}),
    "compressed-tensors int8": ("int8_wo", compressed_tensors_layer("int8_wo"), ct_config(INT8, fmt="int-quantized"), None,
                                {"default": "int8_wo"}),
    "compressed-tensors fp8": ("fp8", compressed_tensors_layer("fp8"), ct_config(FP8, FP8_TOKEN, "float-quantized"), None,
                               {"default": "fp8"}),
    "compressed-tensors fp8 static": ("fp8", compressed_tensors_layer("fp8"), ct_config(FP8, FP8_STATIC, "float-quantized"),
                                      None, {"default": "fp8", "fp8_activations": "static", "calibration": CALIBRATION}),
    "awq": ("int4_wo", awq_layer, AWQ, None, {"default": "int4_wo"}),
    "gptq": ("int4_wo", gptq_layer(1), GPTQ, None, {"default": "int4_wo"}),
    "gptq_v2": ("int4_wo", gptq_layer(0), {**GPTQ, "checkpoint_format": "gptq_v2"}, None, {"default": "int4_wo"}),
    "modelopt fp8": ("fp8", modelopt_layer, None,
                     {"hf_quant_config.json": {"producer": {"name": "modelopt"},
                                               "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}},
                     {"default": "fp8", "fp8_weight_scale": "tensor", "fp8_activations": "static", "calibration": CALIBRATION}),
}


@pytest.fixture(scope="module")
def float_llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def quantized_here(float_llama, tmp_path_factory):
    """``quantized_here(settings)``: the tiny Llama deployed with these quantize settings, once a module (four
    formats store int4_wo's values; the tests only read the deploy)."""
    deploys = {}

    def get(settings: dict):
        key = json.dumps(settings, sort_keys=True)
        if key not in deploys:
            with pytest.MonkeyPatch.context() as patch:  # static fp8 scales calibrate, each deploy afresh
                patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
                # Projections kept apart, so each layer's stored tensors keep the names deployed_values reads.
                deploys[key] = autodeploy(str(float_llama), device="cpu", quantize={**settings, "int4_group_size": GROUP},
                                          transforms={"fuse_gemms": {"enabled": False}})
        return deploys[key]
    return get


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_serves_the_logits_of_the_same_values_quantized_here(name, float_llama, quantized_here, tmp_path):
    scheme_name, write_layer, config, extra, settings = FORMATS[name]
    here = quantized_here(settings)
    directory = write_prequantized(float_llama, tmp_path / "prequantized", None, write_layer, config, extra,
                                   values=lambda path, weight: deployed_values(here, path))
    served = autodeploy(str(directory), device="cpu")
    for got, want in zip(served.logits(PROMPTS), here.logits(PROMPTS)):
        assert torch.equal(got, want)
    record = next(r for r in served.records if r.name == "quantize_linear")
    assert f"14 {scheme_name} as the checkpoint's" in record.notes
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert served.generate(PROMPTS, params)[0].token_ids == here.generate(PROMPTS, params)[0].token_ids


def test_a_w8a8_checkpoint_serves_int8_activations_over_its_int8_weights(float_llama, tmp_path):
    # Its smoothing is folded into the checkpoint's weights: the op takes none. Against the same int8 weights
    # with unquantized activations, only the activations' rounding differs.
    int8 = QuantScheme("int8_wo")
    w8a8 = write_prequantized(float_llama, tmp_path / "w8a8", int8, compressed_tensors_layer("int8_wo"),
                              ct_config(INT8, {**INT8, "strategy": "token", "dynamic": True}, "int-quantized"))
    w8a16 = write_prequantized(float_llama, tmp_path / "w8a16", int8, compressed_tensors_layer("int8_wo"),
                               ct_config(INT8, fmt="int-quantized"))
    served = autodeploy(str(w8a8), device="cpu")
    w8a8_ops = [n for n in served.graph.graph.nodes if "int8_w8a8_linear" in str(n.target)]
    # The op's smoothing of ones is dropped (fold_smoothing), so q/k/v and gate/up fuse: 4 GEMMs a layer.
    assert len(w8a8_ops) == 8 and all(n.args[3] is None for n in w8a8_ops)
    assert not any(name.endswith("input_smooth") for name, _ in served.graph.named_parameters())
    for got, want in zip(served.logits(PROMPTS), autodeploy(str(w8a16), device="cpu").logits(PROMPTS)):
        relative = ((got - want).norm() / want.norm()).item()
        assert 0 < relative < 5e-2


def test_a_checkpoints_kv_cache_scales_serve_an_fp8_cache(float_llama, tmp_path):
    config = {**ct_config(FP8, FP8_TOKEN, "float-quantized"),
              "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}}
    directory = write_prequantized(float_llama, tmp_path / "kv", QuantScheme("fp8"), compressed_tensors_layer("fp8"), config)
    tensors = load_file(directory / "model.safetensors")
    for layer, (k_scale, v_scale) in enumerate([(2.0, 0.5), (4.0, 0.25)]):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v_scale])
    save_file(tensors, directory / "model.safetensors")
    served = autodeploy(str(directory), device="cpu", quantize={"kv_cache": "fp8"})
    scales = [(n.kwargs["k_scale"], n.kwargs["v_scale"]) for n in served.graph.graph.nodes if "cached_attention" in str(n.target)]
    assert scales == [(2.0, 0.5), (4.0, 0.25)]
    assert served.verification.relative_error <= served.verification.tolerance
    plain = autodeploy(str(directory), device="cpu")  # without quantize.kv_cache the scheme is noted, not applied
    assert all("k_scale" not in n.kwargs for n in plain.graph.graph.nodes)
    notes = next(r for r in plain.records if r.name == "quantize_linear").details
    assert any("KV cache scheme applies only with quantize.kv_cache: fp8" in line for line in notes)


def test_fp8_weights_with_unquantized_activations_are_served_per_token_with_a_warning(float_llama, tmp_path, caplog):
    directory = write_prequantized(float_llama, tmp_path / "w8a16", QuantScheme("fp8"), compressed_tensors_layer("fp8"),
                                   ct_config(FP8, None, "float-quantized"))
    with caplog.at_level(logging.WARNING):
        llm = autodeploy(str(directory), device="cpu")
    assert "activations unquantized in the checkpoint are quantized to fp8 per token at run time" in caplog.text
    assert all(torch.isfinite(t).all() for t in llm.logits(PROMPTS))


def test_quantize_settings_on_a_prequantized_checkpoint_are_a_config_error(float_llama, tmp_path):
    directory = write_prequantized(float_llama, tmp_path / "awq", QuantScheme("int4_wo", group_size=GROUP), awq_layer, AWQ)
    with pytest.raises(ConfigError, match="already quantized .*AutoAWQ"):
        autodeploy(str(directory), device="cpu", quantize={"default": "int8_wo"})


BAD_CONFIGS = {
    "an unknown method": ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    "a group without weights": ({**ct_config(INT4), "config_groups": {"group_0": {"targets": ["Linear"]}}},
                                "serves weight quantization"),
    "a malformed compressed-tensors config": ({**ct_config(INT4), "config_groups": {"group_0": {"weights": INT4}}},
                                              "not a valid compressed-tensors config"),
    "3-bit AWQ": ({**AWQ, "bits": 3}, "bits is 3"),
    "GPTQ act-order": ({**GPTQ, "desc_act": True}, "desc_act is true"),
    "int4 per channel": (ct_config({**INT4, "strategy": "channel", "group_size": None}), "not a scheme autodeploy serves"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_a_config_autodeploy_cannot_serve_is_a_checkpoint_error_before_export(case, float_llama, tmp_path):
    config, message = BAD_CONFIGS[case]
    directory = write_prequantized(float_llama, tmp_path / "bad", QuantScheme("int4_wo", group_size=GROUP), awq_layer, config)
    with pytest.raises(CheckpointError, match=message):
        autodeploy(str(directory), device="cpu")


def test_tensors_that_disagree_with_the_config_name_the_tensor(float_llama, tmp_path):
    # The config says groups of 64; the tensors hold groups of 32.
    directory = write_prequantized(float_llama, tmp_path / "groups", QuantScheme("int4_wo", group_size=GROUP), awq_layer,
                                   {**AWQ, "group_size": 64})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.\w+\.\w+_proj\.\w+ is int32 .*the quantization_config disagrees"):
        autodeploy(str(directory), device="cpu")


def test_a_missing_tensor_is_named(float_llama, tmp_path):
    directory = write_prequantized(float_llama, tmp_path / "missing", QuantScheme("int4_wo", group_size=GROUP), awq_layer, AWQ)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layer model\.layers\.1\.mlp\.up_proj has no tensor model\.layers\.1\.mlp\.up_proj\.qzeros"):
        autodeploy(str(directory), device="cpu")


def test_act_order_tensors_are_refused_even_when_the_config_says_nothing(float_llama, tmp_path):
    directory = write_prequantized(float_llama, tmp_path / "g_idx", QuantScheme("int4_wo", group_size=GROUP), gptq_layer(1), GPTQ)
    tensors = load_file(directory / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match="g_idx reorders the input channels"):
        autodeploy(str(directory), device="cpu")
