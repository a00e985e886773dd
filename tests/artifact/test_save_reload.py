"""``LLM.save`` → ``autodeploy(DIR)``: the reload serves the build's exact logits and tokens without export,
transforms or verification; a damaged folder is a ``CheckpointError``; another environment rebuilds."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import shutil
from importlib import metadata
from pathlib import Path

import pytest
import torch

from autodeploy import LLM, SamplingParams, autodeploy
from autodeploy.artifact import manifest as manifest_module
from autodeploy.artifact import weights_file
from autodeploy.artifact.weights_file import load_tensors, save_tensors
from autodeploy.autotuner import describe_dispatch, token_dispatch
from autodeploy.custom_ops import candidates
from autodeploy.deployment import MODEL
from autodeploy.errors import CheckpointError, ConfigError

SEQUENCES = [list(range(3, 40)), [5], list(range(100, 117))]
PROMPTS = ["def f(x):", [7, 8, 9], "import os"]
GREEDY = SamplingParams(max_tokens=10, temperature=0)


def edited_copy(saved: Path, tmp_path: Path, **manifest_changes) -> Path:
    """A copy of the deployment with top-level manifest entries replaced."""
    copied = Path(shutil.copytree(saved, tmp_path / "copy"))
    manifest = json.loads((copied / "manifest.json").read_text())
    manifest.update(manifest_changes)
    (copied / "manifest.json").write_text(json.dumps(manifest))
    return copied


def kernels(llm) -> list[str]:
    return [str(n.target) for n in llm.graph.graph.nodes if n.op == "call_function" and "autodeploy" in str(n.target)]


def test_reload_serves_identical_logits_and_greedy_tokens_without_building(saved, llama_llm, forbid_building):
    forbid_building()
    llm = autodeploy(str(saved))
    for want, got in zip(llama_llm.logits(SEQUENCES), llm.logits(SEQUENCES)):
        assert torch.equal(want, got)
    tokens = [[o.outputs[0].token_ids for o in deployed.generate(PROMPTS, GREEDY)] for deployed in (llama_llm, llm)]
    assert tokens[0] == tokens[1]
    assert kernels(llm) == kernels(llama_llm)  # select's backend ops, as built
    assert llm.pipeline_report() == llama_llm.pipeline_report()  # records and the build's verification
    assert llm.tokenizer("def f(x):").input_ids == llama_llm.tokenizer("def f(x):").input_ids


def test_the_manifest_records_the_build_and_every_files_sha256(saved, llama_dir):
    manifest = json.loads((saved / "manifest.json").read_text())
    assert set(manifest["versions"]) == {"autodeploy", "torch", "transformers", "triton"}
    assert manifest["versions"]["torch"] == metadata.version("torch")  # a CUDA build's __version__ adds "+cu130"
    assert manifest["device"]["type"] == "cpu" and manifest["dtype"] == "float32"
    assert manifest["source"]["directory"] == str(Path(llama_dir).resolve())
    assert manifest["verification"]["relative_error"] <= manifest["verification"]["tolerance"]
    assert "not repeated on reload" in manifest["reload_verification"]
    files = {p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert {"graph.pt2", "weights.safetensors", "settings.yaml", "tuning.json", "serving.json"} <= files
    assert manifest["files"]["weights.safetensors"] == hashlib.sha256((saved / "weights.safetensors").read_bytes()).hexdigest()


def test_a_tampered_weights_file_is_a_checkpoint_error(saved, tmp_path):
    copied = edited_copy(saved, tmp_path)
    weights = bytearray((copied / "weights.safetensors").read_bytes())
    weights[-5] ^= 0xFF
    (copied / "weights.safetensors").write_bytes(bytes(weights))
    with pytest.raises(CheckpointError, match=r"weights.safetensors does not match the sha256"):
        autodeploy(str(copied))


def test_weights_tampered_so_the_engine_fails_are_still_reported_as_tampered(saved, tmp_path):
    # The digest is computed while the engine is built on the tensors; NaNs everywhere fail that build
    # (its warm-up checks the logits), and the error says what is wrong: the file, not the model.
    copied = edited_copy(saved, tmp_path)
    weights = bytearray((copied / "weights.safetensors").read_bytes())
    header = 8 + int.from_bytes(weights[:8], "little")
    weights[header:] = b"\xff" * (len(weights) - header)
    (copied / "weights.safetensors").write_bytes(bytes(weights))
    with pytest.raises(CheckpointError, match=r"weights.safetensors does not match the sha256"):
        autodeploy(str(copied))


def test_a_file_over_one_chunk_is_digested_chunk_by_chunk_and_any_changed_byte_shows(tmp_path, monkeypatch):
    # 64 MiB chunks in a deployment; 1 KiB ones here: 2.5 chunks, hashed on the pool, then their digests.
    monkeypatch.setattr(manifest_module, "DIGEST_CHUNK", 1024)
    data = bytearray(torch.randint(0, 256, (2560,), dtype=torch.uint8).numpy().tobytes())
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(data))
    chunks = [hashlib.sha256(data[start:start + 1024]).digest() for start in range(0, len(data), 1024)]
    assert manifest_module.file_digest(path) == hashlib.sha256(b"".join(chunks)).hexdigest()
    for position in (0, 1500, len(data) - 1):  # a byte in each chunk, the short last one included
        changed = bytearray(data)
        changed[position] ^= 0x01
        path.write_bytes(bytes(changed))
        assert manifest_module.file_digest(path) != hashlib.sha256(b"".join(chunks)).hexdigest()
    path.write_bytes(bytes(data[:2048]))  # truncated at a chunk boundary
    assert manifest_module.file_digest(path) != hashlib.sha256(b"".join(chunks)).hexdigest()


def test_a_truncated_graph_archive_is_a_checkpoint_error_even_when_its_sha256_is_updated(saved, tmp_path):
    copied = edited_copy(saved, tmp_path)
    archive = copied / "graph.pt2"
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="sha256"):
        autodeploy(str(copied))
    manifest = json.loads((copied / "manifest.json").read_text())
    manifest["files"]["graph.pt2"] = hashlib.sha256(archive.read_bytes()).hexdigest()
    (copied / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        autodeploy(str(copied))


def test_runtime_settings_change_on_reload_and_graph_settings_are_refused(saved):
    llm = autodeploy(str(saved), max_batch_size=2, set_arguments=["kv_cache.num_blocks=40"])
    assert llm.settings.max_batch_size == 2 and llm.engine.pool.num_blocks == 40
    with pytest.raises(ConfigError, match=r"dtype='bfloat16' \(saved: 'float32'\).*autodeploy build"):
        autodeploy(str(saved), dtype="bfloat16")
    with pytest.raises(ConfigError, match="transforms.fuse_gemms.enabled"):
        autodeploy(str(saved), set_arguments=["transforms.fuse_gemms.enabled=false"])


def test_another_torch_version_rebuilds_from_the_source_with_a_warning(saved, tmp_path, monkeypatch, caplog):
    manifest = json.loads((saved / "manifest.json").read_text())
    copied = edited_copy(saved, tmp_path, versions={**manifest["versions"], "torch": "2.0.0"})

    class Rebuilding(Exception):
        pass

    def rebuild(pipeline, context, *args, **kwargs):
        assert context.settings.model == manifest["source"]["directory"]
        raise Rebuilding

    monkeypatch.setattr("autodeploy.api.build_verified", rebuild)
    with caplog.at_level(logging.WARNING, logger="autodeploy.api"), pytest.raises(Rebuilding):
        autodeploy(str(copied))
    assert "torch 2.0.0 (this process has" in caplog.text and "rebuilding it from its source" in caplog.text


def test_another_torch_version_without_the_source_is_refused(saved, tmp_path):
    manifest = json.loads((saved / "manifest.json").read_text())
    copied = edited_copy(saved, tmp_path, versions={**manifest["versions"], "torch": "2.0.0"},
                         source={"model": "/nonexistent/tiny-llama", "directory": "/nonexistent/tiny-llama", "weights": "checkpoint"})
    with pytest.raises(CheckpointError, match=r"torch 2.0.0 .*not reachable.*autodeploy build /nonexistent/tiny-llama --out"):
        autodeploy(str(copied))


def test_a_token_dispatch_survives_save_and_reload(llama_llm, tmp_path, forbid_building):
    graph = copy.deepcopy(llama_llm.graph)
    backends = {b.name: b for b in candidates("rms_norm")}
    dispatch = token_dispatch("rms_norm", {1: backends["torch"], 8: backends["reference"]}, (0, 1))
    norms = [node for node in graph.graph.nodes if node.target == backends["torch"].op]
    assert norms  # the first layer's input norm (the others are fused with their residual add)
    for node in norms:
        node.target = dispatch
    graph.recompile()
    llm = LLM(dataclasses.replace(llama_llm.deployment, graphs={MODEL: graph}, eos_token_ids=(2,)))
    directory = llm.save(tmp_path / "dispatching")
    forbid_building()
    reloaded = autodeploy(str(directory))
    dispatched = [describe_dispatch(n.target) for n in reloaded.graph.graph.nodes if describe_dispatch(n.target)]
    assert dispatched == [dispatch.by_token_bucket] * len(norms)
    for want, got in zip(llm.logits(SEQUENCES), reloaded.logits(SEQUENCES)):
        assert torch.equal(want, got)


def test_a_reloaded_deployment_saves_again_unchanged(saved, tmp_path):
    again = autodeploy(str(saved)).save(tmp_path / "again")
    for name in ("tuning.json", "serving.json", "settings.yaml", "build_report.json"):
        assert (again / name).read_text() == (saved / name).read_text(), name
    assert (again / "weights.safetensors").read_bytes() == (saved / "weights.safetensors").read_bytes()


def test_a_file_the_manifest_does_not_list_in_the_tokenizer_folder_is_refused(saved, tmp_path):
    copied = edited_copy(saved, tmp_path)
    (copied / "tokenizer" / "tokenization_evil.py").write_text("raise SystemExit")
    with pytest.raises(CheckpointError, match="tokenization_evil.py was not saved with the deployment"):
        autodeploy(str(copied))


@pytest.mark.parametrize("read_bytes", [1024, 300])
def test_the_weights_are_read_into_aligned_tensors_with_the_files_digest(tmp_path, monkeypatch, read_bytes):
    # 1 KiB chunks: tensors start and end inside chunks and span several; the digest is file_digest's.
    # Reads of 300 bytes: a chunk's pieces straddle the reads too.
    monkeypatch.setattr(manifest_module, "DIGEST_CHUNK", 1024)
    monkeypatch.setattr(weights_file, "_READ_BYTES", read_bytes)
    gen = torch.Generator().manual_seed(0)
    saved = {"a": torch.randn(700, generator=gen), "b": torch.randn(3, 333, generator=gen).to(torch.bfloat16),
             "c": torch.randint(-100, 100, (1500,), dtype=torch.int8, generator=gen), "d": torch.tensor(2.5),
             "e": torch.randn(5, generator=gen).to(torch.float8_e4m3fn)}
    path = tmp_path / "weights.safetensors"
    save_tensors(saved, path)
    tensors, digest = load_tensors(path, {key: "cpu" for key in saved})
    assert digest == manifest_module.file_digest(path)
    for key, tensor in saved.items():
        assert tensors[key].dtype == tensor.dtype and torch.equal(tensors[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
        assert tensors[key].data_ptr() % 64 == 0


def test_the_graph_loads_with_remembered_fake_tensors_and_torchs_deserializer_is_left_as_it_was(saved):
    from torch._export.serde import serialize

    from autodeploy.artifact.graph_archive import load_program

    original = serialize.GraphModuleDeserializer.deserialize_tensor_meta
    program = load_program((saved / "graph.pt2").read_bytes(), "graph.pt2")
    assert serialize.GraphModuleDeserializer.deserialize_tensor_meta is original
    values = [node.meta["val"] for node in program.graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)]
    assert len({id(value) for value in values}) < len(values)  # nodes alike share one fake tensor
