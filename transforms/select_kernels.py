"""``select_kernels`` (stage ``select``): retarget every canonical node to the backend op that serves it.

Per node, among the op's backends whose ``supports`` admits the node's arguments on the deploy's device
(the reference, last, admits every node):

1. an explicit preference from the settings' ``backends`` — ``{op: [names…]}`` or, per node,
   ``{op: {glob: [names…]}}`` with globs over the node's module path or name, first match wins; the
   first preferred backend that supports the node is taken, and a preference none of whose backends
   supports it is a ``ConfigError`` naming the node and each reason;
2. else, where more than one backend besides the reference supports it, the autotuner's decision
   (``autotuner/``; per token-count bucket — a node whose buckets disagree gets a dispatch by token count);
3. else the first supported backend in registration order.

Steps 2 and 3 pass ``opt_in`` backends by, and, where the deploy replays decode steps as CUDA graphs
(``compile_model.captures_decode_steps``), the backends that read device tensors on the host (``Backend.capturable``)
whenever one that does not supports the node: one such kernel would keep the whole decode step eager (the
encoder–decoder's ``cached_cross_attention``: ``triton``, or ``dense`` where Triton cannot run, over ``sdpa`` on a GPU). ``batch_invariant: true`` makes every op that has an ``invariant``
backend prefer it (``custom_ops/batch_invariant.py``) and refuses, before anything is chosen, a device without
Triton, a graph holding an op with no such backend that is not row-local, and a ``backends`` entry for an op it
decides.

The report (``autodeploy inspect``, ``LLM.pipeline_report()``) lists, per op, which kernel each group of
nodes got and why: ``preference``, ``batch_invariant``, ``tuned`` or ``only candidate`` / ``first supported``.
"""

from __future__ import annotations

import fnmatch
import logging
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx import GraphModule

from autodeploy.autotuner import Autotuner, bucket_runs, token_buckets, token_dispatch
from autodeploy.custom_ops import REFERENCE, candidates, canonical_ops, op_by_target
from autodeploy.custom_ops import batch_invariant
from autodeploy.deployment import MODEL
from autodeploy.errors import ConfigError
from autodeploy.transforms.compile_model import captures_decode_steps
from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    backend: str
    why: str  # preference | tuned | only candidate | first supported


def parse_preferences(backends: Mapping[str, Any]) -> dict[str, list[tuple[str, list[str]]]]:
    """``settings.backends`` → op name → ``[(glob, [backend names])]``, checked against the registry."""
    registry = canonical_ops()
    parsed: dict[str, list[tuple[str, list[str]]]] = {}
    for op_name, value in dict(backends or {}).items():
        if op_name not in registry:
            raise ConfigError(
                f"backends.{op_name}: no canonical op is named {op_name!r}; ops with backends: "
                f"{', '.join(sorted(n for n, r in registry.items() if r.backends))}"
            )
        rules = list(value.items()) if isinstance(value, Mapping) else [("*", value)]
        known = [b.name for b in candidates(op_name)]
        parsed[op_name] = []
        for glob, names in rules:
            where = f"backends.{op_name}" + ("" if glob == "*" and not isinstance(value, Mapping) else f"[{glob!r}]")
            if isinstance(names, str):
                names = [names]
            if not isinstance(names, Sequence) or not names or not all(isinstance(n, str) for n in names):
                raise ConfigError(f"{where} must be a list of backend names (e.g. [{', '.join(known)}]); got {names!r}")
            for name in names:
                if name not in known:
                    raise ConfigError(f"{where}: {op_name} has no backend {name!r}; registered: {', '.join(known)}")
            parsed[op_name].append((str(glob), list(names)))
    return parsed


