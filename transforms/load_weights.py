"""The load_weights stage: stream checkpoint tensors into the final graph's parameters.

Each parameter is allocated on the target device once and filled tensor by tensor, so peak host
memory stays near one tensor (or one fused group, e.g. a layer's MoE experts), not one model.
Checkpoint names are mapped to the model's with transformers' own conversion rules (renamings and
fusions such as Mixtral's per-expert ``w1/w3`` → ``gate_up_proj``), so every format transformers
loads, loads here. Under tensor parallelism a rank reads only its slice of a tensor stored as its parameter
is (``CheckpointReader.read_slice``), so host memory per rank scales as 1/N; a tensor transformers converts
is read whole and then narrowed.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import fx, nn
from tqdm import tqdm

from autodeploy.custom_ops.quantized_linear import quantize_weight, share_head_smoothing, share_smoothing
from autodeploy.errors import CheckpointError
from autodeploy.export.causal_lm import GRAPH_PREFIX
from autodeploy.models.checkpoint import CheckpointReader, StateDictReader
from autodeploy.models.factory import ModelFactory
from autodeploy.models.random_weights import random_parameter
from autodeploy.transforms.calibration import calibrate, kv_cache_scales, kv_projections
from autodeploy.transforms.shard_tensor_parallel import SHARDS
from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformResult, register_transform

logger = logging.getLogger(__name__)


def _set_attribute(root: nn.Module, dotted: str, value) -> None:
    *path, leaf = dotted.split(".")
    owner = root
    for part in path:
        owner = getattr(owner, part)
    if isinstance(value, nn.Parameter):
        owner._parameters[leaf] = value
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        setattr(owner, leaf, value)


def move_graph_to_device(gm: fx.GraphModule, device: torch.device) -> int:
    """Rewrite device arguments baked into graph nodes at export (e.g. ``arange(device=meta)``)."""
    moved = 0

    def retarget(value):
        nonlocal moved
        if isinstance(value, torch.device) and value != device:
            moved += 1
            return device
        return value

    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, retarget)
        node.kwargs = fx.node.map_aggregate(node.kwargs, retarget)
    gm.recompile()
    return moved


def _allocate_parameters(gm: fx.GraphModule, device: torch.device) -> dict[str, list[str]]:
    """Give each distinct parameter real storage; tied parameters keep sharing it. Returns name → aliases."""
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params[id(param)] = param
    groups = {}
    for key, names in aliases.items():
        meta = params[key]
        real = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device), requires_grad=False)
        for name in names:
            _set_attribute(gm, name, real)
            groups[name] = names
    return groups


class _NameMapper:
    """Checkpoint key → HF model key, with transformers' per-architecture conversion rules."""

    def __init__(self, hf_model: nn.Module):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        mapping = get_model_conversion_mapping(hf_model)
        self.renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        self.converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self.by_pattern = {pattern: c for c in self.converters for pattern in c.source_patterns}
        self.prefix = getattr(hf_model, "base_model_prefix", None)
        self.model_keys = dict(hf_model.state_dict())
        # Tied weights: every name of a shared tensor, since the graph keeps only one of them.
        names_of: dict[int, list[str]] = {}
        for name, param in hf_model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(name)
        self.aliases = {name: names for names in names_of.values() for name in names}

    def graph_name(self, model_key: str, groups) -> str | None:
        """The graph attribute holding ``model_key`` (or a tied alias); None when the graph does not use it."""
        for alias in self.aliases.get(model_key, [model_key]):
            if GRAPH_PREFIX + alias in groups:
                return GRAPH_PREFIX + alias
        return None

    def rename(self, key: str) -> tuple[str, str | None]:
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.model_keys)
        if renamed not in self.model_keys and key in self.model_keys:
            renamed, pattern = rename_source_key(key, [], [], self.prefix, self.model_keys)
        return renamed, pattern


