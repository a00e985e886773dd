"""The served graph as a ``torch.export`` archive that holds no tensor: its tensors are inputs of the program.

``export_served_graph`` re-exports the pipeline's final graph over a representative step
(``example_step.py``). Every tensor the graph reads as an attribute (weights, buffers, constants) becomes a
leading input of the program; the serving inputs follow with their own names and dynamic dims. Our ops are
recorded by name (``torch.ops.autodeploy.linear_torch``), so the archive needs nothing but their
registration to load. ``load_program`` checks the archive (``archive_safety.py``) and loads it;
``served_graph`` turns the tensor inputs back into attributes: the graph the build produced, with the serving signature's inputs
in order, returning what it returned.

Kernel choices are already in the graph: ``select`` retargeted each node to a backend op. A node that
dispatches by token count (the autotuner's winners differ between buckets) is saved as a call of one of its
backends, and its table is returned beside the archive (``SavedGraph.dispatches``, kept in tuning.json);
loading puts the dispatch back on that node, and each node's recorded choice (kernel and why) back in its meta.

    saved = export_served_graph(llm.graph, llm.graph_inputs, kv_caches, block_size=16, device=torch.device("cpu"))
    program = load_program(saved.archive, "graph.pt2")
    graph = served_graph(program, "graph.pt2", saved.tensors, llm.graph_inputs, saved.dispatches, saved.kernels)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import operator
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autodeploy.autotuner import describe_dispatch, dispatch_from_description
from autodeploy.custom_ops.serving_signature import KVCacheSpec
from autodeploy.errors import CheckpointError, ExportError, error_summary
from autodeploy.runtime.step_inputs import declared_side_inputs

from .archive_safety import check_graph_archive
from .example_step import example_step

_SOURCE = "autodeploy_source_node"  # the custom-meta key that ties an exported node to the node it came from
# Export adds a dtype/device assertion after every .to(); the build's cleanup removed those its own export
# added, and the graph's dtypes are fixed by the serving signature, so the saved graph leaves them out.
_ASSERTIONS = (torch.ops.aten._assert_tensor_metadata.default,)
# Meta only the build reads (module paths for verification and select's per-module preferences) or nothing
# does: the archive is smaller and loads faster without it (a third of the program's JSON is module paths).
_DROPPED_META = ("stack_trace", "from_node", "source_fn_stack", "torch_fn", "nn_module_stack")


@dataclass(frozen=True)
class KernelChoice:
    """What select recorded on a node (``node.meta["autodeploy_kernel"]``: its kernel and why), as reloaded."""

    backend: str
    why: str


@dataclass
class SavedGraph:
    """``archive``: the ``torch.export.save`` bytes. ``tensors``: the program's leading inputs, name → tensor.
    ``dispatches`` / ``kernels``: per node of the archive, its token dispatch and the kernel select chose (why)."""

    archive: bytes
    tensors: dict[str, torch.Tensor]
    dispatches: dict[str, dict[str, Any]]
    kernels: dict[str, dict[str, str]]


def _tensors_as_inputs(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, dict[str, torch.Tensor]]:
    """A copy of the graph whose attribute reads are leading placeholders, each node tagged with its source name."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    tensors: dict[str, torch.Tensor] = {}
    by_target: dict[str, fx.Node] = {}
    for node in graph_module.graph.nodes:
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(node.target)(graph_module)
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"graph attribute {node.target} is a {type(value).__name__}, not a tensor; such a graph cannot be saved")
        if node.target not in by_target:
            by_target[node.target] = placeholder = graph.placeholder(node.name)
            placeholder.meta = dict(node.meta)
            tensors[placeholder.name] = value
        env[node] = by_target[node.target]
    for node in graph_module.graph.nodes:
        if node.op == "call_module" and node.target == "_guards_fn":  # export's input check (a vision graph keeps it)
            continue
        if node.op != "get_attr":
            env[node] = graph.node_copy(node, env.__getitem__)
            env[node].meta["custom"] = {**node.meta.get("custom", {}), _SOURCE: node.name}
    return fx.GraphModule(nn.Module(), graph), tensors


class _Interpreter(fx.Interpreter):
    """Runs the graph node by node, so export copies each node's meta (our source tags) to what it records;
    a token dispatch runs as one of its backends (the table itself is saved beside the archive)."""

    def call_function(self, target, args, kwargs):
        if describe_dispatch(target) is not None:
            target = target.backends[0].op
        return super().call_function(target, args, kwargs)


def _exportable(graph_module: fx.GraphModule) -> nn.Module:
    """A module whose ``forward`` interprets ``graph_module`` and is named by its placeholders, so the
    exported program's inputs keep the serving signature's names."""
    module = nn.Module()
    module.graph_module = graph_module

    def forward(*args):
        return _Interpreter(graph_module).run(*args)

    names = [node.name for node in graph_module.graph.nodes if node.op == "placeholder"]
    forward.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    module.forward = forward
    return module


