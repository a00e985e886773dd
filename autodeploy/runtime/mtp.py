"""The ``mtp`` drafter: the checkpoint's own multi-token-prediction layer drafts from the model's final hidden state.

A checkpoint trained with multi-token prediction (DeepSeek-V3's format: ``num_nextn_predict_layers`` in its
config, the layer stored as ``model.layers.{L}.*`` after the model's ``L`` layers) predicts token ``t + 2`` from
the model's final hidden state at ``t`` (the final norm's output, what the LM head reads) and the embedding of
token ``t + 1``: ``h = eh_proj([enorm(embedding); hnorm(hidden)])``, one decoder layer over ``h``, then
``shared_head.norm`` and ``shared_head.head``. Drafting runs that layer ``k`` times, its own output standing in
for the model's hidden state (the first MTP layer each time, when the checkpoint has several).

Two kinds of layer run: a dense Llama-style one (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, RMS
norms), what ``scripts/train_eagle3_head.py --kind mtp`` trains for a model, and DeepSeek-V3's own (multi-head
latent attention and a mixture of experts, ``DeepSeekMTPHead``, through Hugging Face's DeepSeek-V3 modules; the
release's per-expert weights are stacked as those modules keep them). A quantized MTP layer is refused with a
``ConfigError``. ``expose_hidden_states`` makes the
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

_LATENT_ATTENTION = "self_attn.kv_a_proj_with_mqa.weight"  # a key only DeepSeek's multi-head latent attention has


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


class DeepSeekMTPHead(MTPHead):
    """DeepSeek-V3's MTP layer: the same ``enorm`` / ``hnorm`` / ``eh_proj`` and shared head around a decoder layer
    with multi-head latent attention (Hugging Face's ``DeepseekV3Attention`` modules: low-rank query and key-value
    projections, decoupled rotary dims, the yarn softmax scale) and a mixture of experts with shared experts
    (``DeepseekV3MoE``; a dense ``DeepseekV3MLP`` where the layer index is below ``first_k_dense_replace``). The slot
    cache keeps the expanded per-head keys and values. The experts' routing reads token counts on the host, so
    drafting with it runs eagerly (its CUDA graph capture fails over to eager)."""

    def __init__(self, shape: LayerShape, layer_index: int):
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

        nn.Module.__init__(self)
        c = self.shape = shape
        config = self.config = DeepseekV3Config(**{k: v for k, v in c.raw.items() if k not in ("architectures", "auto_map")})
        self.model_width = c.hidden_size
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = deepseek.DeepseekV3Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        dense = layer_index < (config.first_k_dense_replace or 0)
        self.mlp = deepseek.DeepseekV3MLP(config) if dense else deepseek.DeepseekV3MoE(config)
        self.shared_head = _SharedHead(c)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.rotary = deepseek.DeepseekV3RotaryEmbedding(config)
        self._rotate = deepseek.apply_rotary_pos_emb_interleave if config.rope_interleave else deepseek.apply_rotary_pos_emb

    def attention_qkv(self, attention_in: torch.Tensor, x: torch.Tensor, positions: torch.Tensor):
        attn = self.self_attn
        batch, n = positions.shape
        if attn.q_lora_rank is None:
            q = attn.q_proj(attention_in)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(attention_in)))
        q = q.view(batch, n, -1, attn.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = torch.split(attn.kv_a_proj_with_mqa(attention_in), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        kv_nope = attn.kv_a_layernorm(kv_nope).view(batch, 1, n, attn.kv_lora_rank)
        cos, sin = (angle.to(q.dtype) for angle in self.angles(x, positions))  # a tabulated rotary is float32
        q_rot, k_rot = self._rotate(q_rot, k_rot.view(batch, 1, n, attn.qk_rope_head_dim), cos, sin)
        k, v = attn.expand_kv(kv_nope, k_rot)
        return torch.cat((q_pass, q_rot), dim=-1), k, v, attn.scaling

    def attention_out(self, out: torch.Tensor) -> torch.Tensor:
        return self.self_attn.o_proj(out)

    def cache_dims(self) -> tuple[int, int, int]:
        attn = self.self_attn
        return attn.num_heads, attn.qk_head_dim, attn.v_head_dim

    def attention_heads(self) -> tuple[int, float | None]:
        return self.self_attn.num_heads, self.self_attn.scaling


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
    index = mtp_layer_index(config, str(folder))
    prefix = f"model.layers.{index}."
    state = _read_prefixed(folder, prefix)
    quantized = sorted(key for key in state if key.endswith(("_scale_inv", "weight_scale", "input_scale")))
    if quantized:
        raise ConfigError(f"the MTP layer of {folder} is stored quantized ({quantized[0]}, …), which the mtp drafter does "
                          f"not run yet; use a bf16 checkpoint, or method 'eagle3', 'draft' or 'ngram'")
    latent = _LATENT_ATTENTION in state
    if latent:
        state = _fused_experts(state)
    if "embed_tokens.weight" not in state:
        if embedding is None:
            raise ConfigError(f"the MTP layer of {folder} has no embed_tokens and the model's embedding is not a plain "
                              f"tensor (quantized?)")
        state["embed_tokens.weight"] = embedding
    if "shared_head.head.weight" not in state and config.get("tie_word_embeddings"):
        state["shared_head.head.weight"] = state["embed_tokens.weight"]
    shape = LayerShape.of(config)
    make = (lambda: DeepSeekMTPHead(shape, index)) if latent else (lambda: MTPHead(shape))
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in make().state_dict().items()}
    missing = sorted(set(expected) - set(state))
    wrong = {name: (tuple(state[name].shape), want) for name, want in expected.items()
             if name in state and tuple(state[name].shape) != want}
    if missing or wrong:
        raise ConfigError(f"the MTP layer of {folder} ({prefix}*) is not the layer its config describes: missing "
                          f"{missing[:6]}, shapes {dict(list(wrong.items())[:4])} (checkpoint, expected)")
    head = make()
    head.load_state_dict({name: state[name] for name in expected}, strict=True)
    return head.placed(device, dtype)


def _fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert weights (``mlp.experts.{e}.{gate,up,down}_proj.weight``, DeepSeek's release format)
    as Hugging Face's stacked ones (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``)."""
    count = len({key.split(".")[2] for key in state if key.startswith("mlp.experts.") and key.endswith("gate_proj.weight")})
    if not count:
        return state
    state = dict(state)
    experts = [{part: state.pop(f"mlp.experts.{e}.{part}_proj.weight") for part in ("gate", "up", "down")} for e in range(count)]
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([e["down"] for e in experts])
    return state