def batch_invariant_preferences(
    gm: GraphModule, preferences: dict[str, list[tuple[str, list[str]]]], device: torch.device
) -> dict[str, list[tuple[str, list[str]]]]:
    """``batch_invariant: true``: the ``invariant`` backend for every op that has one; a ``ConfigError`` on a device
    they cannot run on, naming each op of the graph that has none and is not row-local (``custom_ops/batch_invariant.py``),
    or naming a ``backends`` preference for an op the setting decides."""
    reason = batch_invariant.unavailable(device)
    if reason:
        raise ConfigError(f"batch_invariant: true needs the batch-invariant Triton kernels, and {reason}; deploy on a CUDA "
                          f"GPU, or without batch_invariant")
    registry = canonical_ops()
    present = Counter(found[0].name for node in gm.graph.nodes if node.op == "call_function"
                      and (found := op_by_target(node.target)) is not None)
    decided = {name for name in present if any(b.name == batch_invariant.BACKEND for b in registry[name].backends)}
    clash = sorted(decided & set(preferences))
    if clash:
        raise ConfigError(f"batch_invariant: true selects the batch-invariant kernel of {', '.join(clash)}, and backends names "
                          f"others for them; drop those backends entries or batch_invariant")
    lacking = sorted(name for name in present if name not in decided and name not in batch_invariant.ROW_LOCAL_OPS)
    if lacking:
        raise ConfigError(
            "batch_invariant: true, but no batch-invariant kernel serves "
            + ", ".join(f"{name} (×{present[name]})" for name in lacking)
            + f"; they are kept invariant for {', '.join(sorted(k for k, r in registry.items() if any(b.name == batch_invariant.BACKEND for b in r.backends)))}"
            " (quantized layers, MoE and tensor-parallel collectives are not): deploy without batch_invariant, or without "
            "what brings those ops in"
        )
    return {**preferences, **{name: [("*", [batch_invariant.BACKEND])] for name in decided}}