def export_served_graph(
    graph_module: fx.GraphModule, graph_inputs: Sequence[str], kv_caches: Sequence[KVCacheSpec], block_size: int,
    device: torch.device, cross_kv_caches: Sequence[KVCacheSpec] = (),
) -> SavedGraph:
    """Export the served graph with its tensors as inputs and save it to bytes (``torch.export`` format)."""
    side_inputs = declared_side_inputs(graph_module, graph_inputs).values()
    example = example_step(graph_inputs, kv_caches, block_size, device, side_inputs, cross_kv_caches)
    return export_graph(graph_module, *example, "served graph")


def export_vision_graph(graph_module: fx.GraphModule, device: torch.device) -> SavedGraph:
    """Export a vision-language deployment's vision graph (``pixel_values`` in, the image count dynamic) likewise."""
    pixels = next(n for n in graph_module.graph.nodes if n.op == "placeholder").meta["val"]
    example = torch.zeros((3, *(int(size) for size in pixels.shape[1:])), dtype=pixels.dtype, device=device)
    return export_graph(graph_module, [example], [{0: torch.export.Dim("images")}], "vision graph")


def export_encoder_graph(graph_module: fx.GraphModule, device: torch.device) -> SavedGraph:
    """Export an encoder–decoder's encoder graph (``input_ids`` in, the request count and their length dynamic) likewise."""
    input_ids = torch.zeros((2, 5), dtype=torch.long, device=device)
    return export_graph(graph_module, [input_ids], [{0: torch.export.Dim("requests"), 1: torch.export.Dim("encoder_tokens")}],
                        "encoder graph")


def export_embed_graph(graph_module: fx.GraphModule, device: torch.device) -> SavedGraph:
    """Export an embedding model's ``"embed"`` graph (packed texts: ``input_ids``, ``position_ids``, ``token_type_ids``
    ``[1, T]`` and ``seq_start`` ``[N + 1]``, T and N dynamic) likewise."""
    tokens, starts = torch.export.Dim.DYNAMIC, torch.export.Dim.DYNAMIC
    # Three tensors, not one three times: export would take one input as the other where they are the same object.
    input_ids, token_type_ids = (torch.zeros((1, 5), dtype=torch.long, device=device) for _ in range(2))
    seq_start = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    return export_graph(graph_module, [input_ids, torch.arange(5, device=device)[None], token_type_ids, seq_start],
                        [{1: tokens}, {1: tokens}, {1: tokens}, {0: starts}], "embed graph")


def export_graph(graph_module: fx.GraphModule, inputs: Sequence[torch.Tensor], dims: Sequence, what: str) -> SavedGraph:
    """Export ``graph_module`` over example ``inputs`` with their dynamic ``dims``, its tensors as leading inputs, and
    save it to bytes (``torch.export`` format)."""
    lifted, tensors = _tensors_as_inputs(graph_module)
    try:
        with torch.no_grad(), fx_traceback.preserve_node_meta():
            program = torch.export.export(_exportable(lifted), (*tensors.values(), *inputs),
                                          dynamic_shapes=(*[None] * len(tensors), *dims), strict=False)
    except Exception as error:  # torch.export raises many unrelated types; all mean "could not capture"
        raise ExportError(f"the {what} could not be exported for saving: {type(error).__name__}: {error_summary(error)}") from error
    sources = {node.name: node for node in graph_module.graph.nodes}
    dispatches: dict[str, dict[str, Any]] = {}
    kernels: dict[str, dict[str, str]] = {}
    for node in list(program.graph.nodes):
        if node.target in _ASSERTIONS and not node.users:
            program.graph.erase_node(node)
            continue
        for key in _DROPPED_META:
            node.meta.pop(key, None)
        custom = node.meta.get("custom") or {}
        source = sources.get(custom.pop(_SOURCE, None))
        if not custom:
            node.meta.pop("custom", None)
        if source is None or node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if describe_dispatch(source.target) is not None:
            dispatches[node.name] = describe_dispatch(source.target)
        choice = source.meta.get("autodeploy_kernel")
        if choice is not None:
            kernels[node.name] = {"op": str(node.target).removesuffix(".default"), "kernel": choice.backend, "why": choice.why}
    program.graph_module.recompile()
    program.example_inputs = None  # torch.export would pickle them; the archive holds no tensor
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return SavedGraph(buffer.getvalue(), tensors, dispatches, kernels)


def _remembering(module: types.ModuleType, name: str, key) -> types.ModuleType:
    """A copy of ``module`` whose function ``name`` remembers its answers by ``key(*args, **kwargs)`` (``None``:
    asks the function)."""
    original, answers = getattr(module, name), {}

    def remembered(*args, **kwargs):
        found = key(*args, **kwargs)
        if found is None:
            return original(*args, **kwargs)
        if found not in answers:
            answers[found] = original(*args, **kwargs)
        return answers[found]

    copy = types.ModuleType(module.__name__)
    copy.__dict__.update(vars(module))
    setattr(copy, name, remembered)
    return copy