def _rank_slice(tensor: torch.Tensor, shard: tuple | None) -> torch.Tensor:
    """This rank's part of a whole tensor (one transformers converted after reading it, or rows that are not
    one range): ``SHARDS`` gives ``(dim, start, stop)`` (transforms/shard_tensor_parallel.py) or ``(dim, rows)``
    (transforms/shard_expert_parallel.py: placed experts, an expert's gate and up halves)."""
    if shard is None:
        return tensor
    if len(shard) == 2:  # (dim, rows): rows that are not one range (shard_expert_parallel: placed experts, gate + up halves)
        dim, rows = shard
        return tensor.index_select(dim, torch.tensor(rows, device=tensor.device)) if tensor.shape[dim] > max(rows) else tensor
    dim, start, stop = shard
    return tensor.narrow(dim, start, stop - start) if tensor.shape[dim] >= stop else tensor  # else: the shape error


def _copy_into(gm: fx.GraphModule, name: str | None, tensor: torch.Tensor, groups, filled: set[str], source: str,
               quantized=None, statistics=None) -> None:
    """Copy one checkpoint tensor into the graph parameter ``name``, or, for a weight the quantize stage
    replaced (``quantized``: graph name → ``QuantizedWeight``), its scheme's tensors computed from it."""
    if name is None:  # a tensor the graph no longer uses (dead code removed it)
        return
    record = (quantized or {}).get(name)
    expected = tuple(record.shape) if record is not None else tuple(gm.get_parameter(name).shape)
    if tuple(tensor.shape) != expected:
        raise CheckpointError(
            f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)} but the model expects {expected} "
            f"for {name.removeprefix(GRAPH_PREFIX)!r}; does config.json match these weights?"
        )
    if record is not None:
        _fill_quantized(gm, record, tensor, groups, filled, statistics)
        return
    with torch.no_grad():
        gm.get_parameter(name).copy_(tensor)
    filled.update(groups[name])


def _fill_quantized(gm: fx.GraphModule, record, tensor: torch.Tensor, groups, filled: set[str], statistics=None) -> None:
    device = gm.get_parameter(next(iter(record.targets.values()))).device
    stored = quantize_weight(record.scheme, tensor.to(device), (statistics or {}).get(record.path))
    with torch.no_grad():
        for role, target in record.targets.items():
            gm.get_parameter(target).copy_(stored[role])
            filled.update(groups[target])


def _check_fused_sources(target: str, meta_tensor: torch.Tensor, hf_model: nn.Module, reader: CheckpointReader | StateDictReader) -> None:
    """Name missing or mis-shaped checkpoint tensors of a fused target (e.g. one expert's ``w1``) before
    fusing, instead of surfacing a ``torch.cat`` size mismatch."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        expected = revert_weight_conversion(hf_model, {target: meta_tensor})
    except Exception:  # a conversion transformers cannot revert: fall back to the conversion's own errors
        return
    available = set(reader.keys())
    if not any(key in available for key in expected):  # another naming convention: nothing to compare
        return
    missing = [key for key in expected if key not in available]
    if missing:
        raise CheckpointError(
            f"checkpoint {reader.directory} lacks {len(missing)} tensor(s) needed to build {target!r}: "
            f"{', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}"
        )
    for key, tensor in expected.items():
        if reader.shape(key) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint tensor {key!r} has shape {reader.shape(key)} but the model expects {tuple(tensor.shape)}; "
                f"does config.json match these weights?"
            )


# Tensors a quantizing tool stores for a layer (compressed-tensors, AutoAWQ / GPTQ, ModelOpt) besides ``weight``.
_QUANTIZATION_LEAVES = {"weight_scale", "weight_zero_point", "weight_packed", "weight_shape", "weight_g_idx", "input_scale",
                        "weight_global_scale", "qweight", "qzeros", "scales", "g_idx"}


def _prequantized_layer(key: str, mapper: _NameMapper, known, quantized) -> tuple[str, str] | None:
    """(graph weight name, leaf) when ``key`` is one of a quantized layer's tensors in a pre-quantized checkpoint."""
    module, _, leaf = key.rpartition(".")
    if leaf == "bias":
        return None
    name = mapper.graph_name(mapper.rename(f"{module}.weight")[0], known)
    if name in quantized:
        return name, leaf
    if leaf in _QUANTIZATION_LEAVES:
        raise CheckpointError(
            f"checkpoint tensor {key!r} quantizes {module}, which autodeploy keeps in the model's dtype (MoE experts and "
            f"routers, weights tied to the embedding, layers the quantization config does not name): a checkpoint that "
            f"quantized it cannot be served yet"
        )
    return None


