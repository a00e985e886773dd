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

A prefix-cache hit never computes the cached positions: the rows of full blocks are kept past their sequence in a
``HiddenStateStore`` under the prefix cache's block keys, and a sequence whose computation starts at a hit is fed
the stored rows of the blocks before it, as if computed.

Drafts only ever propose: whatever the head says, the model's own tokens are what a sequence keeps
(``runtime/speculative.py``). So a sequence whose early positions the head never saw (a hit on blocks evicted from
the store, a context longer than ``speculative.options.context`` positions) is drafted from what the head has:
fewer accepted tokens, never other output.
"""

from __future__ import annotations

import bisect
import logging
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.errors import ConfigError
from autodeploy.runtime.device_copies import pinned_to_device
from autodeploy.runtime.draft_trees import DraftTree
from autodeploy.runtime.hidden_state_store import HIDDEN_STATE_CACHE_MB, HiddenStateStore
from autodeploy.runtime.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

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


def pick_kernel(op_name: str, device: torch.device, *example) -> Callable:
    """Canonical op ``op_name``'s first backend, of Triton's, torch's and the reference, that runs ``example`` (its
    arguments as meta tensors) on ``device``: one kernel per op on a GPU where the plain PyTorch ops take several."""
    import autodeploy.custom_ops  # noqa: F401  (registers the ops and their backends)
    from autodeploy.custom_ops.registry import candidates

    order = {"triton": 0, "torch": 1}
    for backend in sorted(candidates(op_name), key=lambda b: order.get(b.name, 2)):
        if backend.name in order and backend.check(example, device) is None:
            return backend.op
    return candidates(op_name)[-1].op  # the reference: runs everywhere


class RMSNorm(nn.Module):
    kernel: Callable | None = None  # canonical rms_norm's backend (``HiddenStateHead.fuse``); None: Hugging Face's formula

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        # Hugging Face's Llama norm (float32 statistics, the weight applied in the input's dtype) in one fused op.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    add_kernel: Callable | None = None  # canonical add_rms_norm's backend

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: with ``add_kernel``, one kernel."""
        if self.add_kernel is not None:
            return self.add_kernel(x, residual, self.weight, self.eps)
        total = x + residual
        return self(total), total


