"""Capture a model as a ``torch.fx.GraphModule`` of aten ops with ``torch.export``.

The causal-LM graph takes ``input_ids`` and ``position_ids`` of shape ``[batch, seq]`` (both
dimensions dynamic: one export serves every shape) and returns logits ``[batch, seq, vocab]``.
Models are exported on the meta device, so no weight memory is touched.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.fx import GraphModule

from autodeploy.deployment import EMBED, ENCODER, VISION
from autodeploy.errors import AutoDeployError, ExportError, error_summary
from autodeploy.export import patches
from autodeploy.export.causal_lm import CAUSAL_LM_INPUTS, CausalLMLogits
from autodeploy.export.encoder_only import EMBED_INPUTS, EncoderHiddenStates, SequenceScores
from autodeploy.export.encoder_decoder import ENCODER_DECODER_INPUTS, ENCODER_INPUTS, EncoderCrossKV, EncoderDecoderLogits
from autodeploy.export.patches import apply_export_patches
from autodeploy.export.vision_language import VISION_INPUTS, VISION_LANGUAGE_INPUTS, VisionFeatures, VisionLanguageLogits
from autodeploy.models.encoder_decoder import EncoderDecoderSpec
from autodeploy.models.vision_language import VisionLanguageSpec
from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformConfig, TransformResult, register_transform

logger = logging.getLogger(__name__)

@contextlib.contextmanager
def _module_call_stack(model: nn.Module, stack: list[str]) -> Iterator[None]:
    """Track which submodules are executing, so an export failure can name the innermost one."""

    def enter(name):
        return lambda module, args: stack.append(f"{name} ({type(module).__name__})")

    def leave(module, args, output):
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name or "<root>")))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _quiet_shape_logs() -> Iterator[None]:
    """On a data-dependent branch torch's symbolic-shape logger warns with the whole partial graph; the
    ExportError below says what failed and where, so that dump is only noise on the user's terminal."""
    shape_logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shape_logger.level
    shape_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        shape_logger.setLevel(level)


def _failing_source_line(error: BaseException) -> str:
    """The innermost traceback frame outside torch itself: usually the model line that broke export."""
    ours = {__file__, patches.__file__}  # this module and the export patches only pass the call on
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/torch/" not in f.filename and f.filename not in ours]
    if not frames:
        return ""
    frame = frames[-1]
    line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} `{line}`"


def export_to_graph_module(
    module: nn.Module,
    args: tuple,
    dynamic_shapes=None,
    patches: list[str] = (),
    strict: bool = False,
) -> GraphModule:
    """Export ``module`` and return the unlifted ``GraphModule`` (parameters as attributes).

    >>> gm = export_to_graph_module(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    """
    stack: list[str] = []
    try:
        with torch.no_grad(), apply_export_patches(module, list(patches)), _module_call_stack(module, stack), _quiet_shape_logs():
            program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=strict)
    except AutoDeployError:
        raise
    except Exception as error:  # torch.export raises many unrelated types; all mean "could not capture"
        where = stack[-1] if stack else type(module).__name__
        raise ExportError(
            f"torch.export failed in module {where}{_failing_source_line(error)}: {type(error).__name__}: "
            f"{error_summary(error)} — register an export patch for this code (autodeploy.export.register_export_patch) "
            f"and list it under transforms.export_to_fx.patches"
        ) from error
    gm = program.module()
    _refuse_valueless_constants(gm)
    return gm


def _refuse_valueless_constants(gm: GraphModule) -> None:
    """Tensors the model builds while it runs (not parameters or buffers) become graph constants; traced on
    the meta device they have no value, and a graph reading them would compute with garbage."""
    owned = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    valueless = [
        f"{path + '.' if path else ''}{name} ({value.dtype}, {list(value.shape)})"
        for path, module in gm.named_modules() for name, value in vars(module).items()
        if isinstance(value, torch.Tensor) and value.is_meta and id(value) not in owned
    ]
    if valueless:
        raise ExportError(
            f"the model creates tensor constants while it runs that export on the meta device captures without "
            f"their values: {', '.join(valueless[:4])}{' …' if len(valueless) > 4 else ''}. Register an export patch "
            f"that builds them another way (autodeploy.export.register_export_patch; see scalar_constants_on_cpu and "
            f"list_indices_as_slices) and list it under transforms.export_to_fx.patches"
        )