def _fill_prequantized(gm: fx.GraphModule, record, stored: dict[str, torch.Tensor], groups, filled: set[str]) -> None:
    with torch.no_grad():
        for role, target in record.targets.items():
            parameter, value = gm.get_parameter(target), stored[role]
            if tuple(value.shape) != tuple(parameter.shape) or value.dtype != parameter.dtype:
                raise CheckpointError(
                    f"{record.path}: the checkpoint's tensors give its {record.scheme.name} {role} as "
                    f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}, the model needs "
                    f"{str(parameter.dtype).removeprefix('torch.')} {tuple(parameter.shape)}"
                )
            parameter.copy_(value)
            filled.update(groups[target])


def load_checkpoint(gm: fx.GraphModule, factory: ModelFactory, reader: CheckpointReader | StateDictReader, groups,
                    quantized=None, statistics=None, prequantized=None) -> int:
    """Fill the graph's parameters from ``reader``. A weight the quantize stage replaced is quantized from the
    checkpoint's float tensor, or, in a ``prequantized`` checkpoint (``models/prequantized.py``), converted
    from the tensors the quantizing tool stored for its layer."""
    quantized = quantized or {}
    mapper = _NameMapper(factory.meta_model)
    known = {**groups, **{name: [name] for name in quantized}}  # graph names a checkpoint tensor may fill
    shards = gm.meta.get(SHARDS, {})  # graph name → the part this rank keeps (see _rank_slice)
    filled: set[str] = set()
    pending: dict[str, object] = {}  # fused targets: a converter collecting lazy reads of its sources
    layers: dict[str, dict[str, str]] = {}  # a pre-quantized layer's graph weight name → its tensors' keys by leaf
    unexpected = []
    for key in tqdm(sorted(reader.keys()), desc="loading weights", unit="tensor", leave=False, mininterval=2.0, disable=None):
        if prequantized is not None and key.rpartition(".")[2] in ("k_scale", "v_scale"):
            continue  # KV cache scales: checkpoint_kv_cache_scales reads them
        layer = _prequantized_layer(key, mapper, known, quantized) if prequantized is not None else None
        if layer is not None:
            layers.setdefault(layer[0], {})[layer[1]] = key
            continue
        renamed, pattern = mapper.rename(key)
        if renamed not in mapper.model_keys:
            unexpected.append(key)
            continue
        if pattern is None:
            name = mapper.graph_name(renamed, known)
            shard = shards.get(name)
            if shard is None or len(shard) == 2:  # whole, or rows that are not one range: read whole, then taken
                _copy_into(gm, name, _rank_slice(reader.read(key), shard), groups, filled, key, quantized, statistics)
                continue
            # Stored as the parameter is: read only this rank's slice (host memory ~1/N a rank).
            stored, full = reader.shape(key), tuple(mapper.model_keys[renamed].shape)
            if stored != full:
                raise CheckpointError(f"checkpoint tensor {key!r} has shape {stored} but the model expects {full} for "
                                      f"{renamed!r}; does config.json match these weights?")
            _copy_into(gm, name, reader.read_slice(key, *shard), groups, filled, key, quantized, statistics)
            continue
        converter = pending.setdefault(renamed, copy.deepcopy(mapper.by_pattern[pattern]))
        converter.collected_tensors[pattern].append(lambda key=key: reader.read(key))
    for target, converter in pending.items():
        _check_fused_sources(target, mapper.model_keys[target], factory.meta_model, reader)
        try:
            converted = converter.convert(target, model=factory.meta_model, config=factory.hf_config)
        except Exception as error:  # transformers' conversion ops raise plain exceptions on bad inputs
            raise CheckpointError(f"cannot build {target!r} from the checkpoint's tensors: {error}") from error
        for name, tensor in converted.items():
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            name = mapper.graph_name(name, known)
            _copy_into(gm, name, _rank_slice(tensor, shards.get(name)), groups, filled, target, quantized, statistics)
    if prequantized is not None:
        for name, record in quantized.items():
            keys = layers.get(name)
            if not keys:
                raise CheckpointError(f"{prequantized.method} checkpoint {reader.directory} has no tensors for the quantized "
                                      f"layer {record.path} (e.g. {record.path}.weight_scale or .qweight)")
            stored = prequantized.stored(record.path, record.scheme, {leaf: reader.read(key) for leaf, key in keys.items()},
                                         record.shape)
            _fill_prequantized(gm, record, stored, groups, filled)
    if unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use, e.g. %s", len(unexpected), unexpected[:3])
    missing = sorted({name for name in groups if name not in filled})
    if missing:
        shown = ", ".join(n.removeprefix(GRAPH_PREFIX) for n in missing[:4])
        raise CheckpointError(
            f"checkpoint {reader.directory} lacks {len(missing)} tensor(s) the model needs: {shown}"
            f"{' …' if len(missing) > 4 else ''}; is it a checkpoint of a different model variant?"
        )
    return len(filled)


