"""Build-time verification: a deploy serves exactly the source model's function, or refuses.

Before the real model is built, its reduced twin (``autodeploy/models/twin.py``: the same architecture
with fewer layers and a small vocabulary) gets random weights, is deployed through the identical
pipeline, and is served by the runtime's own engine on a probe batch: several sequences of different
lengths (one of a single token) prefilled together in one mixed batch, then decoded a few tokens at a
time over the paged KV cache. Every position's logits are compared with the twin's Hugging Face eager
forward. The error is ``max |Δlogit| / max |logit|``; above ``verify.tolerance[dtype]`` the deploy is
refused with an ``UnsupportedModelError`` naming the first module whose output diverges (found by
comparing every module's output with the deployed graph's value for it) and what the match stage left
unmatched.

The twin runs on the deploy's device and dtype, so it exercises the kernels the real model will run; a
deploy on the meta device verifies on the CPU in float32, and so does a mixture-of-experts model in
half precision: with random weights its router logits are near ties, and half-precision rounding on
either side picks other experts for some tokens, which says nothing about the deploy. The twin's weights are rounded to the deploy
dtype and Hugging Face computes in float32 from the same rounded values, so the error measures the
deployed computation, not the rounding of weights.

```python
from autodeploy.verification import build_verified
graph, report = build_verified(pipeline, context)   # raises UnsupportedModelError on a mismatch
print(report)   # verified on a twin (1 of 32 layers, vocab 512 of 128256; cpu float32): max |Δlogit| 2e-06 …
```
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
import warnings

import torch
from omegaconf import DictConfig, OmegaConf
from torch import fx, nn
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM,
                          AutoModelForSequenceClassification)

from autodeploy.build_report import VerificationReport
from autodeploy.deployment import EMBED, ENCODER, MODEL, VISION, Deployment
from autodeploy.errors import UnsupportedModelError
from autodeploy.export.causal_lm import GRAPH_PREFIX
from autodeploy.export.encoder_only import takes_token_types
from autodeploy.models.factory import ModelFactory
from autodeploy.models.twin import routes_tokens, twin_config
from autodeploy.pipeline import Pipeline
from autodeploy.runtime.engine import Engine
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.step_inputs import build_step_inputs
from autodeploy.transforms.registry import TransformContext

logger = logging.getLogger(__name__)

# Probe sequences: (prompt length, decode steps). Prompts cross the twin's windows (≤ 8 tokens).
PROBES = ((1, 3), (6, 3), (13, 3), (29, 3))
_IMAGE_PROBE_TEXT = 7  # a vision-language twin's image prompt: 5 text and 2 boundary tokens around the image, at most
_TWIN_SEED = 1234


class _Probe:
    """A sequence fed to the twin's engine outside the scheduler; its ``request`` (an image probe's) carries side
    inputs, and the spans of its prompt that attend both ways."""

    _ids = itertools.count(-1_000_000, -1)

    def __init__(self, token_ids: list[int], request=None):
        self.seq_id = next(self._ids)
        self.token_ids = token_ids
        self.request = request


@dataclasses.dataclass
class _ImageProbe:
    """What ``step_inputs`` reads of a request: an image's feature rows at its placeholders."""

    prompt_token_ids: list[int]
    side_inputs: dict
    whole_spans: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass
class _EncoderProbe:
    """What the encoder pass and ``step_inputs`` read of an encoder–decoder's request: its input, its cross blocks."""

    request_id: str
    encoder_input_ids: list[int]
    cross_table: list[int] | None = None
    cross_len: int = 0
    side_inputs: dict = dataclasses.field(default_factory=dict)
    prompt_token_ids: tuple = ()


def twin_device_and_dtype(settings: DictConfig) -> tuple[str, str]:
    """Where the twin runs: the deploy's device and dtype; the CPU in float32 for a meta deploy."""
    if settings.device == "meta":
        return "cpu", "float32"
    return str(settings.device), str(settings.dtype)


