"""A deployment's graph archive is checked before ``torch.export.load`` reads it: nothing pickled, no call of
anything but registered aten/autodeploy ops, no symbolic size that is not plain arithmetic."""

from __future__ import annotations

import io
import json
import pickle
import zipfile

import pytest

from autodeploy.artifact.archive_safety import check_graph_archive
from autodeploy.errors import CheckpointError


@pytest.fixture(scope="module")
def archive(saved) -> bytes:
    return (saved / "graph.pt2").read_bytes()


def rewritten(archive: bytes, record: str, edit) -> bytes:
    """The archive with ``edit(contents) -> contents`` applied to the record ending in ``record`` (None adds it)."""
    source, target = zipfile.ZipFile(io.BytesIO(archive)), io.BytesIO()
    with zipfile.ZipFile(target, "w") as out:
        names = source.namelist()
        for name in names:
            out.writestr(name, edit(source.read(name)) if name.endswith(record) else source.read(name))
        if not any(name.endswith(record) for name in names):
            out.writestr(f"{names[0].split('/')[0]}/{record}", edit(b""))
    return target.getvalue()


def edit_program(edit):
    def apply(contents: bytes) -> bytes:
        program = json.loads(contents)
        edit(program)
        return json.dumps(program).encode()

    return apply


def first_node(program, op: str) -> dict:
    return next(n for n in program["graph_module"]["graph"]["nodes"] if op in n["target"])


def test_the_saved_archive_passes(archive):
    check_graph_archive(archive, "graph.pt2")


@pytest.mark.parametrize("record, edit, message", [
    ("data/sample_inputs/model.pt", lambda _: pickle.dumps(("x",)), "pickled sample inputs"),
    ("data/weights/model_weights_config.json",
     lambda _: json.dumps({"config": {"w": {"path_name": "weight_0", "use_pickle": True}}}).encode(), "lists tensors"),
    ("data/weights/weight_0", lambda _: pickle.dumps("payload"), "never has"),
    ("models/model.json", edit_program(lambda p: first_node(p, "linear").update(target="torch.os.system")), "torch.os.system"),
    ("models/model.json", edit_program(lambda p: first_node(p, "linear").update(target="torch.ops.autodeploy.not_an_op.default")),
     "not registered in this process"),
    ("models/model.json", edit_program(lambda p: p["graph_module"]["graph"]["sym_int_values"].update(
        {"x": {"as_expr": {"expr_str": "__import__('os').system('true')", "hint": None}}})), "not plain arithmetic"),
])
def test_an_archive_holding_what_a_deployment_never_holds_is_refused(archive, record, edit, message):
    with pytest.raises(CheckpointError, match=message):
        check_graph_archive(rewritten(archive, record, edit), "graph.pt2")


def test_a_corrupted_record_fails_its_crc(archive):
    data = bytearray(archive)
    offset = data.index(b'"nodes"')  # inside the stored (uncompressed) program JSON
    data[offset + 1] ^= 0x01
    with pytest.raises(CheckpointError, match="CRC"):
        check_graph_archive(bytes(data), "graph.pt2")
