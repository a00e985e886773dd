"""``quantize_linear``: per-layer schemes on the tiny models, token-identical to Hugging Face over the same
quantized weights, and the bad inputs of the ``quantize`` settings."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autodeploy import SamplingParams, autodeploy
from autodeploy.cli.main import main
from autodeploy.custom_ops.quantized_linear import QuantScheme, dequantize_weight, quantize_weight
from autodeploy.errors import ConfigError
from tests.runtime.test_engine import hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model

# fp8 linears whose input a norm or gated activation rounds are fp8_prequantized_linear (fuse_fp8_quantization)
QUANTIZED_OPS = {"int8_wo": ("int8_wo_linear",), "int4_wo": ("int4_wo_linear",),
                 "fp8": ("fp8_linear", "fp8_prequantized_linear")}


def quantized_ops(llm) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in llm.graph.graph.nodes:
        name = str(node.target).removeprefix("autodeploy.").split(".")[0]
        for scheme, ops in QUANTIZED_OPS.items():
            if node.op == "call_function" and name.startswith(ops):
                counts[scheme] = counts.get(scheme, 0) + 1
    return counts


def quantize_hf_weights(model: nn.Module, scheme: QuantScheme) -> nn.Module:
    """The HF model with every projection replaced by its dequantized weight (the LM head too unless it is
    tied to the embedding): the function a weight-only deploy must serve exactly."""
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and not (tied and name == "lm_head"):
                module.weight.copy_(dequantize_weight(scheme, quantize_weight(scheme, module.weight)))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", ["int8_wo", "int4_wo"])
def test_weight_only_deploys_generate_what_hf_generates_over_the_same_quantized_weights(tiny_checkpoint, arch, scheme):
    llm = autodeploy(str(tiny_checkpoint(arch)), device="cpu", quantize={"default": scheme, "int4_group_size": 32})
    hf = tiny_hf_model(arch)
    untied_head = hf.lm_head.weight is not hf.get_input_embeddings().weight
    assert quantized_ops(llm) == {scheme: 2 * 4 + untied_head}  # q/k/v fused, o, gate/up fused, down a layer
    hf = quantize_hf_weights(hf, QuantScheme(scheme, group_size=32))
    prompts = random_prompts(6, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        assert output.token_ids == hf_greedy(hf, prompt, 8)
    assert llm.verification.relative_error <= 1e-4  # against the quantized reference, at float32's tolerance


def test_fp8_deploys_verify_against_a_reference_that_rounds_its_activations_too(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"default": "fp8"})
    assert quantized_ops(llm) == {"fp8": 8}  # per layer: q/k/v and gate/up fused (per-channel scales)
    assert "quantized activations: tolerance" in llm.verification.note
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6


def test_a_mixed_config_applies_each_layers_scheme_as_inspect_shows(tiny_checkpoint, capsys):
    layers = '{"layers.0.self_attn.*": fp8, "*.mlp.down_proj": none, "*.mlp.*": int4_wo}'
    code = main(["inspect", str(tiny_checkpoint("llama")), "--set", "quantize.default=int8_wo",
                 "--set", f"quantize.layers={layers}", "--set", "quantize.int4_group_size=32"])
    assert code in (0, None)
    shown = dict(line.strip().split(": ") for line in capsys.readouterr().out.splitlines()
                 if line.startswith("  model.layers."))
    expected = {}
    for layer in (0, 1):
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            expected[f"model.layers.{layer}.self_attn.{projection}"] = "fp8" if layer == 0 else "int8_wo"
        expected[f"model.layers.{layer}.mlp.gate_proj"] = expected[f"model.layers.{layer}.mlp.up_proj"] = "int4_wo"
    assert shown == expected  # down_proj: none, so not listed; the tied LM head is not quantized


def test_a_checkpoint_and_random_weights_quantize_alike(tiny_checkpoint):
    built = autodeploy(str(tiny_checkpoint("mistral")), device="cpu", weights="random", quantize={"default": "int8_wo"})
    assert quantized_ops(built) == {"int8_wo": 9}  # 4 a layer (q/k/v and gate/up fused) and the (untied) LM head
    assert all(torch.isfinite(t).all() for t in built.logits([[3, 4, 5]]))


def test_quantizing_leaves_the_values_of_the_rest_of_the_graph_symbolic(tiny_checkpoint):
    # quantize_linear infers values for its own nodes only. Re-running the whole graph on torch 2.11
    # specialised the rotary angles to the example sizes ([2, 4, R]), and the Triton attention refused them.
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"default": "int4_wo", "int4_group_size": 32})
    seq = next(n for n in llm.graph.graph.nodes if n.name == "input_ids").meta["val"].shape[1]
    attention = next(n for n in llm.graph.graph.nodes if "cached_attention_rope" in str(n.target))
    for value in (a.meta["val"] for a in attention.args[:5]):
        assert isinstance(value.shape[1], torch.SymInt) and value.shape[1].node.expr == seq.node.expr, value.shape


def test_moe_routers_and_experts_stay_unquantized_and_attention_is_quantized(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", quantize={"default": "int8_wo"})
    assert quantized_ops(llm) == {"int8_wo": 5}  # q/k/v fused and o of two layers, and the LM head
    report = llm.pipeline_report()
    assert "MoE router" in report and "block_sparse_moe" not in report.split("quantize_linear:")[1].split("kept")[0]
    assert any("moe" in str(node.target) for node in llm.graph.graph.nodes)


@pytest.mark.parametrize("scheme", ["int8_wo", "int4_wo"])
def test_moe_experts_quantize_apart_from_the_dense_layers_and_generate_what_hf_generates_over_them(tiny_checkpoint, scheme,
                                                                                                   tmp_path):
    llm = autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", quantize={"experts": scheme, "int4_group_size": 32})
    assert quantized_ops(llm) == {}  # attention and the LM head stay as they were
    assert [str(n.target) for n in llm.graph.graph.nodes if "moe" in str(n.target)] == [f"autodeploy.moe_{scheme}_torch.default"] * 2
    assert next(r for r in llm.records if r.name == "quantize_linear").notes.startswith(f"2 MoE layers' experts {scheme}")
    hf = tiny_hf_model("mixtral")
    quantized = QuantScheme(scheme, group_size=32)
    with torch.no_grad():
        for name, parameter in hf.named_parameters():
            if ".experts." in name:
                parameter.copy_(dequantize_weight(quantized, quantize_weight(quantized, parameter)))
    prompts = random_prompts(4, seed=5)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(hf, prompt, 8)
    assert llm.verification.relative_error <= 1e-4
    reloaded = autodeploy(str(llm.save(tmp_path / "experts")))
    assert all(torch.equal(a, b) for a, b in zip(reloaded.logits(prompts), llm.logits(prompts)))
    with pytest.raises(ConfigError, match="quantize.experts: MoE experts take int4_wo, int8_wo or none; got 'fp8'"):
        autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", quantize={"experts": "fp8"})


def assert_serves_hf_over_an_int8_table(llm, arch: str, tmp_path) -> None:
    """``llm`` (int8_wo projections, int8 embedding table) generates what HF generates over the same
    dequantized weights and table (a tied LM head is the table), and reloads with identical logits."""
    scheme = QuantScheme("int8_wo")
    hf = quantize_hf_weights(tiny_hf_model(arch), scheme)
    table = hf.get_input_embeddings().weight
    with torch.no_grad():
        table.copy_(dequantize_weight(scheme, quantize_weight(scheme, table)))
    prompts = random_prompts(4, seed=7)
    for prompt, output in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))):
        assert output.token_ids == hf_greedy(hf, prompt, 8)
    assert llm.verification.relative_error <= 1e-4
    reloaded = autodeploy(str(llm.save(tmp_path / "int8-table")))
    assert all(torch.equal(a, b) for a, b in zip(reloaded.logits(prompts), llm.logits(prompts)))


def test_an_int8_embedding_table_generates_what_hf_generates_over_the_same_rows_and_reloads(tiny_checkpoint, tmp_path):
    llm = autodeploy(str(tiny_checkpoint("qwen2")), device="cpu", quantize={"embedding": "int8", "default": "int8_wo"})
    lookups = [str(n.target) for n in llm.graph.graph.nodes if "embedding" in str(n.target)]
    assert lookups == ["autodeploy.embedding_int8.default"]
    assert llm.graph.get_parameter("model.model.embed_tokens.qweight").dtype == torch.int8
    assert next(r for r in llm.records if r.name == "quantize_linear").notes == "15 int8_wo, embedding table int8; 2 MLPs split"
    assert_serves_hf_over_an_int8_table(llm, "qwen2", tmp_path)


def test_an_embedding_table_tied_to_an_unquantized_lm_head_stays_in_the_models_dtype(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"embedding": "int8"})
    assert [str(n.target) for n in llm.graph.graph.nodes if "embedding" in str(n.target)] == ["aten.embedding.default"]
    record = next(r for r in llm.records if r.name == "quantize_linear")
    assert "kept in the model's dtype" in record.details[-1] and "embedding" in record.details[-1]


def test_a_table_tied_to_an_int8_wo_lm_head_is_stored_once_for_both(tiny_checkpoint, tmp_path):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"default": "int8_wo", "embedding": "int8"})
    table = next(n for n in llm.graph.graph.nodes if n.op == "get_attr" and n.target.endswith("qweight")
                 and any("embedding_int8" in str(u.target) for u in n.users))
    assert sorted(str(u.target).split(".")[1].removesuffix("_torch") for u in table.users) == ["embedding_int8", "int8_wo_linear"]
    assert "embedding table int8 (shared with the tied LM head's int8_wo)" in next(
        r.notes for r in llm.records if r.name == "quantize_linear")
    assert_serves_hf_over_an_int8_table(llm, "llama", tmp_path)


def test_an_unknown_embedding_scheme_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="quantize.embedding: the embedding table takes int8 or none; got 'int4_wo'"):
        autodeploy(str(tiny_checkpoint("qwen2")), device="cpu", quantize={"embedding": "int4_wo"})


def test_a_quantized_deployment_saves_and_reloads_with_identical_logits(tiny_checkpoint, tmp_path):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"default": "int4_wo", "int4_group_size": 32,
                                                                             "layers": {"*.self_attn.*": "fp8"}})
    reloaded = autodeploy(str(llm.save(tmp_path / "quantized")))
    sequences = [[3, 4, 5, 6], list(range(10, 40))]
    for want, got in zip(llm.logits(sequences), reloaded.logits(sequences)):
        assert torch.equal(want, got)
    assert quantized_ops(reloaded) == quantized_ops(llm) == {"fp8": 4, "int4_wo": 4}  # q/k/v and gate/up fused


def test_an_unknown_scheme_is_a_config_error_before_anything_is_built(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"quantize.default: unknown quantization scheme 'int3'.*int8_wo"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"default": "int3"})
    with pytest.raises(ConfigError, match=r"quantize.layers\['lm_head'\]: unknown quantization scheme 'fp4'"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"layers": {"lm_head": "fp4"}})
    with pytest.raises(ConfigError, match="fp8_weight_scale must be 'channel' or 'tensor'"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"default": "fp8", "fp8_weight_scale": "row"})


def test_a_glob_that_matches_nothing_is_a_warning_naming_it(tiny_checkpoint, caplog):
    with caplog.at_level(logging.WARNING):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"layers": {"*.attn.q*": "int8_wo"}})
    assert "quantize.layers['*.attn.q*'] matches no quantizable layer" in caplog.text


def test_a_group_size_that_does_not_divide_the_layer_is_a_config_error_naming_it(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.q_proj: int4_wo needs K \(64\) to be a multiple of "
                                          r"group_size 48"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={"default": "int4_wo", "int4_group_size": 48})


def test_fp8_on_a_gpu_without_fp8_is_a_config_error_naming_schemes_that_work(monkeypatch):
    from types import SimpleNamespace

    from autodeploy.config import QuantizeSettings
    from autodeploy.transforms import TransformConfig
    from autodeploy.transforms.quantize_linear import QuantizeLinear

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    context = SimpleNamespace(settings=SimpleNamespace(device="cuda", quantize=QuantizeSettings(layers={"*.mlp.*": "fp8"})),
                              model_factory=None)
    with pytest.raises(ConfigError, match=r"fp8 needs a GPU of compute capability 8.9.*8.0. Use int4_wo, .*int8_wo"):
        QuantizeLinear(TransformConfig()).validate(context)
    context.settings.quantize = QuantizeSettings(default="int8_wo")
    QuantizeLinear(TransformConfig()).validate(context)  # weight-only schemes run anywhere


AWQ = {"default": "int4_awq", "int4_group_size": 32, "calibration": {"samples": 4, "seq_len": 64}}


def test_an_awq_deploy_calibrates_once_then_reuses_the_cached_statistics(tiny_checkpoint, tmp_path, monkeypatch):
    from autodeploy.transforms import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs = []
    original = calibration.graph_statistics
    monkeypatch.setattr(calibration, "graph_statistics", lambda *a: runs.append(1) or original(*a))
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=AWQ)
    assert quantized_ops(llm) == {}  # counted below: int4_awq is its own op
    awq = [n for n in llm.graph.graph.nodes if "int4_awq_linear" in str(n.target)]
    assert len(awq) == 14
    assert llm.verification.relative_error <= 1e-4  # held to HF over the deployed (smoothed) weights
    smooth = llm.graph.get_parameter("model.model.layers.0.mlp.down_proj.input_smooth")
    assert not torch.allclose(smooth, torch.ones_like(smooth))  # the search moved off round-to-nearest
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    calibrated = len(runs)  # the model, and the twin on its own random weights
    autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=AWQ)
    assert len(runs) == calibrated + 1  # the twin again; the model's statistics come from the cache
    assert list((tmp_path / "autodeploy" / "calibration").glob("*.pt"))


def test_calibration_runs_the_canonical_graph_and_sees_what_the_models_projections_see(tiny_checkpoint, tmp_path,
                                                                                        monkeypatch):
    # The graph as the quantize stage finds it (after match: gated_mlp holds gate, up and down), with the
    # checkpoint's weights: each projection's input statistics equal what pre-hooks on the HF modules record.
    from autodeploy.transforms import calibration
    from tests.tiny_models import tiny_hf_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    original = calibration.graph_statistics
    monkeypatch.setattr(calibration, "graph_statistics", lambda *a: calls.append((a, original(*a))) or calls[-1][1])
    autodeploy(str(tiny_checkpoint("llama")), device="cpu", set_arguments=["verify.enabled=false"],
               quantize={"default": "int4_gptq", "int4_group_size": 32, "calibration": {"samples": 2, "seq_len": 32}})
    ((graph, windows, modules, hessians, _), statistics), = calls
    assert len(modules) == 14 and set(hessians) == set(modules)
    model, seen = tiny_hf_model("llama"), {}

    def hook(name):
        def record(module, args):
            seen.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]))
        return record

    for name in modules:
        model.get_submodule(name).register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for window in windows:
            model(input_ids=torch.tensor([window]), use_cache=False)
    for name in modules:
        x = torch.cat(seen[name])
        torch.testing.assert_close(statistics[name]["max_abs"], x.abs().amax(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(statistics[name]["mean_abs"], x.abs().mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(statistics[name]["hessian"], (x.T.double() @ x.double() / len(x)).float(),
                                   rtol=1e-4, atol=1e-6)
        weight = model.get_submodule(name).weight
        assert torch.equal(statistics[name]["weight_max_abs"], weight.abs().amax(0))


def test_a_smoothquant_deploy_runs_int8_activations_and_verifies_against_a_reference_that_rounds_them(tiny_checkpoint,
                                                                                                       tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings = {"default": "smoothquant", "calibration": {"samples": 4, "seq_len": 64}}
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=settings)
    w8a8 = [n for n in llm.graph.graph.nodes if "int8_w8a8_linear" in str(n.target)]
    # Per layer: q/k/v and gate/up, their smoothing folded into the norms before them, fuse into one GEMM
    # each; down's smoothing moves into up's rows, o_proj's into v_proj's (one s per value channel).
    assert len(w8a8) == 8 and all(n.args[3] is None for n in w8a8)
    assert "quantized activations: tolerance" in llm.verification.note
    assert llm.verification.relative_error <= llm.verification.tolerance
    (report,) = [r for r in llm.records if r.name == "fold_smoothing"]
    assert sum("into" in d and "rows" in d for d in report.details) == 4  # up and v_proj, two layers
    assert not any(name.endswith("input_smooth") for name, _ in llm.graph.named_parameters())
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    with pytest.raises(ConfigError, match="smoothquant alpha must lie in"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={**settings, "smoothquant_alpha": 1.5})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_folding_smoothquant_smoothing_keeps_the_function(tiny_checkpoint, tmp_path, monkeypatch, arch):
    # The folded deploy (norm weights and up rows times the factors; Qwen2's q/k/v have biases) against the same deploy with the smoothing left in the ops: the same logits up to rounding, and
    # verification's reference (the unfolded model) agrees with both alike.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings = {"default": "smoothquant", "calibration": {"samples": 4, "seq_len": 64}}
    folded = autodeploy(str(tiny_checkpoint(arch)), device="cpu", quantize=settings)
    kept = autodeploy(str(tiny_checkpoint(arch)), device="cpu", quantize=settings,
                      set_arguments=["transforms.fold_smoothing.enabled=false"])
    (report,) = [r for r in folded.records if r.name == "fold_smoothing"]
    assert not [n for n in folded.graph.graph.nodes if "int8_w8a8_linear" in str(n.target) and n.args[3]]
    # per layer: the input norm, the post-attention norm, up, v_proj (qwen2: with its bias; and the final norm)
    assert report.matches == 8 + (arch == "qwen2")
    assert all(n.args[3] is not None for n in kept.graph.graph.nodes if "int8_w8a8_linear" in str(n.target))
    assert folded.verification.relative_error <= kept.verification.relative_error * 1.5 + 1e-6
    prompt = [[5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert folded.generate(prompt, params)[0].token_ids == kept.generate(prompt, params)[0].token_ids
    reloaded = autodeploy(str(folded.save(tmp_path / "folded")))  # the folded norms and ops travel as they are
    assert all(torch.equal(a, b) for a, b in zip(reloaded.logits(prompt), folded.logits(prompt)))


def test_o_proj_keeps_its_smoothing_beside_an_fp8_kv_cache(tiny_checkpoint, tmp_path, monkeypatch):
    # The cache's value scales are calibrated on v_proj's outputs as the checkpoint makes them: scaling
    # v_proj's rows afterwards could push values past them, so o_proj keeps its smoothing in the op.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings = {"default": "smoothquant", "kv_cache": "fp8", "calibration": {"samples": 4, "seq_len": 64}}
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=settings)
    smoothed = [n.args[3].target for n in llm.graph.graph.nodes if "int8_w8a8_linear" in str(n.target) and n.args[3]]
    assert len(smoothed) == 2 and all(t.endswith("o_proj.input_smooth") for t in smoothed)
    (report,) = [r for r in llm.records if r.name == "fold_smoothing"]
    assert any("not with an fp8 KV cache" in d for d in report.details)


def test_fp8_with_static_activation_scales_calibrates_one_scale_a_layer_and_verifies(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings = {"default": "fp8", "fp8_activations": "static", "calibration": {"samples": 4, "seq_len": 64}}
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize=settings)
    assert len([n for n in llm.graph.graph.nodes if "fp8_static_linear" in str(n.target)]) == 14
    scales = [p for name, p in llm.graph.named_parameters() if name.endswith(".input_scale")]
    assert len(scales) == 14 and len({float(p) for p in scales}) > 1  # each layer's own range
    assert "quantized activations: tolerance" in llm.verification.note
    assert llm.verification.relative_error <= llm.verification.tolerance
    with pytest.raises(ConfigError, match="fp8_activations must be 'dynamic'"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={**settings, "fp8_activations": "per-token"})


def test_awq_calibration_bad_inputs_are_config_errors(tiny_checkpoint, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    with pytest.raises(ConfigError, match=r"has \d+ tokens, fewer than samples × seq_len = 4 × 64"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu",
                   quantize={**AWQ, "calibration": {"dataset": str(short), "samples": 4, "seq_len": 64}})
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "x = 1"}\n{"prompt": "y"}\n')
    with pytest.raises(ConfigError, match=r"broken.jsonl:2: a calibration line must be a JSON object with a \"text\""):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={**AWQ, "calibration": {"dataset": str(broken)}})
    with pytest.raises(ConfigError, match="neither 'builtin' nor a readable file"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={**AWQ, "calibration": {"dataset": "nope.txt"}})
    with pytest.raises(ConfigError, match="with weights=random use a scheme without calibration: fp8, int4_wo"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", weights="random", quantize=AWQ)


def test_a_gptq_deploy_serves_int4_wo_ops_holding_its_rounding(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={**AWQ, "default": "int4_gptq"})
    assert quantized_ops(llm) == {"int4_wo": 8}  # gptq stores int4_wo's layout: q/k/v and gate/up fuse
    assert llm.verification.relative_error <= 1e-4
    assert "14 int4_gptq" in next(r.notes for r in llm.records if r.name == "quantize_linear")


def test_statistics_past_the_cache_limit_are_recomputed_not_written(tiny_checkpoint, tmp_path, monkeypatch):
    from autodeploy.transforms import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "CACHE_LIMIT_BYTES", 1024)  # the tiny model's Hessians are larger
    autodeploy(str(tiny_checkpoint("llama")), device="cpu", quantize={**AWQ, "default": "int4_gptq"})
    assert not list(tmp_path.glob("autodeploy/calibration/*.pt"))
