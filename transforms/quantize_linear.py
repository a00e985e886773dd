"""``quantize_linear`` (stage ``quantize``): projections become quantized ops, scheme by scheme per layer.

Reads the ``quantize`` settings: ``default`` (the scheme of every projection no rule names) and
``layers`` (globs over module paths, first match wins; ``none`` keeps a layer in the model's dtype).
A module path is the Hugging Face module's name, matched with or without the base model's prefix:
``model.layers.0.mlp.gate_proj`` is also ``layers.0.mlp.gate_proj``, so ``"*.mlp.*"`` and ``"layers.0.*"``
both name it; the LM head is ``lm_head``.

```yaml
quantize:
  default: int8_wo
  layers: {"lm_head": none, "*.mlp.*": int4_wo}
```

A checkpoint quantized by another tool (``context.model_factory.prequantized``: compressed-tensors, AWQ,
GPTQ, ModelOpt) gives each layer its scheme instead, and ``quantize`` settings beside it are a
``ConfigError``; ``load_weights`` then converts the checkpoint's tensors rather than quantizing.

Every canonical ``linear`` whose weight the graph reads straight from the module becomes the scheme's op
(``custom_ops/quantized_linear.py``); a ``gated_mlp`` or ``mlp`` with a quantized projection is split
into its projections (each quantized by its own rule, or a plain ``linear``) and its activation (for a
gated MLP the canonical ``gated_activation``, which keeps a fused kernel). The
stage runs before ``load_weights``, on the meta graph: the float weight leaves the module, the scheme's
tensors (meta for now) take its place, and ``context.quantized_weights`` records which
checkpoint weight each is computed from, so ``load_weights`` quantizes every weight as it streams in
(no float copy of the model is ever whole). When a scheme calibrates (or the KV cache is fp8), the graph
as this stage found it is kept in ``context.calibration_graph`` (a copy over the same meta
parameters): calibration loads the float weights into it and runs it first (``transforms/calibration.py``). A weight read by any other node (tied to the embedding)
stays in the model's dtype, as do MoE routers. MoE experts take ``quantize.experts`` (``int8_wo`` or
``int4_wo``, expert by expert: ``custom_ops/quantized_moe.py``), apart from the dense layers' rules; under
expert parallelism (the shard stage ran first) a ``moe_expert_parallel`` node's experts are this rank's share,
and its record's ``shape`` that share's (``load_weights`` quantizes the share it slices from the checkpoint).
``quantize.embedding: int8`` stores the token embedding table as ``int8_wo`` stores a weight (a scale per
row) and looks rows up with ``embedding_int8`` (``custom_ops/quantized_embedding.py``). A table tied to
the LM head is stored once for both when the head's scheme is ``int8_wo`` (the same layout); under any
other head scheme both stay in the model's dtype.

It rewrites the ``"model"`` graph and an encoder–decoder's ``"encoder"`` graph alike (the encoder's projections, and
every decoder layer's cross-attention keys and values, which the encoder computes); the encoder's lookup of the table
its decoder's tied LM head reads follows that head's scheme, so both graphs store the table alike. Calibrated schemes
and an fp8 KV cache are refused for an encoder–decoder: calibration runs one graph on text windows.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx, nn
from torch.fx import GraphModule

from autodeploy.custom_ops.activations import ATEN_ACTIVATIONS
from autodeploy.custom_ops.quantized_linear import QuantScheme, expert_scheme_names, parse_plan, quantize_weight, scheme_names
from autodeploy.deployment import ENCODER, MODEL
from autodeploy.errors import ConfigError
from autodeploy.transforms.cleanup_transposes import permutation
from autodeploy.transforms.shape_propagation import infer_values
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)

LINEAR = torch.ops.autodeploy.linear.default
GATED_MLP = torch.ops.autodeploy.gated_mlp.default
GATED_ACTIVATION = torch.ops.autodeploy.gated_activation.default
SMOOTHQUANT = torch.ops.autodeploy.int8_w8a8_linear.default
MLP = torch.ops.autodeploy.mlp.default
MOE = torch.ops.autodeploy.moe.default
MOE_EXPERT_PARALLEL = torch.ops.autodeploy.moe_expert_parallel.default
EMBEDDING = torch.ops.aten.embedding.default
EMBEDDING_INT8 = torch.ops.autodeploy.embedding_int8.default
EMBEDDING_SCHEMES = ("int8",)
NONE = "none"
ATTENTION = torch.ops.autodeploy.attention.default
# Ops that keep a tensor's values and their row-major order (reshapes, copies): with transposes that cancel
# (HF's pairs, before the cache stage's refold_transposes), a chain between attention and a projection.
RESHAPES = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
            torch.ops.aten.flatten.using_ints, torch.ops.aten.unflatten.int, torch.ops.aten.contiguous.default,
            torch.ops.aten.clone.default}
COPIES = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default}
_WRAPPER = "model."  # the exported graph holds the HF model as attribute ``model``
# stored tensor → attribute (a role of another scheme keeps its own name)
_ROLES = {"qweight": "qweight", "scale": "weight_scale", "zero": "weight_zero", "smooth": "input_smooth", "input_scale": "input_scale"}


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight the stage quantized: ``source`` (its graph name before, e.g. ``model.model.layers.0.mlp.up_proj.weight``),
    its float ``shape``, the ``scheme`` and the graph names of the tensors the scheme stores, by role."""

    source: str
    path: str
    shape: tuple[int, ...]
    scheme: QuantScheme
    targets: dict[str, str]