def node_path(node: fx.Node) -> str:
    """The module path that produced ``node`` (``model.layers.0.mlp``), or ``""``."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _preference(rules: list[tuple[str, list[str]]], node: fx.Node) -> tuple[str, list[str]] | None:
    path = node_path(node)
    for glob, names in rules:
        if fnmatch.fnmatchcase(node.name, glob) or (path and fnmatch.fnmatchcase(path, glob)):
            return glob, names
    return None


class _TokenShapes:
    """Turns the graph's symbolic shapes into concrete ones for a token count: the flattened row's batch
    symbol is 1 and its sequence symbol the token count (read from ``input_ids``'s ``[1, T]`` value)."""

    def __init__(self, gm: GraphModule):
        ids = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids"), None)
        shape = ids.meta.get("val").shape if ids is not None and "val" in ids.meta else ()
        self.symbols = [d.node.expr if isinstance(d, torch.SymInt) else None for d in shape]

    def concrete(self, shape: Sequence[Any], num_tokens: int) -> tuple[int, ...]:
        values = {}
        if len(self.symbols) == 2:
            batch, seq = self.symbols
            if batch is not None:
                values[batch] = 1
            if seq is not None:
                values[seq] = num_tokens

        def size(d) -> int:
            if not isinstance(d, torch.SymInt):
                return int(d)
            expr = d.node.expr.xreplace(values)
            # Other symbols (a vision graph's image count, a side input's rows): one of each.
            return int(expr.xreplace({symbol: 1 for symbol in expr.free_symbols}) if hasattr(expr, "free_symbols") else expr)

        return tuple(size(d) for d in shape)

    def token_dim(self, value: torch.Tensor) -> int | None:
        seq = self.symbols[1] if len(self.symbols) == 2 else None
        for index, d in enumerate(value.shape):
            if isinstance(d, torch.SymInt) and seq is not None and seq in d.node.expr.free_symbols:
                return index
        return None


def _meta_args(node: fx.Node, shapes: _TokenShapes, gm: GraphModule) -> list[Any]:
    """The node's arguments for ``supports``, all positional in the op's order (a keyword argument of the node,
    such as a cache-stage node's ``tree_mask``, at its place, the defaults before it filled in): tensors as meta
    tensors (concrete shapes, one token bucket)."""

    def convert(arg):
        if not isinstance(arg, fx.Node):
            return arg
        value = arg.meta.get("val")
        if arg.op == "get_attr":
            value = _attribute(gm, arg.target)
        if not isinstance(value, torch.Tensor):
            return value
        shape = shapes.concrete(value.shape, 8)
        return torch.empty_strided(shape, _strides(value, shape), dtype=value.dtype, device="meta")

    return [fx.node.map_aggregate(a, convert) for a in _positional(node)]


def _positional(node: fx.Node) -> list[Any]:
    """``node.args`` followed by its keyword arguments in the schema's order, the defaults between filled in."""
    args = list(node.args)
    if not node.kwargs:
        return args
    schema = node.target._schema.arguments
    last = max(i for i, a in enumerate(schema) if a.name in node.kwargs)
    for argument in schema[len(args) : last + 1]:
        args.append(node.kwargs[argument.name] if argument.name in node.kwargs else argument.default_value)
    return args


def _strides(value: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides for ``shape``, unless the value's strides are concrete already."""
    if all(isinstance(s, int) for s in value.stride()) and len(value.stride()) == len(shape):
        return tuple(value.stride())
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _attribute(gm: GraphModule, target: str) -> Any:
    return operator.attrgetter(target)(gm)


class _Problem:
    """One node as the autotuner sees it: real weights, random activations at any token count, and the integer inputs
    its op knows how to synthesize (``register_tuning_input``: a packed attention's ``seq_start``). Keyword arguments
    count like positional ones (a packed attention's ``seq_start`` is one): a problem timed without them would be
    another problem."""

    def __init__(self, node: fx.Node, gm: GraphModule, shapes: _TokenShapes, device: torch.device):
        self.node, self.gm, self.shapes, self.device = node, gm, shapes, device
        self.args = _positional(node)
        found = op_by_target(node.target)
        synthesizers = found[0].tuning_inputs if found is not None else {}
        names = [a.name for a in node.target._schema.arguments] if hasattr(node.target, "_schema") else []
        # Only where the node passes a tensor: an argument left None (unpacked attention) stays None.
        self.synthesized = {i: synthesizers[name] for i, name in enumerate(names[: len(self.args)])
                            if name in synthesizers and isinstance(self.args[i], fx.Node)}

    def tunable(self) -> str | None:
        """Why this node cannot be timed on synthetic inputs, or ``None``."""
        for index, arg in enumerate(self.args):
            for leaf in _nodes(arg):
                value = _attribute(self.gm, leaf.target) if leaf.op == "get_attr" else leaf.meta.get("val")
                if isinstance(value, torch.Tensor):
                    if value.device.type == "meta" and leaf.op == "get_attr":
                        return "weights are on the meta device"
                    # Weights are the graph's own (packed int4, int8, fp8 included); only activations are synthesized.
                    if leaf.op != "get_attr" and not value.dtype.is_floating_point and index not in self.synthesized:
                        return "integer inputs (indices, sequence metadata) are not synthesized"
                elif value is None:
                    return "an input has no recorded value"
        return None

    def make_inputs(self, num_tokens: int) -> list[Any]:
        def build(arg):
            if not isinstance(arg, fx.Node):
                return arg
            if arg.op == "get_attr":
                return _attribute(self.gm, arg.target)
            value = arg.meta["val"]
            if not isinstance(value, torch.Tensor):
                return value
            shape = self.shapes.concrete(value.shape, num_tokens)
            if value.dtype.itemsize == 1:  # fp8 activations (rows a norm rounded): torch draws no float8 directly
                return torch.randn(shape, device=self.device).to(value.dtype)
            return torch.randn(shape, dtype=value.dtype, device=self.device)

        return [self.synthesized[index](num_tokens, self.device) if index in self.synthesized else fx.node.map_aggregate(arg, build)
                for index, arg in enumerate(self.args)]

    def token_position(self) -> tuple[int, int] | None:
        """(argument index, dim) of the first tensor argument whose shape holds the token count."""
        for index, arg in enumerate(self.node.args):
            if isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor):
                dim = self.shapes.token_dim(arg.meta["val"])
                if dim is not None:
                    return index, dim
        return None


def _nodes(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return found


@register_transform("select_kernels", stage="select", roles=ALL_ROLES)
class SelectKernels(Transform):
    """Give every canonical node the backend op that serves it (preference > tuned > first supported)."""

    def validate(self, context: TransformContext) -> None:
        parse_preferences(context.settings.get("backends") or {})

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        settings = context.settings
        preferences = parse_preferences(settings.get("backends") or {})
        device = torch.device(str(settings.device))
        shapes = _TokenShapes(module)
        tuner_settings = settings.get("autotuner") or {}
        tuner = None
        if tuner_settings.get("enabled", True) and device.type != "meta":
            compile_settings = settings.get("compile") or {}
            tuner = Autotuner(
                device, tuner_settings.get("cache_dir"), warmup=tuner_settings.get("warmup", 3),
                repeats=tuner_settings.get("repeats", 15),
                # A deploy that replays decode steps as CUDA graphs pays kernel time, not launch gaps.
                graphed=device.type == "cuda" and compile_settings.get("backend") == "cuda_graph",
            )
        buckets = token_buckets(int(settings.max_batch_size), int(settings.scheduler.max_num_tokens))
        summary: Counter[tuple[str, str, str]] = Counter()
        decided: dict[str, Any] = {}  # problem signature → target, so identical layers are tuned once
        self.tuning_table: list[str] = []
        changed = 0
        invariant = bool(settings.get("batch_invariant", False))
        self.captured = context.role == MODEL and captures_decode_steps(settings)  # decode steps as CUDA graphs
        self.invariant_ops: set[str] = set()
        if invariant:
            with_invariant = batch_invariant_preferences(module, preferences, device)
            self.invariant_ops = set(with_invariant) - set(preferences)
            preferences = with_invariant
        for node in list(module.graph.nodes):
            found = op_by_target(node.target) if node.op == "call_function" else None
            if found is None or not found[0].backends:
                continue
            record = found[0]
            target, choice = self._choose(record.name, node, module, shapes, device, preferences, tuner, buckets, decided)
            if record.name in self.invariant_ops:
                choice = Choice(choice.backend, "batch_invariant")
            if target is not node.target:
                node.target = target
                changed += 1
            node.meta["autodeploy_kernel"] = choice
            summary[(record.name, getattr(target, "__name__", str(target)).removesuffix(".default"), choice.why)] += 1
        details = [f"{op} ×{count} → {kernel} ({why})" for (op, kernel, why), count in sorted(summary.items())]
        if tuner is not None:
            tuner.save()
            if self.tuning_table:
                details += ["tuned problems (token bucket: winner, median µs per candidate):", *self.tuning_table]
                details.append(f"autotuner cache {tuner.cache.path}: {tuner.profiled} bucket timings made, "
                               f"{tuner.reused} reused")
        tuned = f", {tuner.profiled} problem×bucket timings" if tuner is not None and tuner.profiled else ""
        return TransformResult(matches=sum(summary.values()), changed=bool(changed),
                               notes=f"{len(summary)} kernel choices{tuned}", details=details)

    def _choose(self, op_name, node, gm, shapes, device, preferences, tuner, buckets, decided):
        args = _meta_args(node, shapes, gm)
        options = candidates(op_name)
        reasons = {b.name: b.check(args, device) for b in options}
        supported = [b for b in options if reasons[b.name] is None]
        preference = _preference(preferences.get(op_name, []), node)
        if preference is not None:
            glob, names = preference
            chosen = next((b for name in names for b in supported if b.name == name), None)
            if chosen is None and op_name in self.invariant_ops:
                raise ConfigError(
                    f"batch_invariant: true, but {op_name}'s batch-invariant kernel cannot serve node {node.name} "
                    f"({node_path(node) or 'no module path'}): {reasons[batch_invariant.BACKEND]}; deploy without "
                    f"batch_invariant, or without what the node needs"
                )
            if chosen is None:
                why_not = "; ".join(f"{name}: {reasons[name]}" for name in names)
                raise ConfigError(
                    f"backends.{op_name} prefers {names} for node {node.name} ({node_path(node) or 'no module path'}), "
                    f"but none supports it on {device} — {why_not}. Supported here: "
                    f"{', '.join(b.name for b in supported)}; change the preference or add one of those to it"
                )
            return chosen.op, Choice(chosen.name, "preference")
        supported = [b for b in supported if not b.opt_in]  # only a preference selects those
        if self.captured and any(b.capturable for b in supported):
            for b in supported:
                if not b.capturable:
                    reasons[b.name] = "reads device tensors on the host, and decode steps replay CUDA graphs"
            supported = [b for b in supported if b.capturable]
        contenders = [b for b in supported if b.name != REFERENCE]
        if len(contenders) > 1 and tuner is not None:
            problem = _Problem(node, gm, shapes, device)
            untunable = problem.tunable()
            position = problem.token_position()
            if untunable is None and position is not None:
                signature = [op_name, _signature(node, gm, shapes)]
                key = repr(signature) + repr([b.name for b in contenders])
                if key not in decided:
                    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point), torch.float32)
                    table = tuner.decide(op_name, signature, contenders, canonical_ops()[op_name].reference,
                                         problem.make_inputs, buckets, dtype)
                    self.tuning_table.append(f"  {op_name} {_describe(signature[1])}: {_runs(table)}")
                    by_name = {b.name: b for b in contenders}
                    winners = {bucket: by_name[d.backend] for bucket, d in table.items()}
                    if len({b.name for b in winners.values()}) == 1:
                        only = next(iter(winners.values()))
                        decided[key] = (only.op, Choice(only.name, "tuned"))
                    else:
                        dispatch = token_dispatch(op_name, winners, position)
                        decided[key] = (dispatch, Choice(dispatch.__name__, "tuned per token bucket"))
                return decided[key]
            logger.debug("select: %s not tuned (%s); first supported backend", node.name, untunable or "no token dimension")
        chosen = supported[0]
        why = "only candidate" if len(contenders) <= 1 else "first supported"
        refused = "; ".join(f"{name}: {reason}" for name, reason in reasons.items() if reason)
        return chosen.op, Choice(chosen.name, f"{why} — {refused}" if refused else why)