def export_causal_lm(
    model: nn.Module,
    max_num_tokens: int,
    max_seq_len: int,
    patches: list[str] = (),
    strict: bool = False,
    vision_language: VisionLanguageSpec | None = None,
) -> GraphModule:
    """Export a HF causal LM (usually on the meta device) with dynamic batch and sequence dims; with
    ``vision_language``, the language model of a vision-language model, taking image feature rows beside
    its tokens (``export/vision_language.py``)."""
    device = next(model.parameters()).device
    # DYNAMIC hints rather than named Dims: a guard that holds for every size but that a torch
    # release cannot prove (torch 2.11 cannot prove min(16*s, 32*s) == 16*s for HF's SDPA path)
    # becomes a runtime check instead of an export failure; the dims stay symbolic either way.
    # The served graph takes every scheduled token in one row ([1, tokens]), so the batch dim has no
    # useful bound, and the token dim can exceed one sequence's max_seq_len.
    batch = torch.export.Dim.DYNAMIC(min=1)
    seq = torch.export.Dim.DYNAMIC(min=1, max=max(max_seq_len, max_num_tokens, 2))
    # Example sizes above 1 so export does not specialise the dynamic dims to 1; real positions
    # (not zeros) because HF mask builders derive packed-sequence masks from them.
    input_ids = torch.zeros((2, 4), dtype=torch.long, device=device)
    position_ids = torch.arange(4, device=device).expand(2, 4)
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: seq})
    if vision_language is None:
        return export_to_graph_module(CausalLMLogits(model), (input_ids, position_ids), dynamic, patches, strict)
    # Image feature rows: any number a step (none in most), each the width of the language model's embeddings.
    rows = torch.export.Dim.DYNAMIC(min=0, max=max(max_seq_len, max_num_tokens, 2))
    width = model.get_input_embeddings().embedding_dim
    features = torch.zeros((3, width), dtype=next(model.parameters()).dtype, device=device)
    token_index = torch.arange(3, device=device)
    logits = VisionLanguageLogits(model, vision_language.image_token_id)
    return export_to_graph_module(logits, (input_ids, position_ids, features, token_index),
                                  (*dynamic, {0: rows}, {0: rows}), patches, strict)


def export_vision(model: nn.Module, spec: VisionLanguageSpec, max_images: int, patches: list[str] = (),
                  strict: bool = False) -> GraphModule:
    """Export a vision-language model's vision tower and projector (``VisionFeatures``), the image count dynamic."""
    parameter = next(model.parameters())
    images = torch.export.Dim.DYNAMIC(min=1, max=max(max_images, 2))
    pixel_values = torch.zeros((2, 3, spec.image_size, spec.image_size), dtype=parameter.dtype, device=parameter.device)
    return export_to_graph_module(VisionFeatures(model, spec), (pixel_values,), ({0: images},), patches, strict)


def export_encoder_decoder(model: nn.Module, spec: EncoderDecoderSpec, role: str, max_num_tokens: int, max_seq_len: int,
                           patches: list[str] = (), strict: bool = False) -> GraphModule:
    """Export an encoder–decoder's ``"encoder"`` graph (``EncoderCrossKV``: one request's input ids, ``[1, S]``) or
    its decoder as the ``"model"`` graph (``EncoderDecoderLogits``), every length dynamic."""
    device = next(model.parameters()).device
    batch = torch.export.Dim.DYNAMIC(min=1)
    longest_input = spec.max_source_positions or max_seq_len  # T5 embeds no positions: the intake's bound
    source = torch.export.Dim.DYNAMIC(min=1, max=max(longest_input, 2))
    input_ids = torch.zeros((2, 5), dtype=torch.long, device=device)
    if role == ENCODER:
        return export_to_graph_module(EncoderCrossKV(model, spec), (input_ids,), ({0: batch, 1: source},), patches, strict)
    tokens = torch.export.Dim.DYNAMIC(min=1, max=max(max_seq_len, max_num_tokens, 2))
    parameter = next(model.parameters())
    shape = (spec.num_layers, 2, 5, spec.num_heads, spec.head_dim)
    keys, values = (torch.zeros(shape, dtype=parameter.dtype, device=device) for _ in range(2))
    decoder_ids, positions = torch.zeros((2, 4), dtype=torch.long, device=device), torch.arange(4, device=device).expand(2, 4)
    return export_to_graph_module(EncoderDecoderLogits(model, spec), (decoder_ids, positions, keys, values),
                                  ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {1: batch, 2: source}, {1: batch, 2: source}),
                                  patches, strict)