def _option(settings, key: str, allowed: tuple[str, ...], what_takes: str) -> str | None:
    """``quantize.<key>`` when it is one of ``allowed``, None for ``none``, else a ``ConfigError``."""
    name = getattr(settings, key)
    if name == NONE:
        return None
    if name not in allowed:
        raise ConfigError(f"quantize.{key}: {what_takes} {', '.join(allowed)} or none; got {name!r}")
    return name


def uncalibrated_random_weights(calibrated: list[str]) -> ConfigError:
    """The error for calibrated schemes (``calibrated``: their names) under ``weights=random``: calibration runs the
    checkpoint's weights."""
    return _uncalibrated(calibrated, "calibrate on the checkpoint's weights; with weights=random")


def _uncalibrated(calibrated: list[str], why: str) -> ConfigError:
    plain = [name for name in scheme_names() if not QuantScheme(name).calibrated]
    return ConfigError(f"{', '.join(sorted(set(calibrated))) or 'calibrated schemes'} {why} use a scheme without calibration: "
                       f"{', '.join(plain)}")


def parse_experts(settings) -> QuantScheme | None:
    """The scheme of MoE experts' weights (``quantize.experts``), or None."""
    name = _option(settings, "experts", expert_scheme_names(), "MoE experts take")
    return None if name is None else QuantScheme(name, group_size=int(settings.int4_group_size))


def quantizes_dense_layers(settings) -> bool:
    """Whether the quantize settings give any dense projection, or the embedding table, a scheme
    (``quantize.experts`` aside)."""
    quantize = settings.quantize
    return quantize.default != "none" or quantize.embedding != "none" or any(v != "none" for v in dict(quantize.layers).values())


def parse_embedding(settings) -> QuantScheme | None:
    """How the token embedding table is stored (``quantize.embedding``): ``int8`` is ``int8_wo``'s layout."""
    return None if _option(settings, "embedding", EMBEDDING_SCHEMES, "the embedding table takes") is None else QuantScheme("int8_wo")


def module_path(weight_target: str) -> str:
    """The Hugging Face module that owns a graph weight: ``model.model.layers.0.mlp.up_proj.weight`` →
    ``model.layers.0.mlp.up_proj``."""
    return weight_target.removeprefix(_WRAPPER).rpartition(".")[0]


def _matches(glob: str, path: str) -> bool:
    return fnmatch.fnmatchcase(path, glob) or ("." in path and fnmatch.fnmatchcase(path.partition(".")[2], glob))


class _Planner:
    """Decides a scheme per weight and remembers which rules matched something."""

    def __init__(self, default: QuantScheme | None, rules: list[tuple[str, QuantScheme | None]]):
        self.default, self.rules, self.used = default, rules, set()

    def scheme_for(self, path: str) -> QuantScheme | None:
        for glob, scheme in self.rules:
            if _matches(glob, path):
                self.used.add(glob)
                return scheme
        return self.default


