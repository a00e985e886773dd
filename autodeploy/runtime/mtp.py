"""The ``mtp`` drafter: the checkpoint's own multi-token-prediction layer drafts from the model's final hidden state.

A checkpoint trained with multi-token prediction (DeepSeek-V3's format: ``num_nextn_predict_layers`` in its
config, the layer stored as ``model.layers.{L}.*`` after the model's ``L`` layers) predicts token ``t + 2`` from
the model's final hidden state at ``t`` (the final norm's output, what the LM head reads) and the embedding of
token ``t + 1``: ``h = eh_proj([enorm(embedding); hnorm(hidden)])``, one decoder layer over ``h``, then
``shared_head.norm`` and ``shared_head.head``. Drafting runs that layer ``k`` times, its own output standing in
for the model's hidden state (the first MTP layer each time, when the checkpoint has several).

The layer here is a dense Llama-style one (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, RMS
norms), what ``scripts/train_eagle3_head.py --kind mtp`` trains for a model. DeepSeek-V3's own MTP layer
(multi-head latent attention and mixture of experts) is refused with a ``ConfigError`` naming what it has:
running it needs those layers outside the model's graph, not built yet. ``expose_hidden_states`` makes the
graph copy the final hidden state out each step; the cache, the chain and the drafter are
``runtime/hidden_state_heads.py``'s.

    autodeploy(model_with_mtp, speculative={"method": "mtp", "num_tokens": 3})
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from autodeploy.errors import ConfigError
from autodeploy.runtime.hidden_state_heads import (MLP, Attention, HeadDrafter, HiddenStateHead, LayerShape,
                                                   RMSNorm, graph_embedding, make_rotary, torch_dtype)
from autodeploy.runtime.speculative import HIDDEN_STATE_LAYERS, register_drafter

_UNSUPPORTED = {  # a key of the MTP layer → what it says the layer is
    "self_attn.q_a_proj.weight": "multi-head latent attention",
    "self_attn.kv_a_proj_with_mqa.weight": "multi-head latent attention",
    "mlp.gate.weight": "a mixture of experts",
    "mlp.experts.0.gate_proj.weight": "a mixture of experts",
}


class _SharedHead(nn.Module):
    def __init__(self, c: LayerShape):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)


class MTPHead(HiddenStateHead):
    """One MTP layer, its modules named as the checkpoint names them under ``model.layers.{L}.``."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        c = self.shape = shape
        self.model_width = c.hidden_size
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.shared_head = _SharedHead(c)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.rotary = make_rotary(c, c.raw)

    def layer_input(self, hidden: torch.Tensor, embedded: torch.Tensor, from_model: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = eh_proj([enorm(embedding); hnorm(hidden)])``: the layer's residual, ``input_layernorm(h)`` its
        attention's input (the model's final hidden state and the layer's own output go the same way)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.input_layernorm(x), x

    def block(self):
        return self.self_attn, self.mlp, self.post_attention_layernorm

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))


def mtp_layer_index(config: dict, where: str) -> int:
    """Where the checkpoint's first MTP layer is stored (``model.layers.{index}``); ``ConfigError`` when it has none."""
    if not config.get("num_nextn_predict_layers"):
        raise ConfigError(f"speculative.method is 'mtp' but {where} has no multi-token-prediction layers "
                          f"(num_nextn_predict_layers is {config.get('num_nextn_predict_layers')!r}); use a checkpoint "
                          f"trained with them, or method 'eagle3', 'draft' or 'ngram'")
    return config["num_hidden_layers"]