def export_encoder_only(model: nn.Module, task: str, max_num_tokens: int, max_seq_len: int, patches: list[str] = (),
                        strict: bool = False) -> GraphModule:
    """Export an encoder-only model as the ``"embed"`` graph (``export/encoder_only.py``): ``EncoderHiddenStates``
    for an embedder, ``SequenceScores`` for a cross-encoder; texts packed into one row ``[1, T]``, T and the number of
    texts dynamic. T reaches the token budget, or one text of ``max_seq_len`` (a longer text runs alone)."""
    device = next(model.parameters()).device
    tokens = torch.export.Dim.DYNAMIC(min=1, max=max(max_num_tokens, max_seq_len, 3))
    starts = torch.export.Dim.DYNAMIC(min=2)
    input_ids = torch.zeros((1, 5), dtype=torch.long, device=device)
    # Positions as one text's: Hugging Face's causal masks read packed texts from positions that restart (a decoder
    # embedding model's mask would then depend on them); the packing is the cache stage's (pack_bidirectional_attention).
    position_ids = torch.arange(5, device=device)[None]
    token_type_ids = torch.zeros((1, 5), dtype=torch.long, device=device)
    seq_start = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    wrapper = SequenceScores(model) if task == "score" else EncoderHiddenStates(model)
    return export_to_graph_module(wrapper, (input_ids, position_ids, token_type_ids, seq_start),
                                  ({1: tokens}, {1: tokens}, {1: tokens}, {0: starts}), patches, strict)


@dataclass
class ExportConfig(TransformConfig):
    patches: list[str] = field(default_factory=lambda: [
        "hf_no_kv_cache", "hf_sdpa_attention", "hf_moe_batched_experts", "scalar_constants_on_cpu", "list_indices_as_slices",
    ])
    strict: bool = False


@register_transform("export_to_fx", stage="export", recompile=False, roles=ALL_ROLES)
class ExportToFX(Transform):
    """nn.Module (meta) → GraphModule of aten ops with dynamic batch and sequence dims."""

    config_class = ExportConfig

    def apply(self, module: nn.Module, context) -> TransformResult:
        settings = context.settings
        vision_language = context.model_factory.vision_language if context.model_factory is not None else None
        encoder_decoder = context.model_factory.encoder_decoder if context.model_factory is not None else None
        if context.role == EMBED:
            gm = export_encoder_only(module, context.model_factory.embedding.task, settings.scheduler.max_num_tokens,
                                     settings.max_seq_len, self.config.patches, self.config.strict)
            inputs = EMBED_INPUTS
        elif context.role == VISION:
            gm = export_vision(module, vision_language, settings.vision.max_images_per_batch, self.config.patches, self.config.strict)
            inputs = VISION_INPUTS
        elif encoder_decoder is not None:
            gm = export_encoder_decoder(module, encoder_decoder, context.role, settings.scheduler.max_num_tokens,
                                        settings.max_seq_len, self.config.patches, self.config.strict)
            inputs = ENCODER_INPUTS if context.role == ENCODER else ENCODER_DECODER_INPUTS
        else:
            gm = export_causal_lm(module, settings.scheduler.max_num_tokens, settings.max_seq_len, self.config.patches,
                                  self.config.strict, vision_language)
            inputs = CAUSAL_LM_INPUTS if vision_language is None else VISION_LANGUAGE_INPUTS
        context.graph_inputs = inputs
        return TransformResult(changed=True, module=gm, notes=f"inputs: {', '.join(inputs)}")
