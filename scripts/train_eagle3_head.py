"""Train an EAGLE-3 head (or an MTP layer: ``--kind mtp``) for a model (issue 42's trained pair: the ~100M target of ``scripts/spec_pair_gpu.sh``).

The head (``autodeploy/runtime/eagle3.py``) reads the model's hidden states entering three of its layers and the
next token's embedding and predicts the token after. It learns the model's own next-token distribution
(restricted to a draft vocabulary: the corpus's most frequent tokens), on the demo model's corpus (the Python
standard library's sources), with EAGLE-3's training-time test: the loss also covers ``--ttt-steps - 1``
further chain steps where the head reads its own previous output in place of the model's hidden state, with
the attention it will have at inference (the model-fed positions up to the chain's start, then the chain's own).

Steps: load the target (frozen, bf16 on CUDA); tokenize the corpus with its tokenizer; pick the draft vocabulary;
start ``lm_head`` and ``norm`` from the target's; train with AdamW (warmup, cosine) for ``--minutes``; save the
head in the EAGLE-3 format (without the embedding: the model's is used) and print the held-out top-1 agreement
with the target's greedy token at each chain step (what acceptance to expect per position).

  python scripts/train_eagle3_head.py --target /tmp/spec-target --out /tmp/spec-eagle3 --minutes 2 --seed 0
  # CPU smoke check: a few steps on a handful of files
  python scripts/train_eagle3_head.py --target autodeploy/assets/tiny-code-llama --out /tmp/e3 --device cpu \\
      --steps 3 --batch-size 2 --seq-len 64 --max-files 20
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_demo_model import collect_sources, lr_factor, random_windows, tokenize  # noqa: E402

from autodeploy.runtime.eagle3 import Eagle3Config, Eagle3Head, eagle3_config, save_eagle3_head  # noqa: E402
from autodeploy.runtime.hidden_state_heads import HiddenStateHead, rotate  # noqa: E402
from autodeploy.runtime.hidden_state_heads import LayerShape  # noqa: E402
from autodeploy.runtime.mtp import MTPHead, save_mtp_layer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the model's folder (HF checkpoint and tokenizer)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--minutes", type=float, default=None)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--kind", choices=("eagle3", "mtp"), default="eagle3",
                        help="mtp: a multi-token-prediction layer over the final hidden state, saved into a copy of the "
                             "target's checkpoint (model.layers.{L}.*, num_nextn_predict_layers: 1)")
    parser.add_argument("--ttt-steps", type=int, default=3, help="chain steps the loss covers (1: no training-time test)")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="default: the model's vocabulary")
    parser.add_argument("--layers", type=int, nargs=3, default=None, help="default: 2, L/2, L-3")
    parser.add_argument("--source-dir", type=Path, default=None)
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--metrics-json", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def chain_forward(head: HiddenStateHead, hidden: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits of each chain step ``j`` at every position ``t`` (``[B, T, vocab]``), as inference computes them:
    step 0 reads the model's hidden state at ``t`` and token ``t + 1``; step ``j`` reads step ``j - 1``'s output at
    ``t - 1`` and token ``t + 1`` and attends to step 0's keys up to ``t - j`` and to step ``m``'s key at
    ``t - j + m`` (``m = 1 … j``). Rows ``t < j`` are not meaningful."""
    c = head.shape
    attn, mlp, post_norm = head.block()
    batch, length = tokens.shape
    positions = torch.arange(length, device=tokens.device)
    cos, sin = head.rotary(hidden, positions[None].expand(batch, -1))
    embedded = head.embed_tokens(tokens).to(hidden.dtype)
    keys, values, logits = [], [], []
    x = hidden
    for j in range(steps):
        if j:
            x = torch.cat([x[:, :1] * 0, x[:, :-1]], dim=1)  # step j at t reads step j-1's output at t-1
        attention_in, x = head.layer_input(x, embedded, from_model=j == 0)
        q = rotate(attn.q_proj(attention_in).view(batch, length, attn.heads, c.head_dim).transpose(1, 2), cos, sin)
        keys.append(rotate(attn.k_proj(attention_in).view(batch, length, attn.kv_heads, c.head_dim).transpose(1, 2), cos, sin))
        values.append(attn.v_proj(attention_in).view(batch, length, attn.kv_heads, c.head_dim).transpose(1, 2))
        t = positions[:, None]
        s = positions[None, :]
        mask = torch.cat([s <= t - j] + [s == t - j + m for m in range(1, j + 1)], dim=1)  # [T, (j + 1) T]
        out = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                             enable_gqa=attn.heads != attn.kv_heads)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        x = x + mlp(post_norm(x))
        logits.append(head.logits(x))
    return logits


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of the corpus, ascending."""
    counts = torch.bincount(tokens, minlength=vocab_size)
    return counts.topk(size).indices.sort().values


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval().requires_grad_(False)
    config = target.config
    train_texts, eval_texts = collect_sources(args.source_dir or Path(sysconfig.get_paths()["stdlib"]), args.max_files)
    train_tokens, eval_tokens = tokenize(tokenizer, train_texts), tokenize(tokenizer, eval_texts)
    draft_size = min(args.draft_vocab_size or config.vocab_size, config.vocab_size)
    ids = draft_vocabulary(train_tokens, config.vocab_size, draft_size)
    layers = args.layers or [min(2, config.num_hidden_layers - 1), config.num_hidden_layers // 2,
                             max(config.num_hidden_layers - 3, 1)]
    if args.kind == "mtp":  # the final hidden state, the full vocabulary
        draft_size, layers = config.vocab_size, [config.num_hidden_layers]
        ids = torch.arange(draft_size)
        head = MTPHead(LayerShape.of(config.to_dict()))
        with torch.no_grad():
            head.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
            head.shared_head.head.weight.copy_(target.get_output_embeddings().weight.float())
            head.shared_head.norm.weight.copy_(target.model.norm.weight.float())
        head.shared_head.head.requires_grad_(False)
    else:
        head = Eagle3Head(Eagle3Config.from_dict(eagle3_config(config, draft_size, layers)), config.num_hidden_layers)
        with torch.no_grad():
            head.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[ids].float())
            head.norm.weight.copy_(target.model.norm.weight.float())
            head.d2t.copy_(ids - torch.arange(draft_size))
    head = head.to(device)
    head.embed_tokens.requires_grad_(False)
    ids = ids.to(device)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    eval_batches = [random_windows(eval_tokens, args.batch_size, args.seq_len + 2, generator) for _ in range(4)]

    def losses(batch: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        batch = batch.to(device)
        with torch.no_grad():
            out = target(batch, output_hidden_states=True)
            # hidden_states[i]: what enters layer i; hidden_states[L]: the final norm's output (MTP's input)
            fused = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1).float()
            teacher = out.logits[:, 1:, ids].float().softmax(-1)  # what the model predicts after token t + 1
            greedy = out.logits[:, 1:].argmax(-1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = chain_forward(head, fused[:, :-1], batch[:, 1:], args.ttt_steps)
        total, agreement = 0.0, []
        for j, step_logits in enumerate(logits):
            rows = slice(j, None)
            log_probs = step_logits[:, rows].float().log_softmax(-1)
            total = total + 0.8**j * -(teacher[:, rows] * log_probs).sum(-1).mean()
            agreement.append((ids[step_logits[:, rows].argmax(-1)] == greedy[:, rows]).float().mean().item())
        return total, agreement

    began, step = time.perf_counter(), 0
    budget = args.minutes * 60 if args.minutes else math.inf
    while step < args.steps and time.perf_counter() - began < budget:
        progress = max(step / args.steps, (time.perf_counter() - began) / budget)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(progress, step, args.warmup_steps, 0.05)
        loss, agreement = losses(random_windows(train_tokens, args.batch_size, args.seq_len + 2, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        step += 1
        if step % 50 == 0 or step == 1:
            print(f"step {step} loss {loss.item():.3f} agreement {[round(a, 3) for a in agreement]} "
                  f"{time.perf_counter() - began:.0f} s", flush=True)
    seconds = time.perf_counter() - began
    head.eval()
    with torch.no_grad():
        held_out = [losses(batch)[1] for batch in eval_batches]
    agreement = [sum(a[j] for a in held_out) / len(held_out) for j in range(args.ttt_steps)]
    if args.kind == "mtp":
        shutil.copytree(args.target, args.out, dirs_exist_ok=True)
        save_mtp_layer(head, args.out)
    else:
        save_eagle3_head(head, args.out)
    parameters = sum(p.numel() for name, p in head.named_parameters() if not name.startswith("embed_tokens"))
    metrics = {"steps": step, "seconds": round(seconds, 1), "parameters": parameters, "layers": layers,
               "draft_vocab_size": draft_size, "held_out_agreement_by_step": [round(a, 4) for a in agreement],
               "seed": args.seed}
    print("eagle3 head:", json.dumps(metrics))
    if args.metrics_json:
        args.metrics_json.write_text(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