@contextlib.contextmanager
def _deserializer_shortcuts():
    """While it runs, torch's deserializer sees a ``typing.get_type_hints``, a ``dataclasses.fields`` and a
    ``sympy.sympify`` that remember their answers. It asks the first two again for every object it builds
    (16,695 and 26,459 times for a 32-layer graph), always about the same few schema classes, and parses
    the same few shape expressions (``s0``, ``4096*s0``) again for every tensor: with all three remembered
    a small 32-layer Llama's graph loads in 0.93 s on a CPU core, against 1.43 s without (type hints alone
    had saved 30%). An expression's parse depends only on its text within one load: its symbols are the
    ones the deserializer recorded when it first met them, and it records each once. The fake tensors of
    node values are remembered too (:func:`_remembered_tensor_meta`)."""
    from torch._export.serde import serialize

    shortcuts = {  # the module torch's deserializer imported → its remembering copy
        "typing": (typing, lambda: _remembering(typing, "get_type_hints", lambda obj, globalns=None, localns=None,
                                                include_extras=False: (obj, id(globalns), id(localns), include_extras))),
        "sympy": (sympy, lambda: _remembering(sympy, "sympify",
                                              lambda a, *args, **kwargs: a if isinstance(a, str) and not args else None)),
        "dataclasses": (dataclasses, lambda: _remembering(dataclasses, "fields", lambda a: a if isinstance(a, type) else None)),
    }
    # Each only where this torch's deserializer uses the module we know (another torch keeps its own).
    patched = {name: module for name, (module, _) in shortcuts.items() if getattr(serialize, name, None) is module}
    for name in patched:
        setattr(serialize, name, shortcuts[name][1]())
    deserializer = getattr(serialize, "GraphModuleDeserializer", None)
    tensor_meta = getattr(deserializer, "deserialize_tensor_meta", None)
    if tensor_meta is not None:
        deserializer.deserialize_tensor_meta = _remembered_tensor_meta(tensor_meta)
    try:
        yield
    finally:
        for name, module in patched.items():
            setattr(serialize, name, module)
        if tensor_meta is not None:
            deserializer.deserialize_tensor_meta = tensor_meta


def _remembered_tensor_meta(original):
    """``GraphModuleDeserializer.deserialize_tensor_meta`` remembering, per deserializer, the fake tensor it
    made for each tensor description: every node's value is a fake tensor made in the fake mode (1.4 ms
    each on a CPU core, half of a load), and most of a 32-layer graph's nodes repeat a few layers' shapes.
    Nodes alike share one fake tensor; their values are only read (shapes, strides, dtypes)."""

    def remembered(self, meta):
        answers = self.__dict__.setdefault("_autodeploy_tensor_metas", {})
        key = repr(meta)
        if key not in answers:
            answers[key] = original(self, meta)
        return answers[key]

    return remembered


def load_program(archive: bytes, name: str) -> torch.export.ExportedProgram:
    """The program in an archive ``export_served_graph`` wrote, once ``archive_safety`` has passed it."""
    check_graph_archive(archive, name)
    try:
        with _deserializer_shortcuts():
            return torch.export.load(io.BytesIO(archive))
    except Exception as error:  # the loader's errors are of many types; each means this archive cannot serve
        raise CheckpointError(f"{name} could not be loaded as a torch.export program: {type(error).__name__}: "
                              f"{error_summary(error)}; save the deployment again") from error


def served_graph(
    program: torch.export.ExportedProgram, name: str, tensors: Mapping[str, torch.Tensor], graph_inputs: Sequence[str],
    dispatches: Mapping[str, dict[str, Any]], kernels: Mapping[str, dict[str, str]],
) -> fx.GraphModule:
    """The executable graph: ``program`` with ``tensors`` as attributes, and its nodes' dispatches and kernel
    choices (``SavedGraph``) put back."""
    signature = program.graph_signature
    expected = [*tensors, *graph_inputs]
    if (any(spec.kind != InputKind.USER_INPUT for spec in signature.input_specs)
            or any(spec.kind != OutputKind.USER_OUTPUT for spec in signature.output_specs)
            or list(signature.user_inputs) != expected):
        raise CheckpointError(f"{name} takes inputs {list(signature.user_inputs)}, but its deployment declares {expected}; "
                              f"the files do not belong together: save the deployment again")
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in tensors:
            root.register_buffer(node.name, tensors[node.name])
            env[node] = graph.get_attr(node.name)
            env[node].meta = dict(node.meta)
        elif node.op == "output":
            flat = fx.node.map_arg(node.args[0], env.__getitem__)
            graph.output(pytree.tree_unflatten(list(flat), program.call_spec.out_spec))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    module = fx.GraphModule(root, graph)
    nodes = {node.name: node for node in module.graph.nodes}
    for node_name, description in dispatches.items():
        if node_name not in nodes:
            raise CheckpointError(f"tuning.json dispatches node {node_name}, which {name} does not have; save the deployment again")
        try:
            nodes[node_name].target = dispatch_from_description(description)
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"node {node_name}'s token dispatch cannot be rebuilt: {error}; register the backends "
                                  f"it names (autodeploy.register_backend) before loading") from error
    for node_name, choice in kernels.items():
        if node_name in nodes:
            nodes[node_name].meta["autodeploy_kernel"] = KernelChoice(choice["kernel"], choice["why"])
    module.recompile()
    return module