def fuse_rows(*linears: nn.Linear) -> torch.Tensor:
    """One weight holding the ``linears``' rows in order (one GEMM for all their outputs); each linear's weight
    becomes a view of its rows, so nothing is stored twice."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    row = 0
    for linear in linears:
        count = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[row : row + count], requires_grad=False)
        row += count
    return fused


class Attention(nn.Module):
    """``q/k/v_proj`` from ``in_width`` (twice the hidden width for EAGLE-3), ``o_proj`` back to it. ``fuse``d, the
    three projections are one GEMM (``qkv_weight``) and the rotation of queries and keys one ``rope`` kernel."""

    qkv_weight: torch.Tensor | None = None
    rope: Callable | None = None

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

    gated: Callable | None = None  # canonical fused_gated_mlp's backend over ``gate_up_weight`` (``fuse``)
    gate_up_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated is not None:
            return self.gated(x, self.gate_up_weight, self.down_proj.weight, "silu")
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


EMPTY = -(1 << 40)  # the position a slot cache entry holds before anything is written there


class SlotCache:
    """The head's keys and values for up to ``slots`` sequences, one slot each (and one more, ``pad``, that padding
    rows write to). A slot holds the last ``capacity`` positions fed to it in a ring indexed by position, with the
    position each entry holds (``EMPTY``: none, far below any window, so one comparison excludes it). A query at position ``p`` sees its slot's entries at positions
    ``p - window < q ≤ p``; ``window`` stays ``chain`` positions short of ``capacity``, so the guesses a chain
    writes past a sequence's newest position never overwrite an entry a later query looks for. A feed of many
    positions overwrites its own earliest ones' oldest keys as it goes: only its last row's output is used."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int, value_dim: int, window: int, chain: int,
                 device: torch.device, dtype: torch.dtype):
        self.capacity, self.window, self.pad = window + chain, window, slots
        self.k = torch.zeros(slots + 1, kv_heads, self.capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(slots + 1, kv_heads, self.capacity, value_dim, device=device, dtype=dtype)
        self.positions = torch.full((slots + 1, self.capacity), EMPTY, dtype=torch.long, device=device)
        self._free = list(range(slots - 1, -1, -1))
        self._slots: dict[int, int] = {}

    @torch.inference_mode()
    def use_kernel(self, heads: int, scale: float | None = None) -> str:
        """Attend and store with the Triton kernels (``custom_ops/triton/slot_attention.py``) where they run and give
        what the PyTorch path gives, checked now on a scratch cache of this one's shape with random entries (before
        any drafting graph is captured); what was done, for the pipeline report."""
        from autodeploy.custom_ops.triton import triton_unavailable

        reason = triton_unavailable(self.k.device)
        if reason:
            return f"slot attention gathered ({reason})"
        from autodeploy.custom_ops.triton.slot_attention import slot_attention, slot_store

        try:
            worst, stored = _check_slot_kernels(self, heads, scale, slot_attention, slot_store)
        except Exception as error:  # slower, never wrong: the PyTorch path stays
            return f"slot attention gathered (the kernels failed: {type(error).__name__}: {error})"
        if worst > (1e-3 if self.k.dtype == torch.float32 else 3e-2) or not stored:
            return f"slot attention gathered (the kernels differ: attention by {worst:.3g}, stores equal: {stored})"
        self.kernel, self.store_kernel = slot_attention, slot_store
        return f"slot attention and stores in one kernel each (attention within {worst:.2g} of the gathered one)"

    store_kernel: Callable | None = None

    def store(self, slots: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write`` the rows of ``slots [B]`` (rows not ``valid`` ``[B, n]`` into the pad slot)."""
        if self.store_kernel is not None:
            self.store_kernel(k, v, positions, valid, slots, self.pad, self.k, self.v, self.positions)
        else:
            self.write(torch.where(valid, slots[:, None], self.pad), positions, k, v)

    def slot(self, seq_id: int) -> int | None:
        """The slot of sequence ``seq_id`` (a fresh, emptied one the first time); None when every slot is taken."""
        slot = self._slots.get(seq_id)
        if slot is None and self._free:
            slot = self._slots[seq_id] = self._free.pop()
            self.positions[slot] = EMPTY
        return slot

    def release(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values ``[B, kv_heads, n, head_dim]`` of positions ``[B, n]`` in slots ``[B, n]``."""
        index = positions % self.capacity
        self.k[slots, :, index] = k.transpose(1, 2)
        self.v[slots, :, index] = v.transpose(1, 2)
        self.positions[slots, index] = positions

    kernel: Callable | None = None  # custom_ops/triton/slot_attention.py's, where use_kernel found it right

    def attend(self, q: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Queries ``[B, heads, n, head_dim]`` at positions ``[B, n]`` over their slots ``[B]`` → ``[B, heads, n, value_dim]``:
        with ``kernel``, one kernel reading each slot's ring in place; else the slots' rings gathered and one fused
        attention call, each kv head's query heads stacked as rows (no copy of the keys per head)."""
        if self.kernel is not None:
            return self.kernel(q, self.k, self.v, self.positions, slots, positions, self.window, scale)
        batch, heads, n, head_dim = q.shape
        keys, values, held = self.k[slots], self.v[slots], self.positions[slots]  # [B, kv, C, D], [B, C]
        kv_heads, group = keys.shape[1], heads // keys.shape[1]
        held, at = held[:, None, :], positions[:, :, None]
        visible = (held <= at) & (held > at - self.window)  # [B, n, C]
        if n == 1:  # a chain step: one row for all the group's heads, broadcast (no copy)
            mask = visible[:, None]
        else:
            mask = visible[:, None, None].expand(batch, 1, group, n, visible.shape[-1]).reshape(batch, 1, group * n, -1)
        out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, group * n, head_dim), keys, values, attn_mask=mask,
                                             scale=scale)
        return out.reshape(batch, heads, n, values.shape[-1])  # a GPU kernel may return the query's strided layout


def fill_randomly(cache: SlotCache, newest: torch.Tensor, generator: torch.Generator) -> None:
    """Random keys and values in ``cache``, its slots holding what writes up to positions ``newest [slots + 1]`` leave:
    entry ``i`` the latest position ``≤ newest`` that is ``i`` modulo the ring's length (EMPTY where none, and for
    about a tenth of the entries at random: positions never fed)."""
    capacity = cache.capacity
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator).to(cache.k.dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator).to(cache.v.dtype))
    entries = torch.arange(capacity)
    held = newest[:, None] - (newest[:, None] - entries) % capacity  # [slots + 1, C]
    unfed = torch.rand(held.shape, generator=generator) < 0.1
    cache.positions.copy_(torch.where((held < 0) | unfed, EMPTY, held))


