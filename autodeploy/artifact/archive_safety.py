"""What a deployment's graph archive may hold — checked before ``torch.export.load`` reads any of it.

``torch.export.load`` trusts its input: it unpickles pickled weights and constants, unpickles the sample
inputs (falling back to ``weights_only=False``), resolves a node's target by attribute lookup from
``torch``, ``operator`` or ``math`` (``torch.os.system`` resolves), and parses symbolic sizes with
``sympy.sympify``, which evaluates Python. A deployment's archive needs none of that, so it may hold only:

- torch.export's bookkeeping records and the graph's JSON; no weights, constants or sample inputs (the
  tensors live in ``weights.safetensors``);
- nodes whose targets are registered ``aten`` or ``autodeploy`` ops, or a few pure Python operators;
- symbolic sizes written with sympy's arithmetic constructors, integers and symbol names.

``check_graph_archive(data)`` raises a ``CheckpointError`` naming anything else, and one for an archive that
is truncated or corrupted (zip CRCs).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from typing import Any

import torch
from torch.utils._sympy import functions as size_functions

from autodeploy.errors import CheckpointError

OP_NAMESPACES = ("aten", "autodeploy")
PYTHON_TARGETS = frozenset({
    *(f"_operator.{name}" for name in ("getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow",
                                       "eq", "ne", "lt", "le", "gt", "ge")),
    *(f"torch.sym_{name}" for name in ("max", "min", "not", "float", "int", "ite", "sqrt")),
})
# The names sympy's printer and torch's size functions use (torch.utils._sympy.functions, as the loader maps them).
EXPRESSION_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Eq", "Ne", "Lt", "Le",
    "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality", "Unequality",
    "And", "Or", "Not", "true", "false", "True", "False", "oo", "One", "Zero", "NegativeOne",
    "positive", "negative", "integer", "nonnegative", "nonpositive", "real", "finite", "infinite",
    *getattr(size_functions, "__all__", ()),
})
_EXPRESSION_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<symbol>'[a-z]+[0-9]*')|(?P<number>\d+(?:\.\d+)?)|(?P<punct>[-(),=/*+]))")
_RECORDS = re.compile(r"(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id|models/\w+\.json"
                      r"|data/weights/\w+_weights_config\.json|data/constants/\w+_constants_config\.json|data/sample_inputs/\w+\.pt)")
_EMPTY_PAYLOADS = {"config": {}}


def check_graph_archive(data: bytes, name: str) -> None:
    """Raise ``CheckpointError`` unless ``data`` is an intact archive holding only a graph we may load."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError) as error:
        raise CheckpointError(f"{name} is not an intact torch.export archive ({error}): it was truncated or corrupted; "
                              f"save the deployment again") from error
    if damaged is not None:
        raise CheckpointError(f"{name}: record {damaged} fails its CRC check (corrupted); save the deployment again")
    records = _records(archive, name)
    for record, contents in records.items():
        if record.startswith(("data/weights/", "data/constants/")) and _json(contents, f"{name}:{record}") != _EMPTY_PAYLOADS:
            raise CheckpointError(f"{name}:{record} lists tensors or objects, but a deployment keeps its tensors in "
                                  f"weights.safetensors; this archive was not written by LLM.save and is not loaded")
        if record.startswith("data/sample_inputs/") and contents:
            raise CheckpointError(f"{name}:{record} holds pickled sample inputs, which are never loaded; "
                                  f"this archive was not written by LLM.save")
    models = [record for record in records if record.startswith("models/")]
    if len(models) != 1:
        raise CheckpointError(f"{name} holds {len(models)} programs, not one; save the deployment again")
    program = _json(records[models[0]], f"{name}:{models[0]}")
    for node in _nodes(program):
        _check_target(node.get("target"), name)
    for expression in _expressions(program):
        _check_expression(expression, name)


def _records(archive: zipfile.ZipFile, name: str) -> dict[str, bytes]:
    """Each record's contents by its name under the archive's one top-level folder."""
    records = {}
    for info in archive.infolist():
        _, slash, record = info.filename.partition("/")
        if not slash or not _RECORDS.fullmatch(record):
            raise CheckpointError(f"{name} holds {info.filename!r}, which a deployment's graph archive never has; "
                                  f"it was not written by LLM.save and is not loaded")
        records[record] = archive.read(info)
    return records


def _json(contents: bytes, where: str) -> Any:
    try:
        return json.loads(contents)
    except ValueError as error:
        raise CheckpointError(f"{where} is not valid JSON ({error}); save the deployment again") from error


def _nodes(value: Any):
    """Every serialized graph node (a mapping with a target, inputs and outputs), nested graphs included."""
    if isinstance(value, dict):
        if {"target", "inputs", "outputs"} <= value.keys():
            yield value
        for item in value.values():
            yield from _nodes(item)
    elif isinstance(value, list):
        for item in value:
            yield from _nodes(item)


def _expressions(value: Any):
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "expr_str":
                yield item
            else:
                yield from _expressions(item)
    elif isinstance(value, list):
        for item in value:
            yield from _expressions(item)


def _check_target(target: Any, name: str) -> None:
    if target in PYTHON_TARGETS:
        return
    parts = target.split(".") if isinstance(target, str) else []
    if len(parts) != 5 or parts[:2] != ["torch", "ops"] or parts[2] not in OP_NAMESPACES or not all(p.isidentifier() for p in parts):
        raise CheckpointError(f"{name}: a node calls {target!r}; a deployment's graph calls only registered "
                              f"{' and '.join(OP_NAMESPACES)} ops, so this archive is not loaded")
    namespace, op, overload = parts[2:]
    if not hasattr(getattr(torch.ops, namespace), op) or not hasattr(getattr(getattr(torch.ops, namespace), op), overload):
        raise CheckpointError(
            f"{name}: the graph calls torch.ops.{namespace}.{op}.{overload}, which is not registered in this process; "
            f"import the module that registers it (autodeploy.register_op / register_backend) before loading"
        )


def _check_expression(expression: Any, name: str) -> None:
    text = expression if isinstance(expression, str) else ""
    position = 0
    while position < len(text):
        token = _EXPRESSION_TOKEN.match(text, position)
        if token is None or (token.group("name") and token.group("name") not in EXPRESSION_NAMES):
            break
        position = token.end()
    if not text or position < len(text.rstrip()):
        raise CheckpointError(f"{name}: symbolic size {str(expression)[:80]!r} is not plain arithmetic over sizes; "
                              f"this archive is not loaded")