def load_mtp_head(folder: str | Path, embedding: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> MTPHead:
    """The first MTP layer of the checkpoint in ``folder``; a ``ConfigError`` naming what is missing or not run."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    prefix = f"model.layers.{mtp_layer_index(config, str(folder))}."
    state = _read_prefixed(folder, prefix)
    kinds = sorted({kind for key, kind in _UNSUPPORTED.items() if key in state})
    if kinds:
        raise ConfigError(f"the MTP layer of {folder} uses {' and '.join(kinds)}, which the mtp drafter does not run yet "
                          f"(it runs dense Llama-style MTP layers); use method 'eagle3', 'draft' or 'ngram'")
    if "embed_tokens.weight" not in state:
        if embedding is None:
            raise ConfigError(f"the MTP layer of {folder} has no embed_tokens and the model's embedding is not a plain "
                              f"tensor (quantized?)")
        state["embed_tokens.weight"] = embedding
    if "shared_head.head.weight" not in state and config.get("tie_word_embeddings"):
        state["shared_head.head.weight"] = state["embed_tokens.weight"]
    shape = LayerShape.of(config)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in MTPHead(shape).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    wrong = {name: (tuple(state[name].shape), want) for name, want in expected.items()
             if name in state and tuple(state[name].shape) != want}
    if missing or wrong:
        raise ConfigError(f"the MTP layer of {folder} ({prefix}*) is not the dense layer its config describes: missing "
                          f"{missing[:6]}, shapes {dict(list(wrong.items())[:4])} (checkpoint, expected)")
    head = MTPHead(shape)
    head.load_state_dict({name: state[name] for name in expected}, strict=True)
    return head.placed(device, dtype)


def save_mtp_layer(head: MTPHead, folder: str | Path) -> None:
    """Add ``head`` to the checkpoint in ``folder`` as its MTP layer: ``model.layers.{L}.*`` in a file of its own
    (bfloat16; not the embedding or the output head, which are the model's), listed in the index (made when the
    checkpoint is one file), and ``num_nextn_predict_layers: 1`` in its config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    state = {prefix + name: t.detach().to(torch.bfloat16).contiguous().cpu() for name, t in head.state_dict().items()
             if not name.startswith(("rotary.", "embed_tokens.", "shared_head.head."))}
    save_file(state, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
            weight_map = {key: "model.safetensors" for key in handle.keys()}
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    contents = json.loads(index.read_text())
    contents["weight_map"].update({key: "model-mtp.safetensors" for key in state})
    index.write_text(json.dumps(contents, indent=2))
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _read_prefixed(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors under ``prefix`` (the prefix removed), from its safetensors files."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({name for key, name in json.loads(index.read_text())["weight_map"].items() if key.startswith(prefix)})
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    state = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith(prefix):
                    state[key[len(prefix):]] = handle.get_tensor(key)
    if not state:
        raise ConfigError(f"{folder} declares num_nextn_predict_layers but holds no {prefix}* tensors")
    return state


def _mtp_layers(settings, num_layers: int) -> list[int]:
    """The final hidden state (layer ``num_layers``); a checkpoint folder without MTP layers is refused now."""
    config = Path(settings.model or "") / "config.json"
    if settings.model and config.is_file():
        mtp_layer_index(json.loads(config.read_text()), settings.model)
    return [num_layers]


@register_drafter("mtp", hidden_states=_mtp_layers)
def mtp_drafter(deployment, settings) -> HeadDrafter:
    if deployment.graph.meta.get(HIDDEN_STATE_LAYERS) is None:
        raise ConfigError("speculative.method is 'mtp' but the deployment's graph exposes no hidden states: build it "
                          "again with speculative.method='mtp'")
    if not deployment.model_directory or not (Path(deployment.model_directory) / "config.json").is_file():
        raise ConfigError("speculative.method is 'mtp' reads the checkpoint's MTP layer, but this deployment has no "
                          "checkpoint folder (weights=random?); deploy from a checkpoint with MTP layers")
    head = load_mtp_head(deployment.model_directory, graph_embedding(deployment.graph),
                         torch.device(deployment.settings.device), torch_dtype(deployment.settings.dtype))
    return HeadDrafter.for_deployment(head, f"MTP layer of {deployment.model_directory}", deployment, settings)
