"""A saved deployment that lost a file, or whose weights header was edited with its digest fixed up, is a
``CheckpointError`` naming the file or the tensor (autodeploy/artifact/layout.py, load.py), not a hint to point at
a Hugging Face checkpoint or a raw error from the first op that meets a wrong tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autodeploy import autodeploy
from autodeploy.artifact.manifest import file_digest
from autodeploy.errors import CheckpointError, ConfigError


def copy_of(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "copy"))


@pytest.mark.parametrize("missing", ["graph.pt2", "manifest.json", "serving.json", "weights.safetensors"])
def test_a_missing_file_is_named_and_the_save_called_incomplete(saved, tmp_path, missing):
    copied = copy_of(saved, tmp_path)
    (copied / missing).unlink()
    with pytest.raises(CheckpointError, match=rf"{missing} is missing: the saved deployment in \S+ is incomplete .*save the "
                                              r"deployment again"):
        autodeploy(str(copied))


def test_a_folder_without_deployment_files_or_config_is_still_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing to serve")
    with pytest.raises(Exception, match="has no config.json; point at a Hugging Face checkpoint folder"):
        autodeploy(str(tmp_path))


def test_save_replaces_only_a_folder_with_a_deployments_manifest_and_graph(saved, llama_llm, tmp_path):
    # Reading a folder as a damaged deployment must not make save delete what another tool left there.
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a saved deployment"):
        llama_llm.save(folder)
    assert (folder / "manifest.json").read_text() == "{}"


def edit_weights_header(directory: Path, edit) -> str:
    """Rewrite the weights file's header in place (same length), fix the manifest's digest; returns the key edited."""
    path = directory / "weights.safetensors"
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    key = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32" and len(v["shape"]) == 2
               and v["shape"][0] != v["shape"][1])
    edit(header[key])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    data[8:8 + length] = text.ljust(length)
    path.write_bytes(bytes(data))
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"]["weights.safetensors"] = file_digest(path)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return key


def test_a_tensor_whose_dtype_was_edited_is_named(saved, tmp_path):
    copied = copy_of(saved, tmp_path)
    key = edit_weights_header(copied, lambda entry: entry.update(dtype="I32"))
    with pytest.raises(CheckpointError, match=rf"weights.safetensors holds {key} as int32 \[\d+, \d+\], but the graph takes "
                                              r"float32 \[\d+, \d+\]; the file was edited since it was saved"):
        autodeploy(str(copied))


def test_a_tensor_whose_shape_was_edited_is_named(saved, tmp_path):
    copied = copy_of(saved, tmp_path)
    key = edit_weights_header(copied, lambda entry: entry.update(shape=entry["shape"][::-1]))
    with pytest.raises(CheckpointError, match=rf"weights.safetensors holds {key} as float32 \[(\d+), (\d+)\], but the graph "
                                              r"takes float32 \[\2, \1\]"):
        autodeploy(str(copied))
