"""The ``eagle3`` drafter: an EAGLE-3 head drafts from the model's own hidden states.

An EAGLE-3 head is one decoder layer beside the model. Its input at position ``t`` is the model's hidden
states entering a low, a middle and a high layer at ``t`` (concatenated, then fused by ``fc`` to one hidden
width), and the embedding of token ``t + 1``; the layer's attention reads ``[norm(embedding); norm(hidden)]``
(twice the width) and the head's own keys and values of the positions before; its output, through ``norm`` and
``lm_head`` over a reduced draft vocabulary (``d2t`` maps a draft id to the model's: ``id + d2t[id]``),
predicts token ``t + 2``. Drafting a chain feeds the head's own output back as the next position's hidden
state (no ``fc``), with the token it just drafted.

The checkpoint is the public EAGLE-3 format (a folder with ``config.json`` and ``model.safetensors`` or
``pytorch_model.bin``): ``fc``, ``midlayer.{hidden_norm, input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``, ``lm_head``, ``d2t`` (optional with a full draft
vocabulary) and ``embed_tokens`` (optional: the model's embedding otherwise). The layers it reads come from
``eagle_config.eagle_aux_hidden_state_layer_ids`` in its config, else ``(2, L // 2, L − 3)`` of an
``L``-layer model. ``transforms/expose_hidden_states.py`` makes the model's graph copy those hidden states out
each step; ``HeadDrafter.observe`` keeps the rows of each sequence's new positions until its next draft (and of a
prefix-cache hit's cached positions, from its ``HiddenStateStore``).

The layer, its cache and the drafter that feeds it are shared with ``mtp`` (``runtime/hidden_state_heads.py``).

    drafter = make_drafter(deployment, settings)  # settings.method == "eagle3", settings.model: the head's folder
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from autodeploy.errors import ConfigError
from autodeploy.runtime.hidden_state_heads import (MLP, Attention, HeadDrafter, HiddenStateHead, LayerShape,
                                                   RMSNorm, graph_embedding, make_rotary, torch_dtype)
from autodeploy.runtime.speculative import HIDDEN_STATE_LAYERS, register_drafter

logger = logging.getLogger(__name__)

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class Eagle3Config(LayerShape):
    """What the head's ``config.json`` says, and the layers it reads."""

    draft_vocab_size: int = 0
    target_hidden_size: int = 0
    layers: tuple[int, ...] | None = None  # None: the default for the model's depth

    @classmethod
    def read(cls, folder: str | Path) -> Eagle3Config:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"speculative.model={str(folder)!r} has no config.json: point it at an EAGLE-3 head's folder "
                              f"(config.json and model.safetensors)")
        return cls.from_dict(json.loads(path.read_text()), str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "the EAGLE-3 config") -> Eagle3Config:
        path = where
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in raw]
        if missing:
            raise ConfigError(f"{path} is not an EAGLE-3 head's config: it lacks {missing}")
        heads = raw["num_attention_heads"]
        layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            layers=tuple(layers) if layers else None,
            raw=raw,
        )

    def read_layers(self, num_layers: int) -> list[int]:
        """The model layers whose entering hidden states the head reads."""
        return list(self.layers) if self.layers else [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 1)]


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, 2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class Eagle3Head(HiddenStateHead):
    """The head's weights (named as the EAGLE-3 format names them) and how its layer's input is made."""

    def __init__(self, config: Eagle3Config, num_target_layers: int):
        super().__init__()
        c = self.config = self.shape = config
        self.layers = config.read_layers(num_target_layers)
        self.model_width = len(self.layers) * c.target_hidden_size
        self.fc = nn.Linear(self.model_width, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.rotary = make_rotary(c, c.raw)

    def layer_input(self, hidden: torch.Tensor, embedded: torch.Tensor, from_model: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``[input_layernorm(embedding); hidden_norm(x)]``, ``x`` the model's layers fused by ``fc`` or the head's own."""
        layer = self.midlayer
        x = self.fc(hidden) if from_model else hidden
        return torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(x)], dim=-1), x

    def block(self):
        return self.midlayer.self_attn, self.midlayer.mlp, self.midlayer.post_attention_layernorm

    target_ids: torch.Tensor | None = None  # fuse: the model's id of each draft id (one gather instead of two ops)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The model's token ids of draft-vocabulary ids."""
        if self.target_ids is not None:
            return self.target_ids[draft_ids]
        return draft_ids + self.d2t[draft_ids]

    def fuse(self) -> Eagle3Head:
        super().fuse()
        self.target_ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of output hidden states."""
        return self.lm_head(self.norm(hidden))

def load_eagle3_head(folder: str | Path, num_target_layers: int, target_hidden_size: int, target_vocab_size: int,
                     target_embedding: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> Eagle3Head:
    """The head in ``folder``, checked against the model it drafts for; a ``ConfigError`` naming what does not fit."""
    config = Eagle3Config.read(folder)
    if config.target_hidden_size != target_hidden_size:
        raise ConfigError(f"the EAGLE-3 head in {folder} was trained for hidden size {config.target_hidden_size}; this "
                          f"model's is {target_hidden_size}: use a head trained for this model")
    if config.vocab_size != target_vocab_size:
        raise ConfigError(f"the EAGLE-3 head in {folder} has vocabulary {config.vocab_size}; this model's is "
                          f"{target_vocab_size}: use a head trained for this model (and its tokenizer)")
    layers = config.read_layers(num_target_layers)
    if any(not 1 <= layer < num_target_layers for layer in layers):
        raise ConfigError(f"the EAGLE-3 head in {folder} reads layers {layers}; this model has {num_target_layers} "
                          f"(1 … {num_target_layers - 1} can be read): use a head trained for this model")
    state = _read_weights(Path(folder))
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise ConfigError(f"the EAGLE-3 head in {folder} has a draft vocabulary of {config.draft_vocab_size} tokens "
                              f"but no d2t map to the model's {config.vocab_size}")
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "embed_tokens.weight" not in state:
        if target_embedding is None:
            raise ConfigError(f"the EAGLE-3 head in {folder} has no embed_tokens and the model's embedding is not a plain "
                              f"tensor (quantized?): save the embedding with the head")
        state["embed_tokens.weight"] = target_embedding
    state.pop("t2d", None)
    with torch.device("meta"):
        head = Eagle3Head(config, num_target_layers)
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    wrong = {name: (tuple(state[name].shape), shape) for name, shape in expected.items() if name in state
             and tuple(state[name].shape) != shape}
    missing = sorted(set(expected) - set(state))
    if missing or wrong:
        raise ConfigError(f"the EAGLE-3 head in {folder} does not match its config.json: missing {missing[:6]}, shapes "
                          f"{dict(list(wrong.items())[:4])} (checkpoint, expected)")
    head = Eagle3Head(config, num_target_layers)
    head.load_state_dict({name: state[name] for name in expected}, strict=True)
    return head.placed(device, dtype)


def eagle3_config(target_config, draft_vocab_size: int | None = None, layers: list[int] | None = None,
                  intermediate_size: int | None = None) -> dict:
    """An EAGLE-3 head's ``config.json`` for the model of HF config ``target_config`` (its width, heads and rope)."""
    t = target_config
    heads = t.num_attention_heads
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": t.hidden_size,
        "intermediate_size": intermediate_size or t.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", None) or heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": getattr(t, "rms_norm_eps", 1e-6),
        "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_vocab_size or t.vocab_size,
        "target_hidden_size": t.hidden_size,
        "max_position_embeddings": t.max_position_embeddings,
    }
    rope = getattr(t, "rope_parameters", None) or {}
    config["rope_theta"] = rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = dict(rope)
    if layers:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    return config


def save_eagle3_head(head: Eagle3Head, folder: str | Path, with_embedding: bool = False) -> Path:
    """Write ``head`` in the EAGLE-3 format (``config.json``, ``model.safetensors``); the embedding only when asked
    (the model's is used otherwise)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head.config.raw, indent=2))
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()
             if not name.startswith("rotary.") and (with_embedding or name != "embed_tokens.weight")}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
    raise ConfigError(f"the EAGLE-3 head in {folder} has none of {list(_WEIGHT_FILES)}")


def _eagle3_layers(settings, num_layers: int) -> list[int]:
    settings = settings.speculative
    if not settings.model:
        raise ConfigError("speculative.method is 'eagle3' but speculative.model names no head: set it to an EAGLE-3 "
                          "head's folder (config.json and model.safetensors)")
    return Eagle3Config.read(settings.model).read_layers(num_layers)


@register_drafter("eagle3", hidden_states=_eagle3_layers)
def eagle3_drafter(deployment, settings) -> HeadDrafter:
    exposed = deployment.graph.meta.get(HIDDEN_STATE_LAYERS)
    if exposed is None:
        raise ConfigError("speculative.method is 'eagle3' but the deployment's graph exposes no hidden states (built "
                          "without the expose_hidden_states transform?): build it again with speculative.method='eagle3'")
    layers, num_layers, width = exposed
    head = load_eagle3_head(settings.model, num_layers, width, deployment.vocab_size, graph_embedding(deployment.graph),
                            torch.device(deployment.settings.device), torch_dtype(deployment.settings.dtype))
    if head.layers != list(layers):
        raise ConfigError(f"the graph exposes layers {list(layers)} but the EAGLE-3 head reads {head.layers}: build again")
    return HeadDrafter.for_deployment(head, f"EAGLE-3 head {settings.model}", deployment, settings)


