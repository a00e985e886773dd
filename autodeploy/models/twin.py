"""The reduced twin of a model: the same architecture with fewer layers, a small vocabulary, short windows.

Build-time verification (``autodeploy/verification.py``) deploys the twin through the same pipeline
as the real model and compares it with Hugging Face. The twin keeps everything a transform or kernel
decides on — hidden size, heads, head dims, every distinct kind of decoder layer, activation, norm and
RoPE settings — and shrinks what only costs time:

- layers: the shortest prefix of the decoder layers that holds one of every distinct layer (a layer's
  kind is its modules' classes, parameter shapes and settings, e.g. sliding vs full attention, dense vs
  MoE); a prefix keeps every index-derived pattern (``decoder_sparse_step``, ``first_k_dense_replace``)
  valid, and per-layer lists in the config are cut to it;
- vocabulary: 512 tokens (special token ids above it are folded into it);
- sliding windows and attention chunks: at most 8 tokens, so short probes cross them;
- routed experts: ``2 × top_k`` (at least 4) when more, unless experts are routed in groups.

A model of at most ``FULL_SIZE_LIMIT`` parameters is its own twin (``reduced=False``): verifying it at
full size costs less than exporting a second, reduced graph, because the twin then shares the real
model's weight-independent stages (export, cleanup, match) and only gets other weights.

```python
from autodeploy.models.twin import twin_config
twin = twin_config(hf_config, meta_model)   # twin.summary: "1 of 32 layers, vocab 512 of 128256"
```
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

FULL_SIZE_LIMIT = 32_000_000  # parameters
TWIN_VOCAB = 512
TWIN_WINDOW = 8
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
_WINDOWS = ("sliding_window", "attention_chunk_size")


@dataclass
class TwinConfig:
    config: PretrainedConfig
    summary: str  # what was reduced, for reports and errors
    reduced: bool  # False: the model's own config (a small model is its own twin)


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList | None:
    """The model's list of decoder layers: the first ``ModuleList`` with one entry per layer."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and num_layers > 0:
            return module
    return None


def _settings(module: nn.Module) -> dict:
    return {
        key: value for key, value in vars(module).items()
        if not key.startswith("_") and key != "training" and isinstance(value, (bool, int, float, str, type(None)))
    }


def layer_kinds(layers: nn.ModuleList) -> list[tuple]:
    """One hashable kind per layer: its modules' classes, parameter shapes and scalar settings, without
    settings that just number the layer (``layer_idx`` and the like)."""
    described = []
    for layer in layers:
        modules = list(layer.named_modules())
        described.append([
            (name, type(module).__name__, tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)),
             _settings(module))
            for name, module in modules
        ])
    # A setting equal to the layer's index in every layer is a counter, not a kind.
    counters = set()
    for position in range(len(described[0]) if described else 0):
        keys = set.intersection(*(set(d[position][3]) for d in described if position < len(d)))
        for key in keys:
            if all(position < len(d) and d[position][3][key] == index for index, d in enumerate(described)):
                counters.add((position, key))
    kinds = []
    for d in described:
        kinds.append(tuple(
            (name, cls, params, tuple(sorted((k, v) for k, v in settings.items() if (position, k) not in counters)))
            for position, (name, cls, params, settings) in enumerate(d)
        ))
    return kinds


def _covering_prefix(kinds: list[tuple]) -> int:
    distinct = set(kinds)
    seen = set()
    for index, kind in enumerate(kinds):
        seen.add(kind)
        if seen == distinct:
            return index + 1
    return len(kinds)


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return getattr(config, "text_config", None) or config


def _layer_count(config: PretrainedConfig) -> int:
    return int(getattr(_text_config(config), "num_hidden_layers", 0) or 0)


def twin_config(config: PretrainedConfig, meta_model: nn.Module, layers_multiple_of: int = 1) -> TwinConfig:
    """The twin's config (see the module docstring) and a one-line summary of the reduction;
    ``meta_model`` is the model built from ``config`` (on the meta device). ``layers_multiple_of``: the twin
    keeps a multiple of this many layers (the pipeline stages, each of which needs whole layers)."""
    parameters = sum(p.numel() for p in meta_model.parameters())
    if parameters <= FULL_SIZE_LIMIT:
        return TwinConfig(config, f"full size, {parameters / 1e6:.1f}M parameters", reduced=False)
    text = _text_config(config)
    num_layers = _layer_count(config)
    changes: dict = {}
    notes = []
    layers = decoder_layers(meta_model, num_layers)
    if layers is not None:
        keep = _covering_prefix(layer_kinds(layers))
        keep = min(num_layers, -(-keep // layers_multiple_of) * layers_multiple_of)
        if keep < num_layers:
            changes["num_hidden_layers"] = keep
            for key, value in text.to_dict().items():
                if isinstance(value, list) and len(value) == num_layers:
                    changes[key] = value[:keep]
        notes.append(f"{keep} of {num_layers} layers")
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab > TWIN_VOCAB:
        changes["vocab_size"] = TWIN_VOCAB
        for key, value in text.to_dict().items():
            if key.endswith(("_token_id", "_token_ids")):
                changes[key] = _fold_token_ids(value)
        notes.append(f"vocab {TWIN_VOCAB} of {vocab}")
    for key in _WINDOWS:
        window = getattr(text, key, None)
        if isinstance(window, int) and window > TWIN_WINDOW:
            changes[key] = TWIN_WINDOW
            notes.append(f"{key} {TWIN_WINDOW} of {window}")
    top_k = getattr(text, "num_experts_per_tok", None)
    grouped = (getattr(text, "n_group", None) or 1) > 1
    for key in _EXPERT_COUNTS:
        experts = getattr(text, key, None)
        if isinstance(experts, int) and isinstance(top_k, int) and not grouped and experts > max(2 * top_k, 4):
            changes[key] = max(2 * top_k, 4)
    if any(key in changes for key in _EXPERT_COUNTS):  # some configs spell the count twice (an alias)
        count = next(changes[key] for key in _EXPERT_COUNTS if key in changes)
        notes.append(f"{count} of {next(getattr(text, key) for key in _EXPERT_COUNTS if key in changes)} experts")
    return TwinConfig(_with_changes(config, changes), ", ".join(notes) or "same size", reduced=True)


def routes_tokens(config: PretrainedConfig) -> bool:
    """Whether the model routes each token to a top-k of experts (an MoE)."""
    text = _text_config(config)
    return any(isinstance(getattr(text, key, None), int) and getattr(text, key) > 1 for key in _EXPERT_COUNTS)


def _fold_token_ids(value):
    if isinstance(value, int):
        return value % TWIN_VOCAB
    if isinstance(value, list):
        return [v % TWIN_VOCAB if isinstance(v, int) else v for v in value]
    return value


def _with_changes(config: PretrainedConfig, changes: dict) -> PretrainedConfig:
    """A new config with ``changes`` applied to the text model's settings, validated as a fresh one."""
    if getattr(config, "text_config", None) is not None:
        twin = copy.deepcopy(config)
        twin.text_config = _with_changes(config.text_config, changes)
        return twin
    values = {**config.to_dict(), **changes}
    return type(config).from_dict(values)