def _twin_settings(settings: DictConfig, device: str, dtype: str, image_tokens: int = 0) -> DictConfig:
    """The twin's settings: the probes' batch and blocks (and, with ``image_tokens``, the image probe's)."""
    twin = OmegaConf.to_container(settings, resolve=True)
    probes = [*PROBES, *([(image_tokens + _IMAGE_PROBE_TEXT, 3)] if image_tokens else [])]
    twin.update(device=device, dtype=dtype, weights="checkpoint", max_batch_size=len(probes), dump_graphs=None)
    blocks = sum(-(-(length + steps) // settings.kv_cache.block_size) for length, steps in probes)
    twin["kv_cache"].update(num_blocks=blocks, prefix_caching=False)
    twin["verify"]["enabled"] = False
    twin["speculative"]["method"] = None  # the twin checks the graph's logits; a draft model is verified on its own
    return OmegaConf.create(twin)


def _reference_model(config, device: str, dtype: torch.dtype, trust_remote_code: bool, head_apart: bool = False,
                     model_class=None) -> nn.Module:
    """The twin in Hugging Face (eager attention, float32) with random weights rounded to ``dtype``.

    HF's own initialisation, then every 1-D parameter (norm scales, biases) is perturbed: HF starts
    those at exactly 1 or 0, which would hide a dropped bias or a mis-read norm offset. ``head_apart``: the deploy
    holds its LM head apart from the token embedding (a T5 checkpoint storing it, ``models/factory.py``) where HF builds
    the twin tied; the reference's head is then drawn afresh, so a head read from the embedding would differ.
    ``model_class``: the transformers auto class to build (by default the one the config's kind calls for)."""
    torch.manual_seed(_TWIN_SEED)
    if model_class is None:
        # A vision-language model's reference is the whole model: its language model's logits and its image features.
        model_class = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
        if getattr(config, "is_encoder_decoder", False) and getattr(config, "vision_config", None) is None:
            model_class = AutoModelForSeq2SeqLM  # an encoder–decoder's reference: the whole model, both stacks
    with torch.device(device):
        model = model_class.from_config(  # a copy: HF records the attention implementation in the config
            copy.deepcopy(config), dtype=torch.float32, attn_implementation="eager", trust_remote_code=trust_remote_code
        )
    generator = torch.Generator(device=device).manual_seed(_TWIN_SEED)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    with torch.no_grad():
        if head_apart and head is not None and head.weight is embedding.weight:
            drawn = torch.randn(head.weight.shape, generator=generator, device=device) * embedding.weight.std()
            head.weight = nn.Parameter(drawn)
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn(parameter.shape, generator=generator, device=device), alpha=0.1)
            parameter.copy_(parameter.to(dtype).float())
    return model.eval()


def _probe_tokens(vocab_size: int, seed: int = _TWIN_SEED) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length + steps,), generator=generator).tolist() for length, steps in PROBES]


@torch.inference_mode()
def served_logits(engine: Engine, sequences: list[list[int]], prompt_lengths: list[int],
                  requests=None) -> list[torch.Tensor]:
    """Every position's logits as the engine serves them: all prompts prefilled in one mixed batch, then
    the remaining tokens decoded one step at a time for every sequence together (``[len, vocab]`` each).
    ``requests``: what each sequence carries besides its tokens (an image probe's rows), or None."""
    probes = [_Probe(tokens, request) for tokens, request in zip(sequences, requests or [None] * len(sequences))]
    rows: list[list[torch.Tensor]] = [[] for _ in probes]
    try:
        for probe in probes:
            if not engine.pool.reserve(probe.seq_id, len(probe.token_ids)):
                raise RuntimeError("the verification KV pool is too small for the probe batch")
        done = [0] * len(probes)
        while any(done[i] < len(probe.token_ids) for i, probe in enumerate(probes)):
            planned = [
                (i, ScheduledChunk(probe, done[i], prompt_lengths[i] if done[i] == 0 else 1))
                for i, probe in enumerate(probes) if done[i] < len(probe.token_ids)
            ]
            # Multi-token chunks first, single-token chunks after them: the order the scheduler plans.
            planned.sort(key=lambda item: item[1].length == 1)
            owners, chunks = [i for i, _ in planned], [chunk for _, chunk in planned]
            logits, _ = engine.forward(chunks, logits_for_all_tokens=True)  # decode steps replay CUDA graphs
            offset = 0
            for chunk, owner in zip(chunks, owners):
                rows[owner].append(logits[offset : offset + chunk.length].float())
                offset += chunk.length
                done[owner] += chunk.length
    finally:
        for probe in probes:
            engine.pool.free(probe.seq_id)
    return [torch.cat(parts) for parts in rows]


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max |Δ|, max |Δ| / max |reference|); non-finite values and a shape other than the reference's count as infinitely
    wrong; two empty tensors agree."""
    if ours.shape != reference.shape or not torch.isfinite(ours).all():
        return float("inf"), float("inf")
    if ours.numel() == 0:
        return 0.0, 0.0
    error = (ours.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return error, error / scale if scale > 0 else (0.0 if error == 0 else float("inf"))


def _tensors(value) -> list[torch.Tensor]:
    """The tensors a module returned: itself, the tensors of a tuple, or a model output's logits."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    logits = getattr(value, "logits", None)
    return [logits] if isinstance(logits, torch.Tensor) else []