def _check_slot_kernels(cache: SlotCache, heads: int, scale: float | None, attend: Callable, store: Callable) -> tuple[float, bool]:
    """The slot kernels against the PyTorch path on scratch caches shaped like ``cache`` (three slots, random
    entries): the attention's worst difference, and whether the stores left equal caches."""
    kv_heads, capacity, key_dim = cache.k.shape[1:]
    value_dim, device, dtype = cache.v.shape[-1], cache.k.device, cache.k.dtype
    generator = torch.Generator(device="cpu").manual_seed(0)

    def scratch() -> SlotCache:
        made = SlotCache(2, kv_heads, key_dim, value_dim, cache.window, capacity - cache.window, device, dtype)
        generator.manual_seed(0)
        fill_randomly(made, torch.tensor([40, 2 * capacity + 3, 10]), generator)
        return made

    plain, fused = scratch(), scratch()
    slots, n = torch.tensor([1, 0, 2], device=device), 3
    positions = torch.tensor([[20, 21, 22], [35, 36, 37], [3, 4, 5]], device=device)  # one entry each (no race)
    valid = torch.tensor([[True, True, True], [True, True, False], [False, False, False]], device=device)
    k = torch.randn(3, n, kv_heads, key_dim, generator=generator).to(device, dtype).transpose(1, 2)
    v = torch.randn(3, n, kv_heads, value_dim, generator=generator).to(device, dtype).transpose(1, 2)
    plain.store(slots, valid, positions, k, v)
    store(k, v, positions, valid, slots, fused.pad, fused.k, fused.v, fused.positions)
    stored = all(torch.equal(a, b) for a, b in ((plain.k, fused.k), (plain.v, fused.v), (plain.positions, fused.positions)))
    q = torch.randn(3, heads, n, key_dim, generator=generator).to(device, dtype)
    want = plain.attend(q, slots, positions, scale).float().nan_to_num(0.0)
    got = attend(q, plain.k, plain.v, plain.positions, slots, positions, plain.window, scale).float()
    return float((got - want).abs().max()), stored


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
        """The head on ``device`` in ``dtype``, its rotary frequencies kept in float32, in eval mode, ``fuse``d."""
        inv_freq = self.rotary.inv_freq.float()
        head = self.to(device=device, dtype=dtype)
        head.rotary.inv_freq = inv_freq.to(device)
        return head.eval().fuse()

    @torch.no_grad()
    def fuse(self) -> HiddenStateHead:
        """Run the layer through canonical ops, each on the backend that takes it on the head's device (Triton's on a
        GPU, ``pick_kernel``): its RMS norms (the residual add before the MLP's norm with it), the q/k/v projections
        as one GEMM with one rotary kernel, the MLP's gate and up projections as one GEMM with the activation fused.
        A drafting round is then ~36 kernels instead of ~70 (what a drafting CUDA graph replays). Only the head's
        own Llama-style modules are fused (a DeepSeek layer's attention and experts stay Hugging Face's)."""
        weight = self.embed_tokens.weight
        device, meta = weight.device, lambda *shape: torch.empty(*shape, dtype=weight.dtype, device="meta")
        for module in self.modules():
            if isinstance(module, RMSNorm):
                width = module.weight.shape[0]
                module.kernel = pick_kernel("rms_norm", device, meta(2, width), meta(width), module.eps)
                module.add_kernel = pick_kernel("add_rms_norm", device, meta(2, width), meta(2, width), meta(width), module.eps)
            elif isinstance(module, MLP):
                module.gate_up_weight = fuse_rows(module.gate_proj, module.up_proj)
                module.gated = pick_kernel("fused_gated_mlp", device, meta(2, module.gate_up_weight.shape[1]),
                                           module.gate_up_weight.to("meta"), module.down_proj.weight.to("meta"), "silu")
            elif isinstance(module, Attention):
                module.qkv_weight = fuse_rows(module.q_proj, module.k_proj, module.v_proj)
                example = meta(1, 2, module.heads + module.kv_heads, module.head_dim)
                angles = torch.empty(1, 2, module.head_dim, device="meta")
                module.rope = pick_kernel("rope", device, example, angles, angles)
        return self

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
             slots: torch.Tensor, cache: SlotCache, from_model: bool) -> torch.Tensor:
        """The head over ``n`` positions of each of ``B`` sequences: ``hidden`` ``[B, n, ·]``, the model's hidden states
        (``from_model``) or the head's own outputs; ``tokens``, ``positions`` and ``valid`` ``[B, n]`` (padding rows:
        not valid; give them a real position of theirs); ``slots`` ``[B]``, the sequences' in ``cache``. Stores the
        valid rows' keys and values and returns the output hidden states ``[B, n, H]``. Tensor work only (no host
        reads): a drafting step runs as a CUDA graph."""
        batch, n = tokens.shape
        embedded = self.embed_tokens(tokens).to(hidden.dtype if hidden.is_floating_point() else self.embed_tokens.weight.dtype)
        attention_in, x = self.layer_input(hidden, embedded, from_model)
        _, mlp, post_norm = self.block()
        q, k, v, scale = self.attention_qkv(attention_in, x, positions)
        cache.store(slots, valid, positions, k, v)
        out = cache.attend(q, slots, positions, scale)
        normed, x = post_norm.add(self.attention_out(out.transpose(1, 2).reshape(batch, n, -1)), x)
        return x + mlp(normed)

    def attention_qkv(self, attention_in: torch.Tensor, x: torch.Tensor, positions: torch.Tensor):
        """Queries ``[B, heads, n, Dk]``, keys ``[B, kv_heads, n, Dk]``, values ``[B, kv_heads, n, Dv]`` (rotated at
        ``positions``) and the attention's scale (None: ``1/√Dk``); Llama's attention here."""
        c, attn = self.shape, self.block()[0]
        batch, n = positions.shape
        if attn.qkv_weight is not None:  # fused: one GEMM, queries and keys rotated by one kernel
            qkv = F.linear(attention_in, attn.qkv_weight).view(batch, n, -1, c.head_dim)
            rotating = attn.heads + attn.kv_heads
            rotated = attn.rope(qkv[:, :, :rotating], *self.angles(x, positions))
            return (rotated[:, :, : attn.heads].transpose(1, 2), rotated[:, :, attn.heads :].transpose(1, 2),
                    qkv[:, :, rotating:].transpose(1, 2), None)
        q = attn.q_proj(attention_in).view(batch, n, attn.heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(attention_in).view(batch, n, attn.kv_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(attention_in).view(batch, n, attn.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.angles(x, positions)
        return rotate(q, cos, sin), rotate(k, cos, sin), v, None

    def attention_out(self, out: torch.Tensor) -> torch.Tensor:
        """The attention's output projection of ``out`` ``[B, n, heads · Dv]``."""
        return self.block()[0].o_proj(out)

    def cache_dims(self) -> tuple[int, int, int]:
        """(kv heads, key dim, value dim) of what the slot cache keeps."""
        return self.shape.num_key_value_heads, self.shape.head_dim, self.shape.head_dim

    def attention_heads(self) -> tuple[int, float | None]:
        """(query heads, the attention's scale; None: ``1/√key dim``)."""
        return self.shape.num_attention_heads, None

    rotary_table: torch.Tensor | None = None  # cos, sin [positions, 2, head_dim] (tabulate_rotary), float32

    def tabulate_rotary(self, positions: int) -> None:
        """Compute the rotary angles of positions ``0 … positions - 1`` once: a step then looks them up (two gathers)
        instead of computing them (a drafting graph's kernels are its cost). Later positions use the last."""
        weight = self.embed_tokens.weight
        cos, sin = self.rotary(weight.new_zeros(1, dtype=torch.float32), torch.arange(positions, device=weight.device)[None])
        self.rotary_table = torch.stack([cos[0], sin[0]], dim=1)

    def angles(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary ``cos``, ``sin`` ``[B, n, head_dim]`` of ``positions`` ``[B, n]``."""
        if self.rotary_table is None:
            return self.rotary(x, positions)
        both = self.rotary_table[positions.clamp(max=len(self.rotary_table) - 1)]  # one gather: [B, n, 2, head_dim]
        return both[..., 0, :], both[..., 1, :]

    def new_cache(self, slots: int, window: int, chain: int) -> SlotCache:
        weight = self.embed_tokens.weight
        return SlotCache(slots, *self.cache_dims(), window, chain, weight.device, weight.dtype)

    def reference_logits(self, fused: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of one sequence's positions ``0 … T − 1`` fed at once (``fused``: the model's hidden states ``[T, ·]``): what
        ``step`` must equal when the same positions arrive a few at a time."""
        count, device = len(tokens), tokens.device
        out = self.step(fused[None], tokens[None], torch.arange(count, device=device)[None],
                        torch.ones(1, count, dtype=torch.bool, device=device), torch.zeros(1, dtype=torch.long, device=device),
                        self.new_cache(1, count, 1), from_model=True)
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
    cache, pieces, slot = head.new_cache(1, positions, 1), [], torch.zeros(1, dtype=torch.long, device=weight.device)
    for start, stop in ((0, 5), (5, 6), (6, positions)):
        out = head.step(hidden[None, start:stop], tokens[None, start:stop],
                        torch.arange(start, stop, device=weight.device)[None],
                        torch.ones(1, stop - start, dtype=torch.bool, device=weight.device), slot, cache, from_model=True)
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
    """What the head knows of one sequence: the next position it needs, and where the model's hidden states it has
    not fed yet are:
    for each held position (``first`` on, contiguous), the step whose rows hold it and its row there. Plain
    integer arrays: a step allocates no Python object per sequence (at 32 sequences, per-sequence lists and
    tensor views cost ~0.8 ms a step, most of it the garbage collector's)."""

    def __init__(self, sequence):
        self.sequence = sequence
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

    def take_rows(self, upto: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The held positions before ``upto``: the first of them, and for each (ascending) the step and the row holding
        it; they are the head's from now on."""
        n = max(0, min(len(self.steps), upto - self.first))
        first = self.first
        steps = np.array(self.steps[:n], dtype=np.int64)
        rows = np.array(self.rows[:n], dtype=np.int64)
        del self.steps[:n], self.rows[:n]
        self.first += n
        self.next_position = max(self.next_position, upto)
        return first, steps, rows

    def take(self, upto: int, tensors: dict[int, torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
        """``take_rows`` with the rows themselves (from ``tensors``, by step), in position order."""
        first, steps, rows = self.take_rows(upto)
        if not len(steps):
            return [], None
        out = tensors[int(steps[0])].new_empty(len(steps), tensors[int(steps[0])].shape[-1])
        gather_rows(out, np.arange(len(steps)), steps, rows, tensors)
        return list(range(first, first + len(steps))), out


def gather_rows(out: torch.Tensor, destinations: np.ndarray, steps: np.ndarray, rows: np.ndarray,
                tensors: dict[int, torch.Tensor]) -> None:
    """``out[destinations[i]] = tensors[steps[i]][rows[i]]`` (``out`` 2-D): one indexed copy per step held."""
    device = out.device
    for step in np.unique(steps):
        pick = steps == step
        source = tensors[int(step)]
        out.index_copy_(0, pinned_to_device(torch.from_numpy(destinations[pick]), device),
                        source.index_select(0, pinned_to_device(torch.from_numpy(rows[pick]), device)).to(out.dtype))


class HeadDrafter:
    """Greedy chains (or trees, ``tree_width`` > 1) of a hidden-state ``head`` over up to ``slots`` sequences, each
    drafting at most ``chain`` tokens, fed the model's hidden states by ``observe``. On a GPU a drafting step whose
    sequences each feed at most ``chain + 1`` new positions (every step after a sequence's first draft) replays a
    CUDA graph captured per batch size (1, 2, 4, … ``slots``): the feed and all ``chain`` rounds in one launch."""

    def __init__(self, head: HiddenStateHead, context: int = CONTEXT, name: str = "head", tree_width: int = 1,
                 slots: int = 64, chain: int = 4, graphs: bool | None = None, max_positions: int | None = None,
                 store: HiddenStateStore | None = None):
        self.head = head
        # The rows of full blocks kept for prefix-cache hits, keyed by the KV pool's block keys (use_prefix_cache).
        self.store = store
        self.pool = None
        self._writes = (array("q"), array("q"), array("q"))  # copies into the store queued: its rows, steps, their rows
        self.context = context
        self.name = name
        self.tree_width = tree_width  # > 1: beside each chain token, the head's next likeliest as leaves (a DraftTree)
        self.chain = chain
        if max_positions is not None:  # the rotary angles of every position a sequence can reach, looked up
            head.tabulate_rotary(max_positions + chain + 1)
        self.check = check_head(head, name)
        self.cache = head.new_cache(slots, context, chain + 1)
        self.attention = self.cache.use_kernel(*head.attention_heads())
        self._sequences: dict[int, HeadSequence] = {}
        self._tensors: dict[int, torch.Tensor] = {}  # step → the hidden states of its rows (a copy)
        self._step = 0
        self._tree_rows: dict[int, tuple[int, int]] = {}  # seq_id → (step, first row) of its tree chunk in flight
        # None: on a GPU. On the CPU the same padded static inputs run eagerly (what the tests check).
        on_gpu = head.embed_tokens.weight.is_cuda
        self.graphs = None
        if on_gpu if graphs is None else graphs:
            try:
                self.graphs = HeadGraphs(self, slots, capture=on_gpu)
            except Exception as error:  # slower, never wrong: drafting steps run eagerly
                logger.warning("%s: drafting CUDA graph capture failed (%s: %s); drafting runs eagerly", name,
                               type(error).__name__, error)

    @classmethod
    def for_deployment(cls, head: HiddenStateHead, name: str, deployment, settings) -> HeadDrafter:
        """The drafter ``settings`` (the ``speculative`` section) ask for, sized for ``deployment``'s batches; with
        prefix caching, a ``HiddenStateStore`` of ``options.hidden_state_cache_mb`` (allocated now, before the KV
        pool takes the memory left)."""
        options = settings.options or {}
        megabytes = options.get("hidden_state_cache_mb", HIDDEN_STATE_CACHE_MB)
        if not isinstance(megabytes, (int, float)) or isinstance(megabytes, bool) or megabytes < 0:
            raise ConfigError(f"speculative.options.hidden_state_cache_mb must be a number of MiB ≥ 0 (0: no store), "
                              f"got {megabytes!r}")
        kv = deployment.settings.kv_cache
        weight = head.embed_tokens.weight
        store = (HiddenStateStore.of_budget(megabytes, kv.block_size, head.model_width, weight.device, weight.dtype)
                 if kv.prefix_caching else None)
        return cls(head, int(options.get("context", CONTEXT)), name, settings.tree_width,
                   deployment.settings.max_batch_size, settings.num_tokens, max_positions=deployment.settings.max_seq_len,
                   store=store)

    def use_prefix_cache(self, pool) -> None:
        """Key the store by ``pool``'s block keys (the engine's KV pool): its prefix-cache hits feed the head the
        cached positions' rows. A pool without prefix caching, or of another block size, has no hits to serve."""
        if not pool.enable_prefix_caching or self.store is None or self.store.block_size != pool.block_size:
            self.store = None
        self.pool = pool if self.store is not None else None

    def describe(self) -> str:
        graphs = f"; drafting steps replay CUDA graphs at batch sizes {self.graphs.sizes}" if self.graphs and self.graphs.captured else ""
        store = self.store
        kept = (f"; hidden states of {store.capacity} blocks kept for prefix-cache hits ({store.num_registered} held, "
                f"{store.recalled} positions fed from them)" if self.pool is not None else "")
        return f"  {self.name}: {self.check}; {self.attention}{graphs}{kept}"

    def observe(self, chunks: list[ScheduledChunk], rows: list[int], hidden: torch.Tensor) -> None:
        self._forget_finished()
        if not chunks:
            return
        storing = self.pool is not None
        if storing:
            self._copy_to_store()  # the kept paths of trees verified since the last step
            for chunk in chunks:
                self._recall(chunk)
        step = self._step = self._step + 1
        self._tensors[step] = hidden[: max(first + chunk.length for chunk, first in zip(chunks, rows))].clone()
        for chunk, first in zip(chunks, rows):
            sequence = chunk.sequence
            state = self._sequences.get(sequence.seq_id)
            if state is None:
                state = self._sequences[sequence.seq_id] = HeadSequence(sequence)
            if chunk.draft_parents is None:
                state.keep(chunk.start, step, first, chunk.length, self.context)
            else:  # a tree's rows are not in position order: the newest token's now, the kept path's once known
                state.keep(chunk.start, step, first, 1, self.context)
                self._tree_rows[sequence.seq_id] = (step, first)
            if storing:
                self._store(chunk, step, first)
        if storing:
            self._copy_to_store()
        if step % 32 == 0:
            self._drop_unheld_steps()

    def accepted(self, sequence, start: int, path: list[int]) -> None:
        """A tree verified at ``start`` kept nodes ``path``: their rows hold the positions after ``start``."""
        step, first = self._tree_rows.pop(sequence.seq_id, (None, 0))
        state = self._sequences.get(sequence.seq_id)
        if step is None or state is None:
            return
        for depth, node in enumerate(path):
            state.keep(start + 1 + depth, step, first + 1 + node, 1, self.context)
        if self.pool is not None and path:  # copied with the next step's rows
            self._place(sequence, start + 1, len(path), None, step, [first + 1 + node for node in path])

    def _store(self, chunk: ScheduledChunk, step: int, first: int) -> None:
        """Queue the copy of ``chunk``'s rows (from row ``first`` of ``step``) into the store, and hand the store its
        sequence's blocks that are done."""
        sequence, store = chunk.sequence, self.store
        if chunk.length == 1 or chunk.draft_parents is not None:  # one final row, the newest token's: kept cheap
            destination = store.place_row(sequence.seq_id, chunk.start)
            if destination >= 0:
                destinations, steps, rows = self._writes
                destinations.append(destination)
                steps.append(step)
                rows.append(first)
        else:  # a chain's drafted rows tentatively (the next chunk's start says how many were kept)
            self._place(sequence, chunk.start, chunk.length, chunk.start + chunk.length - len(chunk.draft), step,
                        range(first, first + chunk.length))
        ready = store.ready(sequence.seq_id, len(sequence.token_ids))
        if ready:
            store.register(sequence.seq_id, self._block_keys(sequence, ready))

    def _place(self, sequence, start: int, count: int, final: int | None, step: int, rows) -> None:
        """Queue the copy of ``rows`` of ``step`` (positions ``start …`` of ``sequence``) into the store."""
        destinations, steps, sources = self._writes
        for position, destination, length in self.store.place(sequence.seq_id, start, count, final):
            destinations.extend(range(destination, destination + length))
            steps.extend([step] * length)
            sources.extend(rows[position - start : position - start + length])

    def _copy_to_store(self) -> None:
        """The queued copies into the store: one indexed copy per step they come from. A block handed back in the
        same step (its key already held, or evicted) may be taken and written again by another sequence: of the
        copies to one row only the last is made (an indexed copy with a row twice would leave either)."""
        if self._writes[0]:
            destinations, steps, rows = (np.array(queued, dtype=np.int64) for queued in self._writes)
            last = len(destinations) - 1 - np.unique(destinations[::-1], return_index=True)[1]
            gather_rows(self.store.rows, destinations[last], steps[last], rows[last], self._tensors)
            for queued in self._writes:
                del queued[:]

    def _block_keys(self, sequence, count: int) -> list[bytes]:
        """The prefix cache's keys of ``sequence``'s first ``count`` blocks."""
        spans = getattr(sequence.request, "content_spans", ())
        return self.pool.block_keys(sequence.seq_id, sequence.token_ids, count, spans)

    def _recall(self, chunk: ScheduledChunk) -> None:
        """A chunk that starts at a block boundary past every position the head holds of its sequence (a prefix-cache
        hit): the stored rows of the blocks before it, as if computed (the longest stored run ending there, at most
        ``context`` positions), in a step of their own."""
        sequence, start, size = chunk.sequence, chunk.start, self.store.block_size
        if start == 0 or start % size or chunk.draft_parents is not None:
            return
        state = self._sequences.get(sequence.seq_id)
        if state is not None and (state.first + state.held if state.held else state.next_position) >= start:
            return
        found = self.store.recall(self._block_keys(sequence, start // size), -(-self.context // size))
        if found is None:
            return
        first_block, held = found
        step = self._step = self._step + 1  # before the chunk's own step: a sequence's steps rise with its positions
        self._tensors[step] = held
        if state is None:
            state = self._sequences[sequence.seq_id] = HeadSequence(sequence)
        state.keep(first_block * size, step, 0, len(held), self.context)

    def _drop_unheld_steps(self) -> None:
        """Forget the steps' rows that no sequence holds a position in any more."""
        oldest = min((state.steps[0] for state in self._sequences.values() if state.held), default=self._step)
        for step in [s for s in self._tensors if s < oldest]:
            del self._tensors[step]

    @torch.inference_mode()
    def __call__(self, sequences: list, limits: list[int]) -> list[list[int]]:
        proposed, feeds = self._propose(sequences, limits)
        if proposed is None:
            return [[] for _ in sequences]
        return self._drafts(feeds, limits, proposed.tolist(), len(sequences))  # one device-to-host copy: [B, rounds, w]

    @torch.inference_mode()
    def on_device(self, sequences: list, limits: list[int]) -> tuple[torch.Tensor | None, list]:
        """The drafts as calling the drafter gives them, without waiting for the device: the drafted tokens in a flat
        device tensor (None: no draft), each sequence's draft (a list or ``DraftTree``) holding indices into it. The
        verification step takes its tokens from there; the host reads them with the step's samples
        (``Speculator.extend``)."""
        proposed, feeds = self._propose(sequences, limits)
        if proposed is None:
            return None, [[] for _ in sequences]
        flat = proposed.reshape(-1)
        return flat, self._drafts(feeds, limits, np.arange(flat.numel()).reshape(proposed.shape).tolist(), len(sequences))

    def _propose(self, sequences: list, limits: list[int]) -> tuple[torch.Tensor | None, list]:
        """The head's tokens for the sequences it can draft for, queued on the device: ``[feeds, rounds, tree_width]``
        (None when none can), and the feeds (index, slot, first position, steps, rows) they belong to."""
        feeds = []
        for index, (sequence, limit) in enumerate(zip(sequences, limits)):
            state = self._sequences.get(sequence.seq_id)
            if limit <= 0 or state is None:
                continue
            newest = len(sequence.token_ids) - 2  # the position whose hidden state, with the newest token, predicts the next
            if not state.held or state.first + state.held - 1 < newest:
                continue  # the model's hidden state there was not seen: nothing to draft from (the rows stay held)
            slot = self.cache.slot(sequence.seq_id)
            if slot is None:
                continue  # more sequences than slots: this one decodes without a draft
            first, steps, rows = state.take_rows(min(sequence.num_computed, newest + 1))
            if len(steps) and first + len(steps) - 1 == newest:
                feeds.append((index, slot, first, steps, rows))
        if not feeds:
            return None, feeds
        rounds = max(limits[index] for index, *_ in feeds)
        width = max(len(steps) for *_, steps, _ in feeds)
        graphs = self.graphs
        if graphs is not None and width <= self.chain + 1 and len(feeds) <= graphs.sizes[-1]:
            return graphs.draft(feeds, sequences)[:, :rounds], feeds
        return self.draft(*self._inputs(feeds, sequences, len(feeds), width), rounds), feeds

    def _drafts(self, feeds, limits: list[int], proposed: list, count: int) -> list:
        """Each of ``count`` sequences' draft from ``proposed[feed][round][rank]`` (tokens, or indices of them)."""
        drafts: list = [[] for _ in range(count)]
        for b, (index, *_) in enumerate(feeds):
            levels = proposed[b][: limits[index]]
            if self.tree_width == 1:
                drafts[index] = [level[0] for level in levels]
            else:  # the chain first (node d at level d: a kept chain prefix needs no KV move), then each level's
                # alternatives, children of the chain's node above them
                drafts[index] = DraftTree([level[0] for level in levels] + [t for level in levels for t in level[1:]],
                                          [d - 1 for d in range(len(levels))]
                                          + [d - 1 for d, level in enumerate(levels) for _ in level[1:]])
        return drafts

    def _inputs(self, feeds, sequences, batch: int, width: int, hidden: torch.Tensor | None = None,
                staged: torch.Tensor | None = None):
        """``draft``'s inputs for ``feeds`` padded to ``batch`` sequences of ``width`` positions: the hidden states
        (one indexed copy per step they come from), and the tokens, positions, valid flags and slots in one copy (into
        ``hidden`` and ``staged``, a graph's static inputs, when given). Padding rows repeat a sequence's last
        position and are not valid; padding sequences use the pad slot."""
        ints = np.zeros(3 * batch * width + batch, dtype=np.int64)
        tokens, positions, valid = (ints[i * batch * width : (i + 1) * batch * width].reshape(batch, width) for i in range(3))
        slots = ints[3 * batch * width :]
        slots[:] = self.cache.pad
        destinations, held_steps, held_rows = [], [], []
        for b, (index, slot, first, steps, rows) in enumerate(feeds):
            count = len(steps)
            tokens[b, :count] = sequences[index].token_ids[first + 1 : first + count + 1]
            positions[b, :count] = np.arange(first, first + count)
            positions[b, count:] = first + count - 1
            valid[b, :count] = 1
            slots[b] = slot
            destinations.append(np.arange(b * width, b * width + count))
            held_steps.append(steps)
            held_rows.append(rows)
        sample = self._tensors[int(feeds[0][3][0])]
        if hidden is None:
            hidden = sample.new_zeros(batch, width, sample.shape[-1])
        else:
            hidden.zero_()
        gather_rows(hidden.view(batch * width, -1), np.concatenate(destinations), np.concatenate(held_steps),
                    np.concatenate(held_rows), self._tensors)
        host = torch.from_numpy(ints)
        if staged is None:
            staged = pinned_to_device(host, sample.device)
        else:
            staged.copy_(host.pin_memory() if staged.is_cuda else host, non_blocking=True)
        return (hidden, *staged_views(staged, batch, width))

    def draft(self, hidden, tokens, positions, valid, slots, rounds: int) -> torch.Tensor:
        """Feed the positions, then ``rounds`` chain steps from each sequence's last valid one: the model's token ids
        of each round's ``tree_width`` likeliest, ``[B, rounds, tree_width]``. Tensor work only (a CUDA graph's body)."""
        head = self.head
        valid = valid != 0
        out = head.step(hidden, tokens, positions, valid, slots, self.cache, from_model=True)
        last_index = valid.sum(1) - 1  # [B]; a padding sequence's (-1) picks its last row, unused
        rows = torch.arange(len(slots), device=slots.device)
        last = out[rows, last_index]  # [B, H]
        position = positions[rows, last_index.clamp(min=0)] + 1
        every = torch.ones_like(valid[:, :1])
        chain = []
        for round_ in range(rounds):
            logits = head.logits(last)
            candidates = logits.argmax(-1, keepdim=True) if self.tree_width == 1 else logits.topk(self.tree_width, -1).indices
            candidates = head.to_target(candidates)  # [B, w]
            chain.append(candidates)
            if round_ + 1 == rounds:
                break
            last = head.step(last[:, None], candidates[:, :1], (position + round_)[:, None], every, slots, self.cache,
                             from_model=False)[:, 0]
        return torch.stack(chain, dim=1)

    def _forget_finished(self) -> None:
        for seq_id, state in list(self._sequences.items()):
            sequence = state.sequence
            if sequence.finish_reason is not None or (sequence.request is not None and sequence.request.aborted):
                del self._sequences[seq_id]
                self.cache.release(seq_id)
                if self.store is not None:
                    self.store.release(seq_id)


class HeadGraphs:
    """A ``HeadDrafter``'s drafting steps captured as CUDA graphs, one per batch size, each feeding up to ``chain + 1``
    positions a sequence and running ``chain`` rounds (a step that drafts fewer keeps the first rounds). Without
    ``capture`` (the CPU) the same padded static inputs run eagerly."""

    def __init__(self, drafter: HeadDrafter, slots: int, capture: bool = True):
        self.drafter = drafter
        self.sizes = [1 << i for i in range(max(slots - 1, 0).bit_length() + 1)]
        self.sizes[-1] = slots
        head, width = drafter.head, drafter.chain + 1
        weight = head.embed_tokens.weight
        # Per size: the hidden states, and one int64 buffer holding the tokens, positions, valid flags and slots.
        self._staged = {size: torch.zeros(3 * size * width + size, dtype=torch.long, device=weight.device)
                        for size in self.sizes}
        for size, staged in self._staged.items():
            staged[3 * size * width :] = drafter.cache.pad
        self._inputs = {size: (torch.zeros(size, width, head.model_width, dtype=weight.dtype, device=weight.device),
                               *staged_views(self._staged[size], size, width))
                        for size in self.sizes}
        self._outputs, self._graphs = {}, {}
        if capture:
            from autodeploy.custom_ops.graph_capture import GraphCapture

            graphs = GraphCapture(weight.device)
            for size in reversed(self.sizes):  # largest first into one memory pool
                with torch.inference_mode():
                    self._graphs[size], self._outputs[size] = graphs.capture(
                        lambda *args: drafter.draft(*args, drafter.chain), self._inputs[size])
            logger.info("%s: drafting CUDA graphs at batch sizes %s, %.2f GiB; %s", drafter.name, self.sizes,
                        graphs.pool_bytes() / 2**30, graphs.times)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def draft(self, feeds, sequences) -> torch.Tensor:
        """``draft`` for ``feeds`` (each at most ``chain + 1`` positions): the captured graph of the smallest size that
        holds them, replayed; its first ``len(feeds)`` rows."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(feeds))]
        inputs = self._inputs[size]
        self.drafter._inputs(feeds, sequences, size, inputs[1].shape[1], inputs[0], self._staged[size])
        if size not in self._graphs:  # not captured (the CPU): the same static inputs, eagerly
            return self.drafter.draft(*inputs, self.drafter.chain)[: len(feeds)]
        self._graphs[size].replay()
        return self._outputs[size][: len(feeds)]


def staged_views(staged: torch.Tensor, batch: int, width: int) -> tuple[torch.Tensor, ...]:
    """The tokens, positions and valid flags ``[batch, width]`` and slots ``[batch]`` held in one int64 buffer."""
    size = batch * width
    return (*(staged[i * size : (i + 1) * size].view(batch, width) for i in range(3)), staged[3 * size :])


def graph_embedding(graph) -> torch.Tensor | None:
    """The model's token embedding table: the weight of the graph's (first) plain embedding lookup."""
    for node in graph.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default):
        weight = node.args[0]
        if weight.op == "get_attr":
            return graph.get_parameter(weight.target) if weight.target in dict(graph.named_parameters()) else getattr(graph, weight.target)
    return None


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)