class _CheckpointPlanner:
    """The schemes a pre-quantized checkpoint's quantization config gives its layers (``models/prequantized.py``)."""

    def __init__(self, found, model: nn.Module):
        self.found, self.model = found, model

    def scheme_for(self, path: str) -> QuantScheme | None:
        try:
            module = self.model.get_submodule(path)
        except AttributeError:
            module = None
        return self.found.scheme_for(path, module)


def _checkpoint_quantization(context: TransformContext):
    """The checkpoint's own quantization, or None; a ``ConfigError`` when the settings ask for another."""
    factory = context.model_factory
    found = factory.prequantized if factory is not None else None
    quantize = context.settings.quantize
    if found is not None and (quantize.default != NONE or dict(quantize.layers) or quantize.experts != NONE):
        raise ConfigError(
            f"{factory.source.name} is already quantized ({found.method}): its layers keep the checkpoint's schemes. "
            f"Remove quantize.default / quantize.layers / quantize.experts, or deploy the float checkpoint to quantize it here"
        )
    return found


class _Rewriter:
    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.graph = gm.graph
        aliases: dict[int, int] = {}
        for _, parameter in gm.named_parameters(remove_duplicate=False):
            aliases[id(parameter)] = aliases.get(id(parameter), 0) + 1
        self.shared = {name for name, p in gm.named_parameters(remove_duplicate=False) if aliases[id(p)] > 1}
        self.records: list[QuantizedWeight] = []

    def own_weight(self, node, dims: int = 2) -> torch.Tensor | None:
        """The ``dims``-D parameter a get_attr node reads, when nothing else reads it (under any name)."""
        if not isinstance(node, fx.Node) or node.op != "get_attr" or len(node.users) != 1 or node.target in self.shared:
            return None
        try:
            tensor = self.gm.get_parameter(node.target)
        except AttributeError:
            return None
        return tensor if tensor.dim() == dims else None

    def quantized_linear(self, x: fx.Node, weight_node: fx.Node, bias: fx.Node | None, scheme: QuantScheme) -> fx.Node:
        """A node of ``scheme``'s op over new (meta) parameters in place of ``weight_node``'s."""
        return self.graph.call_function(scheme.op, (x, *self.quantized_storage(weight_node, scheme), bias))

    def quantized_experts(self, node: fx.Node, scheme: QuantScheme) -> fx.Node:
        """A ``moe`` or ``moe_expert_parallel`` node's quantized counterpart (``custom_ops/quantized_moe.py``), both
        expert weights in ``scheme``."""
        x, router_logits, gate_up, down, *options = node.args
        storage = [*self.quantized_storage(gate_up, scheme), *self.quantized_storage(down, scheme)]
        op = scheme.expert_op(expert_parallel=node.target is MOE_EXPERT_PARALLEL)
        return self.graph.call_function(op, (x, router_logits, *storage, *options), dict(node.kwargs))

    def quantized_storage(self, weight_node: fx.Node, scheme: QuantScheme) -> list[fx.Node]:
        """get_attr nodes of ``scheme``'s tensors (new meta parameters) in place of ``weight_node``'s weight."""
        source = weight_node.target
        weight = self.gm.get_parameter(source)
        columns = weight.shape[-1]
        meta_statistics = {key: torch.empty(columns, device="meta") for key in ("mean_abs", "mean_square", "max_abs")}
        stored = quantize_weight(scheme, weight.to("meta"), meta_statistics)
        owner_path, _, leaf = source.rpartition(".")
        owner = self.gm.get_submodule(owner_path)
        prefix = "" if leaf == "weight" else f"{leaf}_"
        targets, nodes = {}, []
        for role, tensor in stored.items():
            attribute = prefix + _ROLES.get(role, role)
            owner.register_parameter(attribute, nn.Parameter(tensor, requires_grad=False))
            targets[role] = f"{owner_path}.{attribute}"
            nodes.append(self.graph.get_attr(targets[role]))
        delattr(owner, leaf)
        self.records.append(QuantizedWeight(source, module_path(source), tuple(weight.shape), scheme, targets))
        return nodes

    def projection(self, x: fx.Node, weight_node: fx.Node, bias: fx.Node | None, scheme: QuantScheme | None) -> fx.Node:
        if scheme is None:
            return self.graph.call_function(LINEAR, (x, weight_node, bias))
        return self.quantized_linear(x, weight_node, bias, scheme)

    def activation(self, name: str, gate: fx.Node, up: fx.Node | None) -> fx.Node:
        if up is not None:
            return self.graph.call_function(GATED_ACTIVATION, (gate, up, name))
        op, kwargs = ATEN_ACTIVATIONS[name]
        return self.graph.call_function(op, (gate,), kwargs)