def _module_outputs(model: nn.Module, token_ids: list[int], **inputs) -> list[tuple[str, str, list[torch.Tensor]]]:
    """Every module's outputs for one sequence, in the order the modules finished: (path, class, tensors)."""
    finished: list[tuple[str, str, list[torch.Tensor]]] = []
    handles = []
    for path, module in model.named_modules():
        if not path:
            continue

        def hook(module, args, output, path=path):
            tensors = [t.detach().float() for t in _tensors(output)]
            if tensors:
                finished.append((path, type(module).__name__, tensors))

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            model(use_cache=False, **(inputs or {"input_ids": torch.tensor([token_ids], device=device)}))
    finally:
        for handle in handles:
            handle.remove()
    return finished


class _Recorder(fx.Interpreter):
    def __init__(self, graph_module: fx.GraphModule, wanted: set[fx.Node]):
        super().__init__(graph_module)
        self.wanted = wanted
        self.values: dict[fx.Node, torch.Tensor] = {}

    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        if node in self.wanted and isinstance(result, torch.Tensor):
            self.values[node] = result.detach().float()
        return result


def _module_paths(node: fx.Node) -> set[str]:
    # Export records paths under the CausalLMLogits wrapper's attribute ``model``; HF names them without it.
    return {path.removeprefix(GRAPH_PREFIX) for path, _ in node.meta.get("nn_module_stack", {}).values()
            if path.startswith(GRAPH_PREFIX)}


