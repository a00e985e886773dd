"""What the hidden-state drafters (``eagle3``, ``mtp``) share: one decoder layer over the model's hidden states,
its per-sequence cache, and the drafter that feeds it.

A ``HiddenStateHead`` is one decoder layer (attention with rotary positions, a gated MLP) whose input at
position ``t`` mixes the model's hidden state at ``t`` (or the head's own output, down a chain) with the
embedding of token ``t + 1``; ``layer_input`` says how (EAGLE-3: ``[norm(embedding); norm(fc(hidden))]``
into an attention twice as wide; MTP: ``eh_proj([norm(embedding); norm(hidden)])`` into a plain layer), and its
output predicts token ``t + 2``. ``HeadDrafter`` keeps, per sequence, the hidden states the model's forwards
produced (``observe``: one copy of the step's rows) until the sequence drafts, then feeds the head every
position it has not seen (all sequences in one padded step) and runs a greedy chain of ``k`` tokens, the head's
own output standing in for the model's hidden state.

Drafts only ever propose: whatever the head says, the model's own tokens are what a sequence keeps
(``runtime/speculative.py``). So a sequence whose early positions the head never saw (a prefix-cache hit, a
context longer than ``speculative.options.context`` positions) is drafted from what the head has: fewer
accepted tokens, never other output.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.runtime.scheduler import ScheduledChunk

@dataclass(frozen=True)
class LayerShape:
    """A head's decoder layer: widths, heads, norm epsilon, vocabulary, and the config it came from (rope)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    raw: dict

    @classmethod
    def of(cls, raw: dict) -> LayerShape:
        """The shape a Hugging Face style ``config.json`` describes."""
        heads = raw["num_attention_heads"]
        return cls(raw["hidden_size"], raw["intermediate_size"], heads, raw.get("num_key_value_heads") or heads,
                   raw.get("head_dim") or raw["hidden_size"] // heads, raw.get("rms_norm_eps", 1e-6), raw["vocab_size"], raw)


CONTEXT = 1024  # positions of hidden states a sequence keeps for the head while it does not draft (options.context)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """``q/k/v_proj`` from ``in_width`` (twice the hidden width for EAGLE-3), ``o_proj`` back to it."""

    def __init__(self, c, in_width: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(in_width, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def make_rotary(c, raw: dict) -> nn.Module:
    """Hugging Face's Llama rotary embedding for the head's width and heads, with the rope settings of ``raw``
    (``rope_theta``, ``rope_scaling``/``rope_parameters``)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {k: v for k, v in raw.items() if k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")}
    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                            head_dim=c.head_dim, **rope))


class HiddenStateHead(nn.Module, ABC):
    """One decoder layer over the model's hidden states. Subclasses set ``shape`` (hidden_size, head counts,
    head_dim), ``embed_tokens`` and ``rotary``, and say how the layer's input is made (``layer_input``), which
    modules are its attention, MLP and norm before the MLP (``block``), and how logits come out (``logits``)."""

    shape: object
    model_width: int  # the width of the model's hidden states it reads (all its layers')

    @abstractmethod
    def layer_input(self, hidden: torch.Tensor, embedded: torch.Tensor, from_model: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the residual) of positions with ``hidden`` states and ``embedded`` next tokens."""

    @abstractmethod
    def block(self) -> tuple[Attention, nn.Module, nn.Module]:
        """The layer's attention, its MLP and the norm before the MLP."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of output hidden states (over the head's vocabulary: ``to_target`` maps its ids)."""

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The model's token ids of the head's logits' ids (the same unless the head has a draft vocabulary)."""
        return draft_ids

    def placed(self, device: torch.device, dtype: torch.dtype) -> HiddenStateHead:
        """The head on ``device`` in ``dtype``, its rotary frequencies kept in float32, in eval mode."""
        inv_freq = self.rotary.inv_freq.float()
        head = self.to(device=device, dtype=dtype)
        head.rotary.inv_freq = inv_freq.to(device)
        return head.eval()

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, counts: list[int],
             caches: list[HeadCache], from_model: bool) -> torch.Tensor:
        """The head over ``counts[b]`` new positions of each of ``B`` sequences (padded to ``n``): ``hidden``
        ``[B, n, ·]``, the model's hidden states (``from_model``) or the head's own outputs, ``tokens`` and
        ``positions`` ``[B, n]``. Appends their keys and values to ``caches`` and returns the output hidden
        states ``[B, n, H]`` (rows past ``counts[b]`` are padding)."""
        c = self.shape
        batch, n = tokens.shape
        embedded = self.embed_tokens(tokens).to(hidden.dtype if hidden.is_floating_point() else self.embed_tokens.weight.dtype)
        attention_in, x = self.layer_input(hidden, embedded, from_model)
        attn, mlp, post_norm = self.block()
        q = attn.q_proj(attention_in).view(batch, n, attn.heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(attention_in).view(batch, n, attn.kv_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(attention_in).view(batch, n, attn.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
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
        return x + mlp(post_norm(x))

    def reference_logits(self, fused: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of one sequence's positions ``0 … T − 1`` fed at once (``fused``: the model's hidden states ``[T, ·]``): what
        ``step`` must equal when the same positions arrive a few at a time."""
        cache = HeadCache()
        out = self.step(fused[None], tokens[None], torch.arange(len(tokens), device=tokens.device)[None], [len(tokens)], [cache],
                        from_model=True)
        return self.logits(out[0])


@torch.inference_mode()
def check_head(head: HiddenStateHead, name: str, positions: int = 12) -> str:
    """The build's check of a head, on random hidden states: its logits are finite, and its cached steps (a few
    positions at a time, as drafting feeds it) give the logits of one forward over all positions. A head that fails
    is an ``UnsupportedModelError`` naming it; what was checked, for the pipeline report."""
    from autodeploy.errors import UnsupportedModelError

    weight = head.embed_tokens.weight
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(positions, head.model_width, generator=generator).to(weight.device, weight.dtype)
    tokens = torch.randint(0, weight.shape[0], (positions,), generator=generator).to(weight.device)
    whole = head.reference_logits(hidden, tokens).float()
    cache, pieces = HeadCache(), []
    for start, stop in ((0, 5), (5, 6), (6, positions)):
        out = head.step(hidden[None, start:stop], tokens[None, start:stop],
                        torch.arange(start, stop, device=weight.device)[None], [stop - start], [cache], from_model=True)
        pieces.append(head.logits(out[0]).float())
    if not whole.isfinite().all():
        raise UnsupportedModelError(f"the {name} gives non-finite logits ({int((~whole.isfinite()).sum())} of "
                                    f"{whole.numel()}) on random hidden states: check its weights for nan/inf")
    worst = float((torch.cat(pieces) - whole).abs().max())
    scale = float(whole.abs().max()) or 1.0
    if worst > (1e-3 if weight.dtype == torch.float32 else 5e-2) * scale:
        raise UnsupportedModelError(f"the {name}'s cached steps differ from one forward over the same positions by "
                                    f"{worst:.3g} (logits up to {scale:.3g}): its cache or rotary settings are broken")
    return (f"finite logits; cached steps equal one forward over {positions} positions (max difference {worst:.2g} of "
            f"logits up to {scale:.3g})")


class HeadSequence:
    """What the head knows of one sequence: its cache (``real`` entries from the model's hidden states, then
    the last chain's), the next position it needs, and where the model's hidden states it has not fed yet are:
    for each held position (``first`` on, contiguous), the step whose rows hold it and its row there. Plain
    integer arrays: a step allocates no Python object per sequence (at 32 sequences, per-sequence lists and
    tensor views cost ~0.8 ms a step, most of it the garbage collector's)."""

    def __init__(self, sequence):
        self.sequence = sequence
        self.cache = HeadCache()
        self.real = 0
        self.next_position = 0
        self.first = 0
        self.steps = array("q")
        self.rows = array("q")

    @property
    def held(self) -> int:
        return len(self.steps)

    def keep(self, start: int, step: int, row: int, count: int, context: int) -> None:
        """Positions ``start … start + count - 1`` are rows ``row …`` of step ``step``, as the latest forward
        computed them: they replace any held from there on (rejected tokens' rows); positions already fed are
        dropped; past ``context`` held positions, the oldest go (the head then skips them)."""
        skip = max(0, self.next_position - start)
        if skip >= count:
            return
        start, row, count = start + skip, row + skip, count - skip
        if not self.first <= start <= self.first + len(self.steps):  # positions between were never computed here
            del self.steps[:], self.rows[:]
            self.first = start
        else:
            del self.steps[start - self.first:], self.rows[start - self.first:]
        if count == 1:
            self.steps.append(step)
            self.rows.append(row)
        else:
            self.steps.extend([step] * count)
            self.rows.extend(range(row, row + count))
        overflow = len(self.steps) - context
        if overflow > 0:
            del self.steps[:overflow], self.rows[:overflow]
            self.first += overflow

    def take(self, upto: int, tensors: dict[int, torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
        """The held positions before ``upto`` (ascending) and their rows (from ``tensors``, by step); they are the
        head's from now on."""
        n = max(0, min(len(self.steps), upto - self.first))
        positions = list(range(self.first, self.first + n))
        pieces, i = [], 0
        while i < n:  # runs of consecutive rows of one step, one slice each
            j = i
            while j + 1 < n and self.steps[j + 1] == self.steps[i] and self.rows[j + 1] == self.rows[j] + 1:
                j += 1
            pieces.append(tensors[self.steps[i]][self.rows[i] : self.rows[j] + 1])
            i = j + 1
        del self.steps[:n], self.rows[:n]
        self.first += n
        self.next_position = max(self.next_position, upto)
        return positions, (torch.cat(pieces) if pieces else None)


class HeadDrafter:
    """Greedy chains of a hidden-state ``head``, fed the model's hidden states by ``observe``."""

    def __init__(self, head: HiddenStateHead, context: int = CONTEXT, name: str = "head"):
        self.head = head
        self.context = context
        self.name = name
        self.check = check_head(head, name)
        self._sequences: dict[int, HeadSequence] = {}
        self._tensors: dict[int, torch.Tensor] = {}  # step → the hidden states of its rows (a copy)
        self._step = 0

    def describe(self) -> str:
        return f"  {self.name}: {self.check}"

    def observe(self, chunks: list[ScheduledChunk], rows: list[int], hidden: torch.Tensor) -> None:
        self._forget_finished()
        if not chunks:
            return
        step = self._step = self._step + 1
        self._tensors[step] = hidden[: max(first + chunk.length for chunk, first in zip(chunks, rows))].clone()
        for chunk, first in zip(chunks, rows):
            sequence = chunk.sequence
            state = self._sequences.get(sequence.seq_id)
            if state is None:
                state = self._sequences[sequence.seq_id] = HeadSequence(sequence)
            state.keep(chunk.start, step, first, chunk.length, self.context)
        if step % 32 == 0:
            self._drop_unheld_steps()

    def _drop_unheld_steps(self) -> None:
        """Forget the steps' rows that no sequence holds a position in any more."""
        oldest = min((state.steps[0] for state in self._sequences.values() if state.held), default=self._step)
        for step in [s for s in self._tensors if s < oldest]:
            del self._tensors[step]

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
            newest = len(tokens) - 2  # the position whose hidden state, with the newest token, predicts the next
            if not state.held or state.first + state.held - 1 < newest:
                continue  # the model's hidden state there was not seen: nothing to draft from (the rows stay held)
            positions, rows = state.take(min(sequence.num_computed, newest + 1), self._tensors)
            if positions and positions[-1] == newest:
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
        out = head.step(hidden, tokens.to(device), places.to(device), counts, caches, from_model=True)
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
            last = head.step(last[:, None], drafted[:, None], (next_position + round_)[:, None], [1] * batch, caches,
                             from_model=False)[:, 0]
        proposed = torch.stack(chain, dim=1).tolist()  # one device-to-host copy for the whole chain
        for b, (index, _, _, _) in enumerate(feeds):
            drafts[index] = proposed[b][: limits[index]]
        return drafts

    def _forget_finished(self) -> None:
        for seq_id, state in list(self._sequences.items()):
            sequence = state.sequence
            if sequence.finish_reason is not None or (sequence.request is not None and sequence.request.aborted):
                del self._sequences[seq_id]


def graph_embedding(graph) -> torch.Tensor | None:
    """The model's token embedding table: the weight of the graph's (first) plain embedding lookup."""
    for node in graph.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default):
        weight = node.args[0]
        if weight.op == "get_attr":
            return graph.get_parameter(weight.target) if weight.target in dict(graph.named_parameters()) else getattr(graph, weight.target)
    return None


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)