def initialize_randomly(gm: fx.GraphModule, factory: ModelFactory, groups, seed: int, quantized=None) -> int:
    """Random weights for benchmarking (``random_parameter``), tied weights filled once; a weight the quantize
    stage replaced is drawn in float32 and quantized."""
    std = getattr(factory.hf_config, "initializer_range", 0.02)
    device = next(iter(gm.parameters())).device
    generator = torch.Generator(device=device).manual_seed(seed)  # on the device: 8B values in seconds
    done = set()
    for record in (quantized or {}).values():
        weight = random_parameter(record.source, torch.Size(record.shape), std, device, generator)
        _fill_quantized(gm, record, weight, groups, done)
    for name in groups:
        if name in done:
            continue
        param = gm.get_parameter(name)
        with torch.no_grad():
            param.copy_(random_parameter(name, param.shape, std, device, generator))
        done.update(groups[name])
    return len(done)


def float_graph(snapshot: fx.GraphModule, factory: ModelFactory, device: torch.device) -> fx.GraphModule:
    """The quantize stage's snapshot of the canonical graph with the checkpoint's weights on ``device``: what
    calibration runs."""
    move_graph_to_device(snapshot, device)
    groups = _allocate_parameters(snapshot, device)
    load_checkpoint(snapshot, factory, factory.checkpoint_reader(), groups)
    restore_buffers(snapshot, factory, device)
    return snapshot


def restore_buffers(gm: fx.GraphModule, factory: ModelFactory, device: torch.device, reader=None) -> None:
    """Every buffer of the graph its value: a persistent one the checkpoint holds (``reader``; BART's
    ``final_logits_bias``) from there, the others as the model computes them when built (rotary tables)."""
    persistent = set(factory.meta_model.state_dict()) if reader is not None and factory.meta_model is not None else set()
    stored = set(reader.keys()) & persistent if persistent else set()
    for name, _ in list(gm.named_buffers()):
        key = name.removeprefix(GRAPH_PREFIX)
        value = reader.read(key) if key in stored else factory.buffers.get(key)
        if value is not None:
            _set_attribute(gm, name, value.to(device))
    on_meta = [n for n, t in list(gm.named_buffers()) + list(gm.named_parameters()) if t.is_meta]
    on_meta += [n for n, v in vars(gm).items() if isinstance(v, torch.Tensor) and v.is_meta]
    if on_meta:
        raise CheckpointError(f"graph tensors {on_meta[:4]} have no values after loading (no checkpoint entry, no buffer)")