def module_output_nodes(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Module path (as HF names it) → the graph nodes that are its outputs: produced inside the module and
    used outside it (or by the graph's output)."""
    outputs: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        inside = _module_paths(node)
        for path in inside:
            if any(user.op == "output" or path not in _module_paths(user) for user in node.users):
                outputs.setdefault(path, []).append(node)
    return outputs


@torch.inference_mode()
def first_diverging_module(engine: Engine, reference: nn.Module, token_ids: list[int], tolerance: float,
                           request=None, hf_inputs=None) -> str | None:
    """The first module (in execution order) whose deployed output differs from Hugging Face's, as
    "path (Class): relative error"; None when every compared module agrees. ``request`` / ``hf_inputs``: an image
    probe's rows and mask, and Hugging Face's inputs for it."""
    expected = _module_outputs(reference, token_ids, **(hf_inputs or {}))
    outputs = module_output_nodes(engine.graph.graph)
    probe = _Probe(list(token_ids), request)
    if not engine.pool.reserve(probe.seq_id, len(token_ids)):
        return None
    try:
        inputs, _ = build_step_inputs(engine.graph_inputs, [ScheduledChunk(probe, 0, len(token_ids))], engine.pool,
                                      engine.caches, engine.device, logits_for_all_tokens=True,
                                      side_inputs=list(engine.runner.side_inputs.values()))
        recorder = _Recorder(engine.graph, {node for nodes in outputs.values() for node in nodes})
        recorder.run(*inputs)
    finally:
        engine.pool.free(probe.seq_id)
    for path, class_name, tensors in expected:
        ours = [recorder.values[n] for n in outputs.get(path, []) if n in recorder.values]
        for value in tensors:
            candidates = [v.reshape(value.shape) for v in ours if v.numel() == value.numel()]
            if not candidates:
                continue  # nothing of this shape leaves the module in the graph (fused away, or a different form)
            relative = min(_relative_error(v, value)[1] for v in candidates)
            if relative > tolerance:
                return f"{path} ({class_name}): relative error {relative:.2g}"
    return None


def _copied_graph(graph: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``graph``. The copy rebuilds the pytree specs of the graph's calling convention, and torch
    warns that its own ``LeafSpec`` is deprecated whenever one is built: that warning alone is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
        return copy.deepcopy(graph)


def build_verified(pipeline: Pipeline, context: TransformContext, dump_dir=None) -> tuple[nn.Module, VerificationReport]:
    """Build the model with ``pipeline``, verifying its twin first; returns (graph, report).

    A small model is its own twin: the weight-independent stages (up to ``load_weights``) run once and
    the twin continues from a copy of their graph. A larger model's reduced twin runs the whole
    pipeline by itself. Either way the twin is compared before the real weights are loaded."""
    settings, factory = context.settings, context.model_factory
    began = time.perf_counter()
    device, dtype = twin_device_and_dtype(settings)
    meta_model = factory.build_meta_model(getattr(torch, settings.dtype))
    twin = twin_config(factory.hf_config, meta_model, layers_multiple_of=int(settings.distributed.pipeline_parallel))
    note = ""
    if dtype in ("bfloat16", "float16") and routes_tokens(twin.config):
        dtype, note = "float32", f"compared in float32, not {dtype}: half-precision rounding flips near-tied expert choices"
    head = meta_model.get_output_embeddings()
    head_apart = head is not None and head.weight is not meta_model.get_input_embeddings().weight
    reference = _reference_model(twin.config, device, getattr(torch, dtype), factory.trust_remote_code, head_apart)
    tensors = {name: p.detach().to(getattr(torch, dtype)) for name, p in reference.named_parameters()}
    twin_settings = _twin_settings(settings, device, dtype, _image_tokens_bound(twin.config))
    twin_pipeline = Pipeline(pipeline.transforms)
    weights_at = pipeline.first_index_of_stage("load_weights")
    shared = not twin.reduced and (device, dtype) == (str(settings.device), str(settings.dtype))
    if shared:
        prefix_began = time.perf_counter()
        prefix = pipeline.run(context, dump_dir=dump_dir, stop=weights_at)
        began += time.perf_counter() - prefix_began  # the real build's share, not verification's
        # What the stages before load_weights handed on; the twin's own passes fill the rest of its context.
        twin_context = TransformContext(
            twin_settings, dataclasses.replace(factory, tensors=tensors), context.graph_inputs, context.kv_caches,
            quantized_weights=context.quantized_weights, smoothing_groups=context.smoothing_groups,
            head_smoothing=context.head_smoothing, calibration_graph=context.calibration_graph)
        twin_graph = twin_pipeline.run(twin_context, _copied_graph(prefix), start=weights_at)
        match_notes = _match_notes(pipeline.records)
    else:
        twin_factory = ModelFactory(factory.source, twin.config, factory.trust_remote_code, tensors=tensors)
        twin_context = TransformContext(settings=twin_settings, model_factory=twin_factory)
        twin_graph = twin_pipeline.run(twin_context)
        match_notes = _match_notes(twin_pipeline.records)
    built = [(twin_context, twin_graph)]
    encoder_graph = None
    if factory.encoder_decoder is not None:  # the twin's encoder graph too: the decoder's probes read its output
        twin_encoder = TransformContext(twin_settings, dataclasses.replace(twin_context.model_factory, tensors=tensors), role=ENCODER)
        encoder_graph = Pipeline(pipeline.transforms).run(twin_encoder)
        built.append((twin_encoder, encoder_graph))
    rounding = None
    for built_context, built_graph in built:  # each graph's quantized weights, as that graph stores them
        rounding = _quantize_like_the_deploy(reference, built_context.quantized_weights, built_graph,
                                             built_context.concatenated_parameters, built_context.folded_smoothing, rounding)
    if settings.quantize.kv_cache == "fp8":
        rounding = rounding or _ActivationRounding()
        if not _round_keys_and_values(reference, rounding, twin_context.kv_cache_scales):
            note = "; ".join(filter(None, [note, "fp8 KV cache: the reference's k and v are not rounded (no k_proj/v_proj "
                                                 "modules to hook)"]))
    tolerance = float(settings.verify.tolerance[dtype])
    if rounding is not None:
        # Rounding activations (fp8, or int8 after smoothing) with per-token scales, or keys and values to an fp8
        # cache, makes any two correct implementations differ by about the rounding's own effect
        # (_rounding_effect): the deploy is held to twice that.
        effect = _rounding_effect(reference, rounding, twin.config.get_text_config().vocab_size, device)
        tolerance = max(tolerance, float(settings.verify.quantized_activations_tolerance), 2 * effect)
        note = "; ".join(filter(None, [note, f"quantized {' and '.join(sorted(rounding.kinds))}: tolerance {tolerance:.3g} "
                                              f"(2× their rounding's effect on the reference, {effect:.3g})"]))
    report = _compare(factory, twin, reference, twin_graph, twin_context, match_notes, settings, device, dtype, began,
                      tolerance, encoder_graph)
    report.note = note
    if factory.vision_language is not None:
        twin_vision = TransformContext(twin_settings, dataclasses.replace(twin_context.model_factory, tensors=tensors), role=VISION)
        report.vision_relative_error = _compare_vision(factory, twin.summary, reference, Pipeline(pipeline.transforms).run(twin_vision),
                                                       device, dtype, tolerance)
    graph = pipeline.run(context, prefix, dump_dir, start=weights_at) if shared else pipeline.run(context, dump_dir=dump_dir)
    return graph, report


def _compare_vision(factory, twin: str, reference: nn.Module, graph: fx.GraphModule, device: str, dtype: str,
                    tolerance: float) -> float:
    """Hold the twin's vision graph to Hugging Face's ``get_image_features`` on two random images; the relative error."""
    spec = factory.vision_language
    generator = torch.Generator().manual_seed(_TWIN_SEED)
    pixels = torch.randn((2, 3, spec.image_size, spec.image_size), generator=generator).to(device, getattr(torch, dtype))
    with torch.no_grad():
        expected = torch.stack(list(reference.model.get_image_features(pixel_values=pixels.float()).pooler_output))
        ours = graph(pixels)
        ours = ours[0] if isinstance(ours, (tuple, list)) else ours
    if ours.shape != expected.shape:
        raise UnsupportedModelError(f"{factory.source.name}: the deployed vision graph makes image features {tuple(ours.shape)}; "
                                    f"Hugging Face makes {tuple(expected.shape)} (on a twin: {twin})")
    error, relative = _relative_error(ours.float().flatten(0, 1), expected.float().flatten(0, 1))
    if not relative <= tolerance:
        raise UnsupportedModelError(
            f"{factory.source.name}: the deployed vision tower does not compute what Hugging Face computes — on a twin "
            f"({twin}; {device} {dtype}) its image features differ by max {error:.3g} (relative {relative:.2g} > tolerance "
            f"{tolerance:.3g}). Please report it; verify.enabled=false deploys it anyway, unverified")
    return relative


def _stored(graph: fx.GraphModule, target: str, moved: dict[str, tuple[str, int, int]],
            folded: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor the quantize stage named ``target``, or its rows in the concatenation ``fuse_gemms`` moved it
    to, or the smoothing ``fold_smoothing`` moved out of the graph."""
    if target in folded:
        return folded[target]
    if target not in moved:
        return graph.get_parameter(target)
    fused, first, rows = moved[target]
    return graph.get_parameter(fused).narrow(0, first, rows)


def _quantize_like_the_deploy(reference: nn.Module, quantized: dict, graph: fx.GraphModule,
                              moved: dict[str, tuple[str, int, int]], folded: dict[str, torch.Tensor],
                              rounding: _ActivationRounding | None = None) -> _ActivationRounding | None:
    """Give the Hugging Face reference the rounding the quantize stage chose: each quantized weight replaced
    by the value the deployed ``graph``'s stored tensors dequantize to, and fp8 and smoothquant layers'
    inputs rounded per token as their ops round them. The comparison then holds the deploy to the quantized model's function
    at the usual tolerance, instead of loosening it by the quantization error. Under expert parallelism a rank stores
    only its share of a layer's experts: the reference's experts are quantized whole with the same scheme, which
    is what the ranks hold between them (every expert has its own scales, so quantizing E/N experts or all E
    gives each expert the same values). ``rounding``: the hooks an earlier graph's layers put on the reference, which
    this graph's join."""
    from autodeploy.custom_ops.quantized_linear import dequantize_weight, quantize_weight

    for record in quantized.values():
        name = record.source.removeprefix(GRAPH_PREFIX)
        parameter = reference.get_parameter(name)
        if len(record.shape) == 3 and record.shape[0] < parameter.shape[0]:  # this rank's experts: E/N of them
            stored = quantize_weight(record.scheme, parameter.detach())
        else:
            stored = {role: _stored(graph, target, moved, folded).detach().to(parameter.device)
                      for role, target in record.targets.items()}
        with torch.no_grad():
            parameter.data = dequantize_weight(record.scheme, stored, torch.float32).to(parameter.dtype)
        round_input = record.scheme.method.round_input(record.scheme, stored)
        if round_input is not None:  # the scheme's op rounds its input too (fp8, smoothquant)
            owner = reference.get_submodule(name.rpartition(".")[0])
            rounding = rounding or _ActivationRounding()
            owner.register_forward_pre_hook(rounding.hook(round_input))
    return rounding


class _ActivationRounding:
    """Hooks that round a layer's input per token as its op does (fp8, or int8 after smoothing), or a key or
    value projection's output as an fp8 KV cache stores it; switchable together, so the reference can also
    be run unrounded."""

    enabled = True

    def __init__(self):
        self.kinds: set[str] = set()  # what is rounded: "activations", "KV cache"

    def hook(self, round_input):
        """The pre-hook of one layer whose op rounds its input as ``round_input`` does (its scheme's
        ``QuantMethod.round_input``: ``smoothquant`` rounds ``x · smooth`` to int8, ``fp8`` to e4m3 with a scale
        per token or the layer's static ``input_scale``)."""
        self.kinds.add("activations")

        def pre_hook(module, args):
            return (round_input(args[0]), *args[1:]) if self.enabled else None

        return pre_hook

    def output_hook(self, dtype: torch.dtype, scale: float):
        """A forward hook that rounds a module's output as a KV cache of ``dtype`` with ``scale`` stores it."""
        from autodeploy.custom_ops.cached_attention import read_back, to_cache_dtype

        self.kinds.add("KV cache")

        def round_output(module, args, output):
            return read_back(to_cache_dtype(output.to(torch.float32) / scale, dtype), output.dtype, scale) if self.enabled else None

        return round_output


def _round_keys_and_values(reference: nn.Module, rounding: _ActivationRounding, scales: dict[str, tuple[float, float]]) -> int:
    """Round the outputs of the reference's key and value projections as an fp8 KV cache stores them, with
    the twin's calibrated ``scales`` (per attention module); the number of projections hooked. The cache
    rounds the keys after RoPE, the hook before it: the two differ by about the rounding's own effect,
    which the tolerance allows twice over."""
    hooked = 0
    for name, module in reference.named_modules():
        attention, _, leaf = name.rpartition(".")
        if leaf in ("k_proj", "v_proj") and isinstance(module, nn.Linear):
            k_scale, v_scale = scales.get(attention, (1.0, 1.0))
            module.register_forward_hook(rounding.output_hook(torch.float8_e4m3fn, k_scale if leaf == "k_proj" else v_scale))
            hooked += 1
    return hooked


def _rounding_effect(reference: nn.Module, rounding: _ActivationRounding, vocab: int, device) -> float:
    """How far rounding the fp8 layers' activations moves the reference's logits (max relative error over
    the probes). Per-token scales follow each token's max |x|, so a last-bit difference upstream shifts the
    whole rounding grid of a token: two correct implementations differ by about the rounding's own effect."""
    worst = 0.0
    with torch.no_grad():
        for tokens in _probe_tokens(vocab):
            ids = torch.tensor([tokens], device=device)
            rounding.enabled = False
            unrounded = reference(input_ids=ids, use_cache=False).logits[0]
            rounding.enabled = True
            _, relative = _relative_error(unrounded, reference(input_ids=ids, use_cache=False).logits[0])
            worst = max(worst, relative)
    return worst


def _match_notes(records) -> str:
    return next((r.notes for r in records if r.name == "match_report"), "")


def _compare(factory, twin, reference, graph, context, match_notes, settings, device, dtype, began,
             tolerance: float, encoder_graph=None) -> VerificationReport:
    """Serve the probe batch on the twin's graph and hold it to Hugging Face's logits."""
    if not context.kv_caches:
        raise UnsupportedModelError(
            "verification needs the served graph (the insert_cached_attention transform is disabled); enable it, "
            "or set verify.enabled=false to deploy an unserved graph unverified"
        )
    vocab = twin.config.get_text_config().vocab_size
    graphs = {MODEL: graph} if encoder_graph is None else {MODEL: graph, ENCODER: encoder_graph}
    start = factory.encoder_decoder.decoder_start_token_id if encoder_graph is not None else None
    engine = Engine(Deployment(graphs, context.serving_signature(), context.settings, decoder_start_token_id=start),
                    check_logits=False)
    sequences = _probe_tokens(vocab)
    lengths, requests, hf_inputs = [length for length, _ in PROBES], [None] * len(PROBES), [{} for _ in PROBES]
    if encoder_graph is not None:  # each probe's decoder starts with the start token and reads an input of its own
        sequences = [[start, *tokens[1:]] for tokens in sequences]
        requests = [_EncoderProbe(f"verification-{i}", tokens) for i, tokens in enumerate(_probe_tokens(vocab, seed=_TWIN_SEED + 1))]
        hf_inputs = [{"input_ids": torch.tensor([r.encoder_input_ids], device=device),
                      "decoder_input_ids": torch.tensor([tokens], device=device)} for r, tokens in zip(requests, sequences)]
        engine.encoder.encode(requests)
    if factory.vision_language is not None:  # and a prompt with an image: its rows at the placeholders, their mask
        tokens, length, request, inputs = _image_probe(factory.vision_language, reference, vocab, device, dtype)
        sequences, lengths = [*sequences, tokens], [*lengths, length]
        requests, hf_inputs = [*requests, request], [*hf_inputs, inputs]
    ours = served_logits(engine, sequences, lengths, requests)
    worst = (0.0, 0.0, 0)
    with torch.no_grad():
        for index, tokens in enumerate(sequences):
            inputs = hf_inputs[index] or {"input_ids": torch.tensor([tokens], device=device)}
            expected = reference(use_cache=False, **inputs).logits[0]
            error, relative = _relative_error(ours[index], expected)
            if not relative <= worst[1]:
                worst = (error, relative, index)
    error, relative, index = worst
    if not relative <= tolerance:
        module = first_diverging_module(engine, reference, sequences[index], tolerance, requests[index],
                                        hf_inputs[index])
        raise UnsupportedModelError(_mismatch_message(factory, twin.summary, device, dtype, error, relative, tolerance,
                                                      module, match_notes))
    return VerificationReport(twin.summary, device, dtype, error, relative, tolerance, time.perf_counter() - began)


def build_verified_embedder(pipeline: Pipeline, context: TransformContext, dump_dir=None) -> tuple[nn.Module, VerificationReport]:
    """Build an encoder-only model's ``"embed"`` graph with ``pipeline``, verifying its twin first; returns (graph, report).

    The twin's probe texts (the decoders' probe lengths, 1 to 29 tokens; a cross-encoder's with a second segment of
    token type 1 where the model reads token types) run packed into one row through the twin's graph, and every
    text's rows are held to Hugging Face's for that text alone: the last hidden state of an embedder (what every
    pooling reads), the classifier's logit of a cross-encoder."""
    settings, factory = context.settings, context.model_factory
    began = time.perf_counter()
    device, dtype = twin_device_and_dtype(settings)
    task = factory.embedding.task
    meta_model = factory.build_meta_model(getattr(torch, settings.dtype))
    twin = twin_config(factory.hf_config, meta_model)
    model_class = AutoModelForSequenceClassification if task == "score" else AutoModel
    reference = _reference_model(twin.config, device, getattr(torch, dtype), factory.trust_remote_code, model_class=model_class)
    tensors = {name: p.detach().to(getattr(torch, dtype)) for name, p in reference.named_parameters()}
    twin_settings = _twin_settings(settings, device, dtype)
    twin_factory = ModelFactory(factory.source, twin.config, factory.trust_remote_code, tensors=tensors)
    twin_context = TransformContext(settings=twin_settings, model_factory=twin_factory, role=EMBED)
    twin_graph = Pipeline(pipeline.transforms).run(twin_context)
    texts = _embedding_probes(twin.config)
    types = [[0] * len(tokens) if task == "embed" or getattr(twin.config, "type_vocab_size", 1) < 2
             else [0] * (len(tokens) // 2) + [1] * (len(tokens) - len(tokens) // 2) for tokens in texts]
    ours = _packed_rows(twin_graph, texts, types, device)
    worst = (0.0, 0.0)
    with torch.no_grad():
        for index, tokens in enumerate(texts):
            typed = {"token_type_ids": torch.tensor([types[index]], device=device)} if takes_token_types(reference) else {}
            out = reference(input_ids=torch.tensor([tokens], device=device), **typed)
            expected = out.logits[0] if task == "score" else out.last_hidden_state[0]
            error, relative = _relative_error(ours[index], expected)
            if not relative <= worst[1]:
                worst = (error, relative)
    error, relative = worst
    tolerance = float(settings.verify.tolerance[dtype])
    compared = "score logit" if task == "score" else "hidden state"
    if not relative <= tolerance:
        raise UnsupportedModelError(_mismatch_message(factory, twin.summary, device, dtype, error, relative, tolerance, None,
                                                      _match_notes(pipeline.records)).replace("logit", compared))
    report = VerificationReport(twin.summary, device, dtype, error, relative, tolerance, time.perf_counter() - began,
                                compared=compared)
    return pipeline.run(context, dump_dir=dump_dir), report


def _embedding_probes(config) -> list[list[int]]:
    """The probe texts: the decoders' probe lengths, with token ids that are not the padding id (RoBERTa-style
    embeddings number a padding token's position apart)."""
    padding = getattr(config, "pad_token_id", None)
    texts = _probe_tokens(config.vocab_size)
    return [[token if token != padding else (token + 1) % config.vocab_size for token in tokens] for tokens in texts]


@torch.inference_mode()
def _packed_rows(graph: fx.GraphModule, texts: list[list[int]], types: list[list[int]], device: str) -> list[torch.Tensor]:
    """Each text's rows of ``graph`` run over all ``texts`` packed into one row: its hidden states ``[len, H]`` (an
    embedder) or its logits ``[1]`` (a cross-encoder)."""
    lengths = [len(tokens) for tokens in texts]
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    positions = torch.cat([torch.arange(length) for length in lengths])
    inputs = [torch.tensor([[t for tokens in texts for t in tokens]]), positions[None],
              torch.tensor([[t for row in types for t in row]]), starts]
    out = graph(*[tensor.to(device) for tensor in inputs])
    out = out[0] if isinstance(out, (tuple, list)) else out
    if out.dim() == 2:  # [N, 1]: a cross-encoder's logits
        return list(out)
    return [out[0, int(starts[i]):int(starts[i + 1])] for i in range(len(texts))]


def _image_tokens_bound(config) -> int:
    """At most how many placeholders an image of a vision-language ``config`` takes (its tower's patches and a class
    token); 0 for a text-only model."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return 0
    return (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1


def _image_probe(spec, reference: nn.Module, vocab: int, device: str, dtype: str):
    """A prompt of random text around one image's placeholders (between its boundary tokens where the model has them),
    then 3 decode steps: its tokens, its prompt's length, what the served sequence carries (the image's feature rows as
    Hugging Face makes them, which placeholders attend both ways) and Hugging Face's extra inputs for it."""
    from autodeploy.runtime.request import TokenRows
    from autodeploy.runtime.vision_encoder import IMAGE_FEATURES

    generator = torch.Generator().manual_seed(_TWIN_SEED + 1)
    pixels = torch.randn((1, 3, spec.image_size, spec.image_size), generator=generator).to(device)
    with torch.no_grad():
        rows = reference.model.get_image_features(pixel_values=pixels).pooler_output
    rows = torch.cat(list(rows)).to(getattr(torch, dtype))
    special = {spec.image_token_id, *(spec.boundary_token_ids or ())}
    text = [t for t in torch.randint(0, vocab, (16,), generator=generator).tolist() if t not in special][:8]
    start, end = spec.boundary_token_ids or (None, None)
    if start is not None and max(start, end) >= vocab:  # a reduced twin's vocabulary: ordinary text around the image
        start = end = None
    before, after = text[:2] + ([start] if start is not None else []), ([end] if end is not None else []) + text[2:4]
    prompt = [*before, *[spec.image_token_id] * len(rows), *after, text[4]]
    tokens = [*prompt, *text[5:8]]  # then 3 decode steps, as every probe has
    first = len(before)
    spans = ((first, first + len(rows)),) if spec.bidirectional_images else ()
    positions = tuple(range(first, first + len(rows)))
    request = _ImageProbe(prompt, {IMAGE_FEATURES: TokenRows(positions, rows)}, spans)
    # Hugging Face's inputs: the embeddings with the rows in place, as its forward makes them from pixel values (a
    # reduced twin's placeholder may lie outside its vocabulary, which LLaVA's forward would index).
    ids = torch.tensor([tokens], device=device)
    with torch.no_grad():
        embeds = reference.get_input_embeddings()(ids.masked_fill(ids == spec.image_token_id, 0))
    embeds[0, list(positions)] = rows.to(device, embeds.dtype)
    inputs = {"inputs_embeds": embeds}
    if spec.bidirectional_images:
        inputs["token_type_ids"] = (ids == spec.image_token_id).long()
    return tokens, len(prompt), request, inputs


def _mismatch_message(factory, twin, device, dtype, error, relative, tolerance, module, report: str) -> str:
    model_type = getattr(factory.hf_config, "model_type", "?")
    what = "non-finite logits" if error == float("inf") else f"max |Δlogit| {error:.3g} (relative {relative:.2g} > tolerance {tolerance:.3g} for {dtype})"
    unmatched = report.split(" — unmatched: ", 1)[1] if " — unmatched: " in report else "nothing"
    where = f"first diverging module: {module}" if module else "no single module diverges (the difference builds up over the model)"
    return (
        f"{factory.source.name}: the deployed {model_type} model does not compute what Hugging Face computes — on a "
        f"twin ({twin}; {device} {dtype}) it gives {what}; {where}; unmatched by the match stage: {unmatched}. "
        f"This architecture or configuration is not supported yet: please report it. verify.enabled=false deploys it "
        f"anyway, unverified"
    )