def _routes_experts(node: fx.Node, depth: int = 4) -> bool:
    """Whether ``node``'s value reaches a ``moe`` (or ``moe_expert_parallel``) op as its router logits (through
    reshapes and casts). A router stays in the model's dtype: its near-tied logits pick the experts, and it is a
    sliver of the weights."""
    for user in node.users:
        if user.target in (MOE, MOE_EXPERT_PARALLEL) and len(user.args) > 1 and user.args[1] is node:
            return True
        if depth and user.op == "call_function" and len(user.users) == 1 and _routes_experts(user, depth - 1):
            return True
    return False


def _snapshot(module: GraphModule) -> GraphModule:
    """A copy of ``module``'s graph over the same (meta) parameters, which the rewrite below leaves in place for
    it: calibration loads the checkpoint's weights into it and runs it (``transforms/calibration.py``)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    return GraphModule(module, graph)


def _smoothing_groups(module: GraphModule, records: list[QuantizedWeight]) -> list[tuple[str, ...]]:
    """The module paths of the ``smoothquant`` projections that read one input, one tuple per input (q/k/v,
    gate/up): ``load_weights`` gives each group one smoothing, which ``fold_smoothing`` can then move into
    the norm before them."""
    path_of = {r.targets["smooth"]: r.path for r in records if "smooth" in r.targets}
    by_input: dict[fx.Node, list[str]] = {}
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is SMOOTHQUANT and node.args[3].target in path_of:
            by_input.setdefault(node.args[0], []).append(path_of[node.args[3].target])
    return [tuple(paths) for paths in by_input.values() if len(paths) > 1]


def through_views(node, single_reader: bool = True):
    """The node behind a chain of :data:`RESHAPES` and transposes/permutes from ``node`` (each link read only
    by the next, when ``single_reader``), or None when the chain's permutations do not cancel, or a reshape
    sits between permutations that do (the values would reach ``node`` in another order)."""
    order = None  # the permutations composed so far, while they are not the identity
    while isinstance(node, fx.Node) and node.op == "call_function":
        dims = permutation(node)
        if dims is None and node.target not in RESHAPES:
            break
        if single_reader and len(node.users) != 1:
            break
        if dims is not None:  # as cleanup_transposes composes them: node picks dim dims[d] of its input
            order = dims if order is None else [dims[d] for d in order]
            if order == list(range(len(order))):
                order = None
        elif order is not None and node.target not in COPIES:
            return None
        node = node.args[0]
    return node if order is None else None


def attention_heads(x, kinds: tuple = (ATTENTION,)) -> tuple[fx.Node, int, int, int] | None:
    """``(attention node, kv_heads, group, head_dim)`` when ``x`` is the output ``[..., heads, head_dim]`` of an
    attention op of ``kinds`` (canonical ``attention`` by default) flattened by reshapes (a projection's input over
    heads × value dims); else None."""
    attention = through_views(x, single_reader=False)
    if not (isinstance(attention, fx.Node) and attention.op == "call_function" and attention.target in kinds):
        return None
    out, values, inputs = (n.meta.get("val") for n in (attention, attention.args[2], x))
    if not all(isinstance(t, torch.Tensor) for t in (out, values, inputs)) or out.dim() < 2 or values.dim() < 2:
        return None
    heads, head_dim, kv_heads = out.shape[-2], out.shape[-1], values.shape[-2]
    if not all(isinstance(d, int) for d in (heads, head_dim, kv_heads)) or heads % kv_heads or inputs.shape[-1] != heads * head_dim:
        return None
    return attention, kv_heads, heads // kv_heads, head_dim


def _head_smoothing(module: GraphModule, records: list[QuantizedWeight]) -> list[tuple[str, int, int, int]]:
    """The ``smoothquant`` projections over attention's output (o_proj) and its head layout."""
    path_of = {r.targets["smooth"]: r.path for r in records if "smooth" in r.targets}
    found = []
    for node in module.graph.find_nodes(op="call_function", target=SMOOTHQUANT):
        heads = attention_heads(node.args[0])
        if heads is not None and node.args[3].target in path_of:
            found.append((path_of[node.args[3].target], *heads[1:]))
    return found


