"""``autodeploy quantize`` (autodeploy/quantized_checkpoint.py): the written compressed-tensors checkpoint reloads
with the logits of the deploy that quantized it, the package's own decompressors read its tensors as our ops do,
and what cannot be written is refused before any work."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from autodeploy import autodeploy
from autodeploy.cli.main import main
from autodeploy.custom_ops.quantized_linear import QuantScheme, dequantize_weight
from autodeploy.errors import ConfigError
from autodeploy.quantized_checkpoint import quantize_checkpoint

MIXED = {"default": "int8_wo", "layers": {"*.mlp.*": "int4_wo", "layers.0.self_attn.*": "fp8"}, "int4_group_size": 32}
PROMPTS = [[3, 4, 5, 6, 7], list(range(40, 70))]


@pytest.fixture(scope="module")
def written(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "llama-mixed"
    quantize_checkpoint(str(tiny_checkpoint("llama")), out, device="cpu", quantize=MIXED)
    return out


def test_a_written_checkpoint_serves_the_logits_of_the_deploy_that_quantized_it(written, tiny_checkpoint):
    here = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=MIXED)
    served = autodeploy(str(written), device="cpu")
    for got, want in zip(served.logits(PROMPTS), here.logits(PROMPTS)):
        assert torch.equal(got, want)
    notes = next(r for r in served.records if r.name == "quantize_linear").notes
    assert notes.startswith("4 fp8, 6 int4_wo, 4 int8_wo as the checkpoint's compressed-tensors (mixed-precision)")


def test_the_config_groups_name_each_layer_under_its_format(written):
    config = json.loads((written / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "mixed-precision"
    groups = {group["format"]: group for group in config["config_groups"].values()}
    assert groups["float-quantized"]["targets"] == [f"model.layers.0.self_attn.{p}_proj" for p in "koqv"]
    assert groups["float-quantized"]["input_activations"]["dynamic"] is True
    packed = [g for g in config["config_groups"].values() if g["format"] == "pack-quantized"]
    assert sorted(g["weights"]["num_bits"] for g in packed) == [4, 8]
    assert (written / "tokenizer.json").is_file() and (written / "generation_config.json").is_file()


def test_compressed_tensors_decompresses_the_tensors_to_what_our_ops_compute_with(written):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((written / "config.json").read_text())["quantization_config"])
    tensors = load_file(written / "model.safetensors")
    from transformers import AutoConfig

    from autodeploy.models.prequantized import detect_prequantized

    found = detect_prequantized(AutoConfig.from_pretrained(written), written)
    for group in config.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(group.format)
        for path in group.targets[:2]:
            layer = {key.removeprefix(f"{path}."): value for key, value in tensors.items() if key.startswith(f"{path}.")}
            theirs = compressor.decompress(layer, group)["weight"].to(torch.float32)
            rows, columns = theirs.shape
            scheme = QuantScheme({"float": "fp8", "int": "int8_wo" if group.weights.num_bits == 8 else "int4_wo"}[group.weights.type],
                                 group_size=32)
            ours = dequantize_weight(scheme, found.stored(path, scheme, layer, (rows, columns)))
            assert torch.equal(theirs, ours), path


def test_static_fp8_scales_travel_as_input_scale(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings = {"default": "fp8", "fp8_activations": "static", "calibration": {"samples": 4, "seq_len": 64}}
    out = quantize_checkpoint(str(tiny_checkpoint("llama")), tmp_path / "static", device="cpu", quantize=settings)
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"]["strategy"] == "tensor" and group["input_activations"]["dynamic"] is False
    assert "model.layers.1.mlp.up_proj.input_scale" in load_file(out / "model.safetensors")
    here = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=settings)
    for got, want in zip(autodeploy(str(out), device="cpu").logits(PROMPTS), here.logits(PROMPTS)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("settings", "message"), [
    ({"quantize": {"default": "int4_awq", "int4_group_size": 32}}, "int4_awq store tensors that compressed-tensors has no field for"),
    ({"quantize": {"default": "smoothquant"}}, "smoothquant store tensors that compressed-tensors has no field for"),
    ({"quantize": {"default": "none"}}, "quantize no layer"),
    ({"weights": "random", "quantize": {"default": "int8_wo"}}, "weights=random has none to write"),
    ({"quantize": {"default": "int8_wo", "embedding": "int8"}}, "an int8 embedding table has no compressed-tensors form"),
])
def test_what_cannot_be_written_is_a_config_error(settings, message, tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=message):
        quantize_checkpoint(str(tiny_checkpoint("llama")), tmp_path / "out", device="cpu", **settings)
    assert not (tmp_path / "out" / "config.json").exists()


def test_an_already_quantized_checkpoint_or_a_full_folder_is_refused(written, tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_checkpoint(str(written), tmp_path / "again", device="cpu", quantize={"default": "int8_wo"})
    with pytest.raises(ConfigError, match="not empty"):
        quantize_checkpoint(str(tiny_checkpoint("llama")), written, device="cpu", quantize={"default": "int8_wo"})


def test_the_cli_writes_one_and_says_how_to_serve_it(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "llama-int8"
    code = main(["quantize", str(tiny_checkpoint("llama")), "--out", str(out), "--set", "quantize.default=int8_wo",
                 "--set", "device=cpu"])
    assert code == 0 and f"autodeploy run {out}" in capsys.readouterr().out
    code = main(["quantize", str(tiny_checkpoint("llama")), "--out", str(out), "--set", "quantize.default=int8_wo"])
    printed = capsys.readouterr().err
    assert code == 1 and printed.startswith("error: ") and "not empty" in printed and "Traceback" not in printed
