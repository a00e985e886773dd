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
each step; ``Eagle3Drafter.observe`` keeps the rows of each sequence's new positions until its next draft.

Drafts only ever propose: whatever the head says, the model's own tokens are what a sequence keeps
(``runtime/speculative.py``). So a sequence whose early positions the head never saw (a prefix-cache hit, a
context longer than ``speculative.options.context`` positions) is drafted from what the head has: fewer
accepted tokens, never other output.

    drafter = make_drafter(deployment, settings)  # settings.method == "eagle3", settings.model: the head's folder
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.errors import ConfigError
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.speculative import HIDDEN_STATE_LAYERS, register_drafter

logger = logging.getLogger(__name__)

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_CONTEXT = 4096  # positions of hidden states a sequence keeps for the head while it does not draft (options.context)


@dataclass(frozen=True)
class Eagle3Config:
    """What the head's ``config.json`` says, and the layers it reads."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    layers: tuple[int, ...] | None  # None: the default for the model's depth
    raw: dict

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


class _RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class HeadCache:
    """One sequence's keys and values in the head, in the order its positions were fed (a prefix is kept:
    ``length``); the storage grows by doubling."""

    def __init__(self):
        self.k: torch.Tensor | None = None  # [kv_heads, capacity, head_dim]
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        needed = self.length + k.shape[1]
        if self.k is None or needed > self.k.shape[1]:
            capacity = max(64, 1 << (needed - 1).bit_length())
            grown_k = k.new_empty(k.shape[0], capacity, k.shape[2])
            grown_v = v.new_empty(v.shape[0], capacity, v.shape[2])
            if self.k is not None:
                grown_k[:, : self.length] = self.k[:, : self.length]
                grown_v[:, : self.length] = self.v[:, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, self.length : needed] = k
        self.v[:, self.length : needed] = v
        self.length = needed


class Eagle3Head(nn.Module):
    """The head's weights and its forward over a batch of sequences' new positions (``step``)."""

    def __init__(self, config: Eagle3Config, num_target_layers: int):
        super().__init__()
        c = self.config = config
        self.layers = config.read_layers(num_target_layers)
        self.fc = nn.Linear(len(self.layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = {k: v for k, v in c.raw.items() if k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")}
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                                       head_dim=c.head_dim, **rope))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The model's token ids of draft-vocabulary ids."""
        return draft_ids + self.d2t[draft_ids]

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, counts: list[int],
             caches: list[HeadCache]) -> torch.Tensor:
        """The head over ``counts[b]`` new positions of each of ``B`` sequences (padded to ``n``): ``hidden``
        ``[B, n, 3·H_model]`` (the model's, fused by ``fc``) or ``[B, n, H]`` (the head's own), ``tokens`` and
        ``positions`` ``[B, n]``. Appends their keys and values to ``caches`` and returns the output hidden
        states ``[B, n, H]`` (rows past ``counts[b]`` are padding)."""
        c, layer = self.config, self.midlayer
        x = self.fc(hidden) if hidden.shape[-1] != c.hidden_size else hidden
        batch, n = tokens.shape
        embedded = self.embed_tokens(tokens).to(x.dtype)
        attention_in = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(x)], dim=-1)
        attn = layer.self_attn
        q = attn.q_proj(attention_in).view(batch, n, attn.heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(attention_in).view(batch, n, attn.kv_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(attention_in).view(batch, n, attn.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        before = [cache.length for cache in caches]
        for b, cache in enumerate(caches):
            cache.append(k[b, :, : counts[b]], v[b, :, : counts[b]])
        # Keys padded to a multiple of 64 and attention written out: the shapes change every step, and a fused
        # attention kernel that plans per shape (cuDNN) would plan again every step.
        longest = -(-max(cache.length for cache in caches) // 64) * 64
        keys = k.new_zeros(batch, attn.kv_heads, longest, c.head_dim)
        values = torch.zeros_like(keys)
        for b, cache in enumerate(caches):
            keys[b, :, : cache.length] = cache.k[:, : cache.length]
            values[b, :, : cache.length] = cache.v[:, : cache.length]
        # Query i of sequence b was fed at index before[b] + i of its cache: it sees the keys up to there.
        key_index = torch.arange(longest, device=x.device)
        query_index = torch.tensor(before, device=x.device)[:, None] + torch.arange(n, device=x.device)
        mask = key_index[None, None, :] <= query_index[:, :, None]  # [B, n, longest]
        group = attn.heads // attn.kv_heads
        scores = q.reshape(batch, attn.kv_heads, group * n, c.head_dim) @ keys.transpose(-1, -2) / math.sqrt(c.head_dim)
        scores = scores.float().view(batch, attn.kv_heads, group, n, longest).masked_fill(~mask[:, None, None], float("-inf"))
        out = (scores.softmax(-1).to(values.dtype).view(batch, attn.kv_heads, group * n, longest) @ values)
        out = out.view(batch, attn.heads, n, c.head_dim)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, n, attn.heads * c.head_dim))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of output hidden states."""
        return self.lm_head(self.norm(hidden))

    def reference_logits(self, fused: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of one sequence's positions ``0 … T − 1`` fed at once (``fused``: ``[T, 3·H_model]``): what
        ``step`` must equal when the same positions arrive a few at a time."""
        cache = HeadCache()
        out = self.step(fused[None], tokens[None], torch.arange(len(tokens), device=tokens.device)[None], [len(tokens)], [cache])
        return self.logits(out[0])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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
    inv_freq = head.rotary.inv_freq.float()  # kept in float32 whatever the head's dtype
    head = head.to(device=device, dtype=dtype)
    head.rotary.inv_freq = inv_freq.to(device)
    head.eval()
    return head


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


class _HeadSequence:
    """What the head knows of one sequence: its cache (``real`` entries from the model's hidden states, then
    the last chain's), the next position it needs, and the model's hidden states it has not fed yet."""

    def __init__(self, sequence):
        self.sequence = sequence
        self.cache = HeadCache()
        self.real = 0
        self.next_position = 0
        self.pending: list[tuple[int, torch.Tensor]] = []  # (first position, rows), positions increasing
        self.held = 0  # rows in pending

    def keep(self, start: int, rows: torch.Tensor, context: int) -> None:
        """Rows of positions ``start …`` as the latest forward computed them: they replace any held for those
        positions (rejected tokens' rows); positions the head already fed are dropped."""
        skip = max(0, self.next_position - start)
        if skip >= len(rows):
            return
        start, rows = start + skip, rows[skip:]
        pending = self.pending
        while pending and pending[-1][0] + len(pending[-1][1]) > start:  # rows this forward computed again
            first, held = pending.pop()
            self.held -= len(held)
            if first < start:
                pending.append((first, held[: start - first]))
                self.held += start - first
        pending.append((start, rows))
        self.held += len(rows)
        while self.held > context:  # a long context the head does not draft for: keep its latest positions
            first, held = pending[0]
            drop = min(len(held), self.held - context)
            self.held -= drop
            if drop == len(held):
                pending.pop(0)
            else:
                pending[0] = (first + drop, held[drop:])

    def take(self, upto: int) -> tuple[list[int], torch.Tensor | None]:
        """The held positions before ``upto`` (ascending) and their rows; they are the head's from now on."""
        positions, rows, rest = [], [], []
        for first, held in self.pending:
            count = max(0, min(len(held), upto - first))
            if count:
                positions += range(first, first + count)
                rows.append(held[:count])
            if count < len(held):
                rest.append((first + count, held[count:]))
        self.pending = rest
        self.held = sum(len(held) for _, held in rest)
        self.next_position = max(self.next_position, upto)
        return positions, (torch.cat(rows) if rows else None)


class Eagle3Drafter:
    """Greedy chains of the EAGLE-3 ``head``, fed the model's hidden states by ``observe``."""

    def __init__(self, head: Eagle3Head, context: int = _CONTEXT):
        self.head = head
        self.context = context
        self._sequences: dict[int, _HeadSequence] = {}

    def observe(self, chunks: list[ScheduledChunk], rows: list[int], hidden: torch.Tensor) -> None:
        self._forget_finished()
        if not chunks:
            return
        step = hidden[: max(first + chunk.length for chunk, first in zip(chunks, rows))].clone()  # one copy a step
        for chunk, first in zip(chunks, rows):
            sequence = chunk.sequence
            state = self._sequences.get(sequence.seq_id)
            if state is None:
                state = self._sequences[sequence.seq_id] = _HeadSequence(sequence)
            state.keep(chunk.start, step[first : first + chunk.length], self.context)

    @torch.inference_mode()
    def __call__(self, sequences: list, limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in sequences]
        feeds = []  # (index, state, positions, rows)
        for index, (sequence, limit) in enumerate(zip(sequences, limits)):
            state = self._sequences.get(sequence.seq_id)
            if limit <= 0 or state is None:
                continue
            state.cache.length = state.real  # the last chain's entries were guesses
            tokens = sequence.token_ids
            positions, rows = state.take(min(sequence.num_computed, len(tokens) - 1))
            if rows is None or positions[-1] != len(tokens) - 2:
                continue  # the head has not seen the newest position: nothing to draft from
            feeds.append((index, state, positions, rows))
        if not feeds:
            return drafts
        head = self.head
        device = feeds[0][3].device
        n = max(len(positions) for _, _, positions, _ in feeds)
        batch = len(feeds)
        hidden = feeds[0][3].new_zeros(batch, n, feeds[0][3].shape[-1])
        tokens = torch.zeros(batch, n, dtype=torch.long)
        places = torch.zeros(batch, n, dtype=torch.long)
        counts = []
        for b, (index, state, positions, rows) in enumerate(feeds):
            ids = sequences[index].token_ids
            hidden[b, : len(positions)] = rows
            tokens[b, : len(positions)] = torch.tensor([ids[p + 1] for p in positions])
            places[b, : len(positions)] = torch.tensor(positions)
            counts.append(len(positions))
        caches = [state.cache for _, state, _, _ in feeds]
        out = head.step(hidden, tokens.to(device), places.to(device), counts, caches)
        for _, state, _, _ in feeds:
            state.real = state.cache.length
        last = out[torch.arange(batch, device=device), torch.tensor(counts, device=device) - 1]  # [B, H]
        next_position = torch.tensor([positions[-1] + 1 for _, _, positions, _ in feeds], device=device)
        chain = []
        rounds = max(limits[index] for index, _, _, _ in feeds)
        for round_ in range(rounds):
            drafted = head.to_target(head.logits(last).argmax(-1))  # [B]
            chain.append(drafted)
            if round_ + 1 == rounds:
                break
            last = head.step(last[:, None], drafted[:, None], (next_position + round_)[:, None], [1] * batch, caches)[:, 0]
        proposed = torch.stack(chain, dim=1).tolist()  # one device-to-host copy for the whole chain
        for b, (index, _, _, _) in enumerate(feeds):
            drafts[index] = proposed[b][: limits[index]]
        return drafts

    def _forget_finished(self) -> None:
        for seq_id, state in list(self._sequences.items()):
            sequence = state.sequence
            if sequence.finish_reason is not None or (sequence.request is not None and sequence.request.aborted):
                del self._sequences[seq_id]


def _eagle3_layers(settings, num_layers: int) -> list[int]:
    if not settings.model:
        raise ConfigError("speculative.method is 'eagle3' but speculative.model names no head: set it to an EAGLE-3 "
                          "head's folder (config.json and model.safetensors)")
    return Eagle3Config.read(settings.model).read_layers(num_layers)


@register_drafter("eagle3", hidden_states=_eagle3_layers)
def eagle3_drafter(deployment, settings) -> Eagle3Drafter:
    exposed = deployment.graph.meta.get(HIDDEN_STATE_LAYERS)
    if exposed is None:
        raise ConfigError("speculative.method is 'eagle3' but the deployment's graph exposes no hidden states (built "
                          "without the expose_hidden_states transform?): build it again with speculative.method='eagle3'")
    layers, num_layers, width = exposed
    head = load_eagle3_head(settings.model, num_layers, width, deployment.vocab_size, _embedding(deployment.graph),
                            torch.device(deployment.settings.device), _dtype(deployment.settings.dtype))
    if head.layers != list(layers):
        raise ConfigError(f"the graph exposes layers {list(layers)} but the EAGLE-3 head reads {head.layers}: build again")
    context = int((settings.options or {}).get("context", _CONTEXT))
    return Eagle3Drafter(head, context)


def _embedding(graph) -> torch.Tensor | None:
    """The model's token embedding table: the weight of the graph's (first) plain embedding lookup."""
    for node in graph.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default):
        weight = node.args[0]
        if weight.op == "get_attr":
            return graph.get_parameter(weight.target) if weight.target in dict(graph.named_parameters()) else getattr(graph, weight.target)
    return None


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)