def _head_elsewhere(context: TransformContext, weight) -> str | None:
    """The module path of the LM head whose weight ``weight`` (a table's get_attr) is too, by the model's ties, or None.
    Where no other node of the graph reads the table, that head is in another graph: an encoder–decoder's encoder looks
    up the table its decoder's head reads."""
    model = context.model_factory.meta_model if context.model_factory is not None else None
    head = model.get_output_embeddings() if model is not None else None
    if head is None or not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    try:
        tied = model.get_parameter(weight.target.removeprefix(_WRAPPER)) is head.weight
    except AttributeError:
        return None
    return next(name for name, module in model.named_modules() if module is head) if tied else None


def _copy_meta(new: fx.Node, old: fx.Node) -> None:
    new.meta.update({k: v for k, v in old.meta.items() if k != "val"})  # values: infer_values


@register_transform("quantize_linear", stage="quantize", roles=(MODEL, ENCODER))
class QuantizeLinear(Transform):
    def validate(self, context: TransformContext) -> None:
        default, rules = parse_plan(context.settings.quantize)
        parse_experts(context.settings.quantize)
        parse_embedding(context.settings.quantize)
        found = _checkpoint_quantization(context)
        if found is not None:
            rules = [(None, scheme) for _, scheme in found.rules]
        all_schemes = [scheme for scheme in [default, *(s for _, s in rules)] if scheme is not None]
        calibrated = [s.name for s in all_schemes if s.calibrated]
        if context.model_factory is not None and context.model_factory.encoder_decoder is not None:
            # Calibration runs one graph on text windows; an encoder–decoder's decoder reads its encoder's keys and values.
            if context.settings.quantize.kv_cache == "fp8":
                raise ConfigError("quantize.kv_cache: fp8 calibrates its scales on the model graph alone, which an "
                                  "encoder-decoder's decoder is not (it reads the encoder's keys and values): keep the KV "
                                  "cache in the model's dtype (quantize.kv_cache: none)")
            if calibrated:
                raise _uncalibrated(calibrated, "calibrate on the model graph alone, which an encoder-decoder's decoder is "
                                                "not (it reads the encoder's keys and values);")
        if calibrated:  # calibration runs in load_weights (transforms/calibration.py)
            calibration = context.settings.quantize.calibration
            if context.settings.weights == "random":
                raise uncalibrated_random_weights(calibrated)
            if calibration.dataset != "builtin" and not Path(calibration.dataset).is_file():
                raise ConfigError(f"quantize.calibration.dataset: {calibration.dataset!r} is neither 'builtin' nor a readable file")
            if calibration.samples < 1 or calibration.seq_len < 1:
                raise ConfigError(f"quantize.calibration needs samples ≥ 1 and seq_len ≥ 1; got {calibration.samples} "
                                  f"and {calibration.seq_len}")
        device = torch.device(context.settings.device)
        for scheme in set(all_schemes):
            problem = scheme.method.check_device(scheme, device)
            if problem:
                runs = [name for name in scheme_names() if QuantScheme(name).method.check_device(QuantScheme(name), device) is None]
                raise ConfigError(f"quantize: {problem}. Use {', '.join(runs)}, which run on this device")

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        default, rules = parse_plan(context.settings.quantize)
        experts = parse_experts(context.settings.quantize)
        embedding = parse_embedding(context.settings.quantize)
        found = _checkpoint_quantization(context)
        # A pre-quantized checkpoint's calibrated schemes are not calibrated again, but its verification twin's are.
        calibrated = any(s is not None and s.calibrated for s in (default, *(s for _, s in rules)))
        if found is not None or calibrated or context.settings.quantize.kv_cache == "fp8":
            context.calibration_graph = _snapshot(module)
        if (found is None and experts is None and embedding is None and default is None
                and all(scheme is None for _, scheme in rules)):
            return TransformResult(notes="off (quantize.default: none, no layer rule names a scheme)")
        planner = _Planner(default, rules) if found is None else _CheckpointPlanner(found, context.model_factory.meta_model)
        rewriter = _Rewriter(module)
        kept, split, tables, tied_head, replaced = [], 0, [], False, set()
        existing = set(module.graph.nodes)
        for node in list(module.graph.nodes):
            if node.op == "call_function" and node.target in (MOE, MOE_EXPERT_PARALLEL) and experts is not None:
                self._quantize_experts(module, rewriter, node, experts, kept)
                continue
            if node in replaced:
                continue
            if node.op == "call_function" and node.target is EMBEDDING and embedding is not None:
                head = self._quantize_embedding(rewriter, node, embedding, planner, _head_elsewhere(context, node.args[0]))
                if head is False:
                    kept.append(node.name)
                    continue
                tables.append(module_path(rewriter.records[-1].source))
                if head is not None:
                    replaced.add(head)
                    tied_head = True
                continue
            if node.op != "call_function" or node.target not in (LINEAR, GATED_MLP, MLP):
                continue
            if node.target is LINEAR:
                weights = {"": node.args[1]}
            elif node.target is GATED_MLP:
                weights = dict(zip(("gate", "up", "down"), node.args[1:4]))
            else:
                weights = {"up": node.args[1], "down": node.args[3]}
            if any(rewriter.own_weight(w) is None for w in weights.values()) or _routes_experts(node):
                kept.append(node.name)
                continue
            schemes = {role: planner.scheme_for(module_path(w.target)) for role, w in weights.items()}
            if all(s is None for s in schemes.values()):
                continue
            problems = [s.check_shape(tuple(module.get_parameter(weights[r].target).shape)) for r, s in schemes.items() if s]
            if any(problems):
                raise ConfigError(f"quantize: {module_path(next(iter(weights.values())).target)}: "
                                  f"{next(p for p in problems if p)}; name another scheme for it under quantize.layers")
            with module.graph.inserting_before(node):
                out = self._rewrite(rewriter, node, weights, schemes)
            _copy_meta(out, node)
            node.replace_all_uses_with(out)
            module.graph.erase_node(node)
            for weight in weights.values():
                if not weight.users:
                    module.graph.erase_node(weight)
            split += node.target is not LINEAR
        for glob, _ in rules:
            if glob not in planner.used:
                logger.warning("quantize.layers[%r] matches no quantizable layer of this model; check the module paths "
                               "(e.g. 'layers.0.mlp.gate_proj', 'lm_head')", glob)
        # Only the new nodes get values: the rest keep export's (a quantized op returns what the linear did).
        infer_values(module, [n for n in module.graph.nodes if n not in existing])
        context.quantized_weights = {r.source: r for r in rewriter.records}
        context.smoothing_groups = _smoothing_groups(module, rewriter.records)
        context.head_smoothing = _head_smoothing(module, rewriter.records)
        counts: dict[str, int] = {}
        for record in rewriter.records:
            if len(record.shape) == 2 and module_path(record.source) not in tables:
                counts[record.scheme.name] = counts.get(record.scheme.name, 0) + 1
        expert_layers = sorted({r.path for r in rewriter.records if len(r.shape) == 3})
        details = [f"{r.path}: {r.scheme.name}" for r in rewriter.records]
        if kept:
            details.append(f"kept in the model's dtype (a weight shared or not read straight from the module, or an "
                           f"MoE router): {', '.join(kept)}")
        source = f" as the checkpoint's {found.method} quantization gives them" if found is not None else ""
        experts_note = f"{len(expert_layers)} MoE layers' experts {experts.name}" if expert_layers else ""
        tables_note = (f"embedding table{'s' if len(tables) > 1 else ''} int8"
                       + (" (shared with the tied LM head's int8_wo)" if tied_head else "") if tables else "")
        return TransformResult(
            matches=len(rewriter.records), changed=bool(rewriter.records),
            notes=", ".join([*(f"{n} {scheme}" for scheme, n in sorted(counts.items())), *filter(None, [experts_note, tables_note])]) + source
            + (f"; {split} MLPs split" if split else ""),
            details=details + [f"served differently from the checkpoint: {note}" for note in (found.notes if found else [])],
        )

    @staticmethod
    def _quantize_embedding(rewriter: _Rewriter, node: fx.Node, scheme: QuantScheme, planner,
                            head_elsewhere: str | None) -> fx.Node | None | bool:
        """Rewrite one embedding lookup over its own table: returns None, or the LM head it rewrote too, or
        False when the table stays as it is. A table tied to the LM head is stored once for both when the
        head's own scheme is ``int8_wo``, whose layout (a scale per row) the lookup shares; under any other
        head scheme it stays in the model's dtype, as a tied weight does. A table tied to a head in another
        graph (``head_elsewhere``, its module path) follows that head's scheme alike, so both graphs store it alike."""
        weight, input_ids = node.args[:2]
        head, owned = None, rewriter.own_weight(weight) is not None
        if owned and head_elsewhere is not None:
            head_scheme = planner.scheme_for(head_elsewhere)
            if head_scheme is None or head_scheme.name != scheme.name:
                return False
            scheme = head_scheme
        elif not owned:
            if not isinstance(weight, fx.Node) or weight.op != "get_attr" or weight.target in rewriter.shared:
                return False
            others = [user for user in weight.users if user is not node]
            if len(others) != 1 or others[0].target is not LINEAR or others[0].args[1] is not weight:
                return False
            head_scheme = planner.scheme_for(module_path(weight.target))
            if head_scheme is None or head_scheme.name != scheme.name:
                return False
            head, scheme = others[0], head_scheme
        dtype = rewriter.gm.get_parameter(weight.target).dtype
        with rewriter.graph.inserting_before(node):
            storage = rewriter.quantized_storage(weight, scheme)
            lookup = rewriter.graph.call_function(EMBEDDING_INT8, (input_ids, *storage, dtype))
        _copy_meta(lookup, node)
        node.replace_all_uses_with(lookup)
        rewriter.graph.erase_node(node)
        if head is not None:
            with rewriter.graph.inserting_before(head):
                projection = rewriter.graph.call_function(scheme.op, (head.args[0], *storage, head.args[2]))
            _copy_meta(projection, head)
            head.replace_all_uses_with(projection)
            rewriter.graph.erase_node(head)
        rewriter.graph.erase_node(weight)
        return head

    @staticmethod
    def _quantize_experts(module: GraphModule, rewriter: _Rewriter, node: fx.Node, scheme: QuantScheme, kept: list) -> None:
        weights = node.args[2:4]
        if any(rewriter.own_weight(w, dims=3) is None for w in weights):
            kept.append(node.name)
            return
        for weight in weights:
            problem = scheme.check_shape(tuple(module.get_parameter(weight.target).shape))
            if problem:
                raise ConfigError(f"quantize.experts: {module_path(weight.target)}: {problem}")
        with module.graph.inserting_before(node):
            out = rewriter.quantized_experts(node, scheme)
        _copy_meta(out, node)
        node.replace_all_uses_with(out)
        module.graph.erase_node(node)
        for weight in weights:
            module.graph.erase_node(weight)

    @staticmethod
    def _rewrite(rewriter: _Rewriter, node: fx.Node, weights: dict, schemes: dict) -> fx.Node:
        x = node.args[0]
        if node.target is LINEAR:
            return rewriter.projection(x, weights[""], node.args[2], schemes[""])
        if node.target is GATED_MLP:
            gate = rewriter.projection(x, weights["gate"], None, schemes["gate"])
            up = rewriter.projection(x, weights["up"], None, schemes["up"])
            hidden = rewriter.activation(node.args[4], gate, up)
            return rewriter.projection(hidden, weights["down"], None, schemes["down"])
        up = rewriter.projection(x, weights["up"], node.args[2], schemes["up"])
        hidden = rewriter.activation(node.args[5], up, None)
        return rewriter.projection(hidden, weights["down"], node.args[4], schemes["down"])