def checkpoint_kv_cache_scales(reader: CheckpointReader | StateDictReader) -> dict[str, tuple[float, float]]:
    """A pre-quantized checkpoint's own fp8 KV cache scales, per attention module: compressed-tensors stores
    them as ``…self_attn.k_scale`` / ``v_scale``, ModelOpt as ``…self_attn.k_proj.k_scale`` / ``v_proj.v_scale``
    (a stored value times its scale is the value, as in our caches). Layers without them keep scale 1."""
    found: dict[str, dict[str, float]] = {}
    for key in reader.keys():
        owner, _, leaf = key.rpartition(".")
        if leaf not in ("k_scale", "v_scale"):
            continue
        attention = owner.removesuffix(".k_proj").removesuffix(".v_proj")
        value = reader.read(key).to(torch.float32)
        if value.numel() != 1 or not bool(value.isfinite().all()) or float(value) <= 0:
            raise CheckpointError(f"checkpoint tensor {key!r} is not one positive KV cache scale (shape {tuple(value.shape)})")
        found.setdefault(attention, {})[leaf] = float(value)
    return {path: (scales.get("k_scale", 1.0), scales.get("v_scale", 1.0)) for path, scales in found.items()}


@register_transform("load_weights", stage="load_weights", roles=ALL_ROLES)
class LoadWeights(Transform):
    """Materialise the graph on the target device from the checkpoint (or random values)."""

    def apply(self, gm: fx.GraphModule, context) -> TransformResult:
        settings = context.settings
        device = torch.device(settings.device)
        if device.type == "meta":
            return TransformResult(notes="device is meta: weights not loaded")
        factory: ModelFactory = context.model_factory
        moved = move_graph_to_device(gm, device)
        groups = _allocate_parameters(gm, device)
        quantized = context.quantized_weights  # the quantize stage's weights (transforms/quantize_linear.py)
        # A pre-quantized checkpoint's values are used as they are (the twin's weights are float).
        prequantized = factory.prequantized if factory.tensors is None and settings.weights == "checkpoint" else None
        statistics = None
        snapshot, context.calibration_graph = context.calibration_graph, None  # dropped: its float weights are the model's size
        calibrated = sorted({r.path for r in (quantized or {}).values() if r.scheme.calibrated})
        # An fp8 KV cache's per-layer scales come from the key and value projections' largest outputs,
        # when there are real weights to run (random weights, or a pre-quantized checkpoint: scale 1).
        key_values = kv_projections(factory.meta_model) if settings.quantize.kv_cache == "fp8" else []
        if prequantized is not None or (settings.weights == "random" and factory.tensors is None):
            key_values = []
        if (calibrated or key_values) and prequantized is None:
            hessians = sorted({r.path for r in (quantized or {}).values() if "hessian" in r.scheme.statistics})
            statistics = share_smoothing(calibrate(factory, settings, lambda on: float_graph(snapshot, factory, on),
                                                   calibrated, hessians, key_values),
                                         context.smoothing_groups)
            # o_proj: one s per value channel (the query heads sharing a key-value head), so fold_smoothing can
            # move it into v_proj; not with an fp8 KV cache, whose value scales are calibrated unscaled.
            if settings.quantize.kv_cache != "fp8":
                statistics = share_head_smoothing(statistics, context.head_smoothing)
            if key_values:
                context.kv_cache_scales = kv_cache_scales(statistics, key_values)
        if prequantized is not None and settings.quantize.kv_cache == "fp8":
            context.kv_cache_scales = checkpoint_kv_cache_scales(factory.checkpoint_reader())
        if settings.weights == "random":
            count = initialize_randomly(gm, factory, groups, settings.seed, quantized)
            notes = f"{count} random tensors"
        else:
            count = load_checkpoint(gm, factory, factory.checkpoint_reader(), groups, quantized, statistics, prequantized)
            notes = f"{count} tensors from {factory.source.directory.name}"
        restore_buffers(gm, factory, device, factory.checkpoint_reader() if settings.weights != "random" else None)
        return TransformResult(matches=count, changed=True, notes=f"{notes} on {device}; {moved} device args retargeted")
