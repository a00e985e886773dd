"""Settings: precedence of every layer, validation errors, user transforms, auto resolution."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig

from autodeploy import Transform, TransformConfig, TransformResult, autodeploy, deployment_settings, register_transform
from autodeploy.auto_settings import resolve_auto_settings
from autodeploy.config import DeploySettings, default_yaml_path, load_settings, transform_configs
from autodeploy.errors import ConfigError
from autodeploy.transforms.registry import STAGES

DEFAULT_TRANSFORMS = tuple(OmegaConf.load(default_yaml_path()).transforms)
PROMPT_IDS = [5, 17, 42, 99, 3, 250]


@dataclass
class ScaleLogitsConfig(TransformConfig):
    logit_scale: float = 1.0


USER_PASS_RUNS: list[tuple[ScaleLogitsConfig, str]] = []


@register_transform("test_user_pass", stage="cleanup")
class ScaleLogits(Transform):
    """A user pass: multiplies the logits by ``logit_scale`` (one new node before the output)."""

    config_class = ScaleLogitsConfig

    def apply(self, gm, context) -> TransformResult:
        USER_PASS_RUNS.append((self.config, context.settings.device))
        output = gm.graph.output_node()
        (logits,) = output.all_input_nodes
        with gm.graph.inserting_before(output):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (logits, self.config.logit_scale))
        scaled.meta["val"] = logits.meta["val"]  # the runtime reads the vocabulary size from the output's metadata
        output.replace_input_with(logits, scaled)
        return TransformResult(matches=1, changed=True, notes=f"logits × {self.config.logit_scale}")


def write_yaml(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


# --- precedence -------------------------------------------------------------------------------

@pytest.fixture
def layered(tmp_path):
    """Each layer sets max_batch_size and test_user_pass.logit_scale to its own value."""
    return {
        "file1": write_yaml(tmp_path, "one.yaml", (
            "max_batch_size: 8\n"
            "transforms:\n"
            "  export_to_fx: {strict: true}\n"
            "  test_user_pass: {logit_scale: 3.0}\n"
        )),
        "file2": write_yaml(tmp_path, "two.yaml", "max_batch_size: 4\ntransforms:\n  test_user_pass: {logit_scale: 5.0}\n"),
        "keywords": {"max_batch_size": 2, "transforms": {"test_user_pass": {"logit_scale": 7.0}}},
        "set": ["max_batch_size=1", "transforms.test_user_pass.logit_scale=9"],
    }


def merged(layered, *names: str):
    return load_settings(
        config_files=[layered[name] for name in names if name.startswith("file")],
        overrides=layered["keywords"] if "keywords" in names else None,
        set_arguments=layered["set"] if "set" in names else [],
    )


@pytest.mark.parametrize(
    "layers, batch, scale",
    [
        ((), 32, None),
        (("file1",), 8, 3.0),
        (("file1", "file2"), 4, 5.0),
        (("file2", "file1"), 8, 3.0),  # files merge in the order given
        (("file1", "file2", "keywords"), 2, 7.0),
        (("file1", "file2", "keywords", "set"), 1, 9.0),
    ],
    ids=["default.yaml", "+file1", "+file2", "file2-then-file1", "+keywords", "+set"],
)
def test_each_layer_wins_over_the_ones_before(layered, layers, batch, scale):
    settings = merged(layered, *layers)
    assert settings.max_batch_size == batch
    configs = transform_configs(settings)
    if scale is None:
        assert "test_user_pass" not in configs
    else:
        assert configs["test_user_pass"].logit_scale == scale
        assert isinstance(configs["test_user_pass"].logit_scale, float)  # "--set ...=9" arrives typed


def test_later_layers_keep_keys_they_do_not_set(layered):
    settings = merged(layered, "file1", "file2", "keywords", "set")
    configs = transform_configs(settings)
    assert configs["export_to_fx"].strict is True  # only file1 sets it
    default_patches = list(OmegaConf.load(default_yaml_path()).transforms.export_to_fx.patches)
    assert configs["export_to_fx"].patches == default_patches and len(default_patches) >= 3  # default.yaml
    assert list(configs)[: len(DEFAULT_TRANSFORMS)] == list(DEFAULT_TRANSFORMS)  # default.yaml order, then new entries
    assert settings.seed == 0  # dataclass default: no YAML sets it


def test_deployment_settings_apply_the_same_precedence(layered, llama_dir):
    settings, _ = deployment_settings(str(llama_dir), config=[layered["file1"], layered["file2"]], max_batch_size=2)
    assert settings.max_batch_size == 2
    settings, _ = deployment_settings(str(llama_dir), config=layered["file1"], set_arguments=layered["set"], max_batch_size=2)
    assert settings.max_batch_size == 1


def test_default_yaml_layers_over_dataclass_defaults():
    assert DeploySettings().transforms == {}
    settings = load_settings()
    assert list(settings.transforms) == list(DEFAULT_TRANSFORMS)
    assert {"build_model", "export_to_fx", "cleanup_noop", "load_weights"} <= set(settings.transforms)


# --- validation errors ------------------------------------------------------------------------

@pytest.mark.parametrize("layer", ["keyword", "--set", "yaml"])
def test_unknown_top_level_key_names_it_and_the_close_match(tmp_path, layer):
    kwargs = {
        "keyword": {"overrides": {"max_batch_sise": 4}},
        "--set": {"set_arguments": ["max_batch_sise=4"]},
        "yaml": {"config_files": [write_yaml(tmp_path, "typo.yaml", "max_batch_sise: 4\n")]},
    }[layer]
    with pytest.raises(ConfigError, match="max_batch_sise") as error:
        load_settings(**kwargs)
    assert re.search(r"(?i)did you mean:? 'max_batch_size'", str(error.value))


def test_unknown_transform_in_yaml_names_it_and_the_close_match(tmp_path):
    path = write_yaml(tmp_path, "mine.yaml", "transforms:\n  cleanup_nop: {}\n")
    with pytest.raises(ConfigError, match="unknown transform 'cleanup_nop'") as error:
        load_settings([path])
    assert "did you mean 'cleanup_noop'" in str(error.value)


def test_unknown_transform_option_names_the_option_and_valid_keys(tmp_path):
    path = write_yaml(tmp_path, "mine.yaml", "transforms:\n  test_user_pass: {logit_scael: 2.0}\n")
    with pytest.raises(ConfigError, match="transforms.test_user_pass") as error:
        load_settings([path])
    assert "logit_scael" in str(error.value) and "logit_scale" in str(error.value)


@pytest.mark.parametrize(
    "yaml_text, named",
    [
        ("transforms:\n  cleanup_noop: {enabled: maybe}\n", "maybe"),
        ("transforms:\n  test_user_pass: {logit_scale: big}\n", "big"),
        ("transforms:\n  export_to_fx: {patches: 3}\n", "export_to_fx"),
        ("transforms:\n  cleanup_noop: 3\n", "cleanup_noop"),
        ("max_batch_size: many\n", "many"),
        ("max_batch_size: 0\n", "max_batch_size"),
        ("device: tpu\n", "tpu"),
        ("dtype: float8\n", "float8"),
        ("weights: some\n", "weights"),
    ],
)
def test_wrong_value_type_or_choice_is_a_config_error(tmp_path, yaml_text, named):
    path = write_yaml(tmp_path, "mine.yaml", yaml_text)
    with pytest.raises(ConfigError, match=named):
        load_settings([path])


@pytest.mark.parametrize(
    "yaml_text, full_key",
    [("transforms:\n  cleanup_noop: {enabled: maybe}\n", "transforms.cleanup_noop.enabled"), ("max_batch_size: many\n", "max_batch_size")],
    ids=["transform-option", "top-level"],
)
def test_wrong_value_type_names_the_key_without_a_misspelling_hint(tmp_path, yaml_text, full_key):
    with pytest.raises(ConfigError) as error:
        load_settings([write_yaml(tmp_path, "mine.yaml", yaml_text)])
    assert full_key in str(error.value) and "did you mean" not in str(error.value)


def test_wrong_type_in_keyword_override_and_set_is_a_config_error():
    with pytest.raises(ConfigError, match="maybe"):
        load_settings(overrides={"transforms": {"cleanup_noop": {"enabled": "maybe"}}})
    with pytest.raises(ConfigError, match="many"):
        load_settings(set_arguments=["max_batch_size=many"])


def test_invalid_stage_name_lists_the_stages(tmp_path):
    path = write_yaml(tmp_path, "mine.yaml", "transforms:\n  cleanup_noop: {stage: cleanp}\n")
    with pytest.raises(ConfigError, match="'cleanp'") as error:
        load_settings([path])
    assert all(stage in str(error.value) for stage in STAGES)


@pytest.mark.parametrize("assignment", ["foo", "=3", "a b=1", " =1"])
def test_set_syntax_errors(assignment):
    with pytest.raises(ConfigError, match="key=value"):
        load_settings(set_arguments=[assignment])


@pytest.mark.parametrize("yaml_text", ["a: [1, 2\n", "key: value\n  bad: indent\n", "- just\n- a list\n"])
def test_invalid_yaml_file(tmp_path, yaml_text):
    path = write_yaml(tmp_path, "broken.yaml", yaml_text)
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_settings([path])


def test_transforms_given_as_a_list_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="transforms.*mapping"):
        load_settings([write_yaml(tmp_path, "mine.yaml", "transforms: [cleanup_noop, cleanup_transposes]\n")])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings([tmp_path / "nope.yaml"])


# --- user transforms and the pipeline ---------------------------------------------------------

def test_user_transform_from_yaml_runs_in_its_stage_with_its_typed_option(tmp_path, llama_dir, llama_llm):
    # Listed last in the YAML, but its stage (export) puts it before every cleanup pass.
    # The pass changes the model's function on purpose, which build-time verification would refuse.
    path = write_yaml(tmp_path, "user.yaml", "verify: {enabled: false}\ntransforms:\n  test_user_pass: {stage: export, logit_scale: 2}\n")
    USER_PASS_RUNS.clear()
    llm = autodeploy(str(llama_dir), config=path, device="cpu")

    names = [r.name for r in llm.records]
    assert names.index("test_user_pass") == names.index("export_to_fx") + 1
    assert names.index("test_user_pass") < names.index("cleanup_noop")
    assert [STAGES.index(r.stage) for r in llm.records] == sorted(STAGES.index(r.stage) for r in llm.records)

    ((config, device),) = USER_PASS_RUNS
    assert isinstance(config, ScaleLogitsConfig) and config.logit_scale == 2.0 and isinstance(config.logit_scale, float)
    assert device == "cpu"  # the context carries the resolved settings

    record = llm.records[names.index("test_user_pass")]
    assert (record.matches, record.nodes_after) == (1, record.nodes_before + 1)
    torch.testing.assert_close(llm.logits([PROMPT_IDS])[0], 2.0 * llama_llm.logits([PROMPT_IDS])[0])


def test_keyword_override_disables_a_default_transform(llama_dir, llama_llm):
    llm = autodeploy(str(llama_dir), device="cpu", transforms={"cleanup_transposes": {"enabled": False}})
    names = [r.name for r in llm.records]
    assert "cleanup_transposes" in [r.name for r in llama_llm.records] and "cleanup_transposes" not in names
    assert names == [r.name for r in llama_llm.records if r.name != "cleanup_transposes"]
    torch.testing.assert_close(llm.logits([PROMPT_IDS])[0], llama_llm.logits([PROMPT_IDS])[0])


def test_dump_graphs_writes_one_file_per_transform_with_a_graph(tmp_path, llama_dir):
    dump = tmp_path / "graphs"
    llm = autodeploy(str(llama_dir), device="cpu", dump_graphs=str(dump))
    with_graph = [(i, r) for i, r in enumerate(llm.records) if r.nodes_after is not None]
    assert [r.name for _, r in with_graph] == [r.name for r in llm.records[1:]]  # all but build_model (no graph yet)
    assert sorted(p.name for p in dump.iterdir()) == [f"{i:02d}_{r.stage}_{r.name}.txt" for i, r in with_graph]
    for index, record in with_graph:
        assert "linear" in (dump / f"{index:02d}_{record.stage}_{record.name}.txt").read_text()  # aten.* or autodeploy.*


# --- auto settings ----------------------------------------------------------------------------

def test_auto_settings_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    resolved = resolve_auto_settings(load_settings(), LlamaConfig(max_position_embeddings=1234, dtype="bfloat16"))
    assert (resolved.device, resolved.dtype, resolved.max_seq_len) == ("cpu", "float32", 1234)


def test_auto_settings_on_a_gpu_machine_keeps_the_checkpoint_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    resolved = resolve_auto_settings(load_settings(), LlamaConfig(dtype="bfloat16"))
    assert (resolved.device, resolved.dtype) == ("cuda", "bfloat16")


def test_auto_dtype_on_a_gpu_without_bfloat16_tensor_cores_is_float16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert resolve_auto_settings(load_settings(), LlamaConfig(dtype="bfloat16")).dtype == "float16"
    assert resolve_auto_settings(load_settings(), LlamaConfig(dtype="float32")).dtype == "float32"


def test_explicit_settings_are_not_replaced(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings = load_settings(overrides={"max_seq_len": 100, "dtype": "bfloat16"})
    resolved = resolve_auto_settings(settings, LlamaConfig(max_position_embeddings=1234))
    assert (resolved.max_seq_len, resolved.dtype) == (100, "bfloat16")


def test_cuda_without_a_gpu_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_auto_settings(load_settings(overrides={"device": "cuda"}), LlamaConfig())


def test_deployment_settings_resolve_from_the_checkpoint(llama_dir):
    settings, factory = deployment_settings(str(llama_dir))
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert settings.device == expected_device
    if expected_device == "cpu":
        assert settings.dtype == "float32"
    assert settings.max_seq_len == factory.hf_config.max_position_embeddings == 512


def test_site_config_files_layer_between_default_yaml_and_user_files(tmp_path, monkeypatch):
    site = write_yaml(tmp_path, "site.yaml", "max_batch_size: 3\nkv_cache: {memory_fraction: 0.05}\n")
    user = write_yaml(tmp_path, "user.yaml", "max_batch_size: 5\n")
    monkeypatch.setenv("AUTODEPLOY_CONFIG", str(site))
    assert (load_settings().max_batch_size, load_settings().kv_cache.memory_fraction) == (3, 0.05)
    assert load_settings([user]).max_batch_size == 5
    monkeypatch.setenv("AUTODEPLOY_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="missing.yaml does not exist"):
        load_settings()