def save_mtp_layer(head: MTPHead, folder: str | Path) -> None:
    """Add ``head`` to the checkpoint in ``folder`` as its MTP layer: ``model.layers.{L}.*`` in a file of its own
    (bfloat16; not the embedding or the output head, which are the model's), listed in the index (made when the
    checkpoint is one file), and ``num_nextn_predict_layers: 1`` in its config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    tied = config.get("tie_word_embeddings", False)  # then the output head is the model's embedding, not stored again
    layer = {name: t for name, t in head.state_dict().items()
             if not name.startswith(("rotary.", "embed_tokens.")) and not (tied and name.startswith("shared_head.head."))}
    if "mlp.experts.gate_up_proj" in layer:  # DeepSeek's release format: a tensor per expert and projection
        gate_up, down = layer.pop("mlp.experts.gate_up_proj"), layer.pop("mlp.experts.down_proj")
        gates, ups = gate_up.chunk(2, dim=1)
        for e in range(len(gate_up)):
            layer.update({f"mlp.experts.{e}.gate_proj.weight": gates[e], f"mlp.experts.{e}.up_proj.weight": ups[e],
                          f"mlp.experts.{e}.down_proj.weight": down[e]})
    state = {prefix + name: t.detach().to(torch.bfloat16).contiguous().cpu() for name, t in layer.items()}
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