def _runs(table: dict[int, Any]) -> str:
    """The tuning table's line for one problem, a run per winner with the candidates' times at its ends:
    ``1–32: triton (at 1: torch 9.1, triton 4.0; at 32: …)``."""

    def times(decision) -> str:
        return ", ".join(f"{name} {seconds * 1e6:.1f}" for name, seconds in sorted(decision.seconds.items()))

    parts = []
    for first, last, winner in bucket_runs({bucket: d.backend for bucket, d in table.items()}):
        ends = f"at {first}: {times(table[first])}" + ("" if first == last else f"; at {last}: {times(table[last])}")
        parts.append(f"{first}{'' if first == last else f'–{last}'}: {winner} ({ends})")
    return "; ".join(parts)


def _describe(signature: list[Any]) -> str:
    """``[["tensor", ["T", "64"], "bfloat16"], …]`` → ``(T×64 bfloat16, …)`` for the tuning table."""

    def one(item):
        if isinstance(item, list) and len(item) == 3 and item[0] == "tensor":
            return "×".join(item[1]) + f" {item[2]}"
        return str(item)

    return "(" + ", ".join(one(a) for a in signature) + ")"


def _signature(node: fx.Node, gm: GraphModule, shapes: _TokenShapes) -> list[Any]:
    """The node's arguments with the token count left open (``T``, ``2T``): what makes two nodes the same
    tuning problem, in this graph and in the next export of the model (symbol names differ between exports)."""

    def dim(value: torch.Tensor, index: int) -> str:
        one, two = (shapes.concrete(value.shape, n)[index] for n in (1, 2))
        if one == two:
            return str(one)
        return "T" if one == 1 and two == 2 else f"{one}+{two - one}(T-1)"

    def describe(arg):
        if isinstance(arg, fx.Node):
            value = _attribute(gm, arg.target) if arg.op == "get_attr" else arg.meta.get("val")
            if isinstance(value, torch.Tensor):
                return ["tensor", [dim(value, i) for i in range(value.dim())], str(value.dtype).removeprefix("torch.")]
            return repr(value)
        if isinstance(arg, (list, tuple)):
            return [describe(a) for a in arg]
        return repr(arg)

    return [describe(a) for a in _positional(node)]
