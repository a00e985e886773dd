"""Train the tiny code model that `autodeploy run` uses when it is given no model.

The result is a ~10M-parameter `LlamaForCausalLM` with its own byte-level BPE tokenizer, trained on the
Python standard library's own ``.py`` sources (so it needs no download), saved as a sharded bfloat16
checkpoint under ``autodeploy/assets/tiny-code-llama/``. It is small enough to live in the repository and
good enough to continue ``def fibonacci(n):`` with something that looks like Python.

Steps, top to bottom:
  1. collect the .py sources (default: the stdlib of the Python running this script); hold out every 50th
     file for eval
  2. train a byte-level BPE tokenizer (ByteLevel pre-tokenizer + decoder, so indentation round-trips)
  3. tokenize, joining files with ``<|endoftext|>`` (which is also bos/eos/pad)
  4. train with AdamW, linear warmup + cosine decay over the first bound reached (steps, epochs, wall
     time), bf16 autocast on CUDA; the weights with the best held-out loss are the ones saved
  5. save model (bf16, shards of <= 10 MB) and tokenizer (with the chat template, ``CHAT_TEMPLATE``), then print
     greedy samples

The stdlib is only ~8M tokens, so data, not compute, bounds quality: past ~10 epochs the held-out loss
rises. Debian/Ubuntu Pythons ship the stdlib without its test suite (a third of the text is left); point
--source-dir at a full CPython stdlib (pyenv, python.org) to reproduce the checked-in model.

A larger model on the same tokenizer is the target that the demo model drafts for in speculative decoding
(issue 42; seed 0): ``--tokenizer autodeploy/assets/tiny-code-llama --hidden-size 768 --intermediate-size 2048
--layers 12`` (~100M parameters).

Examples:
  # the checked-in model (CPython 3.11.7's stdlib, one H200, ~40 s of training)
  python scripts/train_demo_model.py --device cuda --compile --source-dir ~/.pyenv/versions/3.11.7/lib/python3.11 \\
      --out autodeploy/assets/tiny-code-llama
  # CPU smoke check (seconds): small data, a handful of steps
  python scripts/train_demo_model.py --device cpu --steps 4 --batch-size 2 --seq-len 128 \\
      --max-files 60 --out /tmp/tiny-code-llama
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
# Saved with the tokenizer (chat_template.jinja) so that chat clients work with the demo out of the box; the
# model never saw a chat, and writes Python whatever it is asked.
CHAT_TEMPLATE = r"""{#- tiny-code-llama's chat: <|role|> turns, each ended by the end-of-text token the model stops at. Tools are
    described in the system turn and called in Hermes tags, the format autodeploy's tool-call parser reads. -#}
{{- bos_token }}
{%- set system = messages[0] if messages and messages[0].role in ('system', 'developer') else none %}
{%- if system or tools %}
    {{- '<|system|>\n' }}
    {%- if system %}
        {{- system.content }}
        {%- if tools %}
            {{- '\n\n' }}
        {%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- 'You may call these functions (JSON Schema):\n<tools>\n' }}
        {%- for tool in tools %}
            {{- tool | tojson }}
            {{- '\n' }}
        {%- endfor %}
        {{- '</tools>\nTo call one, write:\n<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>' }}
    {%- endif %}
    {{- eos_token + '\n' }}
{%- endif %}
{%- for message in (messages[1:] if system else messages) %}
    {%- if message.role == 'tool' %}
        {{- '<|tool|>\n<tool_response>\n' + message.content + '\n</tool_response>' }}
    {%- else %}
        {{- '<|' + ('system' if message.role == 'developer' else message.role) + '|>\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set arguments = call.function.arguments %}
            {{- '<tool_call>\n{"name": ' + call.function.name | tojson + ', "arguments": ' }}
            {{- arguments if arguments is string else arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
    {%- endif %}
    {{- eos_token + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\n' }}
{%- endif %}
"""
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os")
# Files above this size are data tables or generated text (pydoc topics, unicode tables), not code.
MAX_FILE_BYTES = 400_000
EVAL_EVERY_NTH_FILE = 50


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder the checkpoint and tokenizer are saved to")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=100_000, help="upper bound on optimizer steps")
    parser.add_argument("--minutes", type=float, default=None, help="wall-time budget for the training loop")
    parser.add_argument("--max-epochs", type=float, default=10.0,
                        help="upper bound on passes over the training tokens (the stdlib is small; more overfits)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.05, help="final lr as a fraction of --lr")
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="reuse this folder's tokenizer instead of training one (a speculative-decoding target that the "
                             "demo model drafts for: --tokenizer autodeploy/assets/tiny-code-llama)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--source-dir", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="folder of .py files to train on (default: this Python's stdlib; Debian and Ubuntu "
                             "builds ship it without its test suite, which leaves about a third of the text)")
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N source files (smoke runs)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (falls back to eager on error)")
    parser.add_argument("--metrics-json", type=Path, default=None, help="also write the training figures here")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def collect_sources(source_dir: Path, max_files: int | None) -> tuple[list[str], list[str]]:
    """Return (train_texts, eval_texts): the .py files under source_dir, in a fixed order."""
    paths = sorted(p for p in source_dir.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    texts = []
    for path in paths:
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test fixtures are deliberately not UTF-8
        if text.strip():
            texts.append(text)
    texts = texts[:max_files]
    train = [t for i, t in enumerate(texts) if i % EVAL_EVERY_NTH_FILE != EVAL_EVERY_NTH_FILE - 1]
    held_out = [t for i, t in enumerate(texts) if i % EVAL_EVERY_NTH_FILE == EVAL_EVERY_NTH_FILE - 1]
    print(f"data: {len(texts)} files from {source_dir} ({sum(map(len, texts)) / 1e6:.1f}M chars), "
          f"{len(held_out)} held out", flush=True)
    return train, held_out or train[-1:]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte is representable, and spaces/newlines decode back exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eot_id = tokenizer.token_to_id(END_OF_TEXT)
    # Every training document follows an <|endoftext|>, so prompts get the same token in front (as bos).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{END_OF_TEXT} $A",
        pair=f"{END_OF_TEXT} $A {END_OF_TEXT} $B",
        special_tokens=[(END_OF_TEXT, eot_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        unk_token=None,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def tokenize(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One flat stream: <eot> file0 <eot> file1 ... (the tokenizer's template adds each leading <eot>)."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=True)
    return torch.tensor([token for encoding in encodings for token in encoding.ids], dtype=torch.int64)


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    head_dim = 64
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // head_dim,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def random_windows(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """batch_size windows of seq_len + 1 tokens at random offsets (one gather, on the tokens' device)."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size, 1), generator=generator)
    return tokens[(starts + torch.arange(seq_len + 1)).to(tokens.device)]


def lr_factor(progress: float, step: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warmup over steps, then cosine from 1 to min_ratio over progress in [0, 1]."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, eval_batches: list[torch.Tensor], device: torch.device) -> float:
    model.eval()
    losses = [next_token_loss(model, batch, device).item() for batch in eval_batches]
    model.train()
    return sum(losses) / len(losses)


def greedy_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, device: torch.device) -> dict:
    model.eval()
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        encoded = tokenizer(prompt, return_tensors="pt").to(device)
        with torch.no_grad():
            output = model.generate(**encoded, max_new_tokens=60, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        samples[prompt] = tokenizer.decode(output[0], skip_special_tokens=True)
    return samples


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    wall_start = time.time()

    train_texts, eval_texts = collect_sources(args.source_dir, args.max_files)
    t0 = time.time()
    tokenizer = (PreTrainedTokenizerFast.from_pretrained(args.tokenizer) if args.tokenizer is not None
                 else train_tokenizer(train_texts, args.vocab_size))
    sample = "def f(x):\n\tif x:\n        return '\\n'  # done\n\n"
    assert tokenizer.decode(tokenizer(sample)["input_ids"], skip_special_tokens=True) == sample
    train_tokens = tokenize(tokenizer, train_texts).to(device)
    eval_tokens = tokenize(tokenizer, eval_texts)
    print(f"tokenizer: vocab {len(tokenizer)}, trained and applied in {time.time() - t0:.0f}s; "
          f"{len(train_tokens) / 1e6:.2f}M train tokens, {len(eval_tokens) / 1e6:.2f}M eval tokens", flush=True)

    generator = torch.Generator().manual_seed(args.seed)
    eval_batches = [random_windows(eval_tokens, args.batch_size, args.seq_len, generator).to(device) for _ in range(8)]

    model = build_model(args, tokenizer).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters ({model.config.num_hidden_layers} layers, "
          f"hidden {model.config.hidden_size}, {model.config.num_attention_heads} heads / "
          f"{model.config.num_key_value_heads} kv heads)", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    forward = model
    if args.compile:
        forward = torch.compile(model)

    tokens_per_step = args.batch_size * args.seq_len
    max_steps = min(args.steps, max(1, int(args.max_epochs * len(train_tokens) / tokens_per_step)))
    budget_s = args.minutes * 60 if args.minutes else math.inf
    warmup = min(args.warmup_steps, max(1, max_steps // 10))
    time_limit = f"{args.minutes:g} min" if args.minutes else "no time limit"
    print(f"training: up to {max_steps} steps of {tokens_per_step} tokens ({time_limit})", flush=True)
    best = {"eval_loss": math.inf, "step": 0, "state": None}
    loop_start = time.time()
    step = 0
    log_time, log_step = loop_start, 0
    while step < max_steps:
        elapsed = time.time() - loop_start
        if elapsed >= budget_s:
            break
        progress = max(step / max_steps, elapsed / budget_s)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(progress, step, warmup, args.min_lr_ratio)

        batch = random_windows(train_tokens, args.batch_size, args.seq_len, generator)
        try:
            loss = next_token_loss(forward, batch, device)
        except Exception as error:  # torch.compile failing must not cost the run: fall back to eager
            if forward is model:
                raise
            print(f"torch.compile failed ({type(error).__name__}: {error}); continuing eager", flush=True)
            forward = model
            loss = next_token_loss(forward, batch, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % args.log_every == 0 or step == 1:
            train_loss = loss.item()
            now = time.time()
            tokens_per_s = (step - log_step) * tokens_per_step / (now - log_time)
            log_time, log_step = now, step
            print(f"step {step:6d}  loss {train_loss:.3f}  lr {optimizer.param_groups[0]['lr']:.2e}  "
                  f"{tokens_per_s / 1e3:.0f}k tok/s  {now - loop_start:.0f}s", flush=True)
        if step % args.eval_every == 0:
            eval_loss = evaluate(model, eval_batches, device)
            print(f"step {step:6d}  eval loss {eval_loss:.3f}", flush=True)
            if eval_loss < best["eval_loss"]:
                best = {"eval_loss": eval_loss, "step": step, "state": copy.deepcopy(model.state_dict())}

    train_s = time.time() - loop_start
    train_loss = loss.item()
    final_eval = evaluate(model, eval_batches, device)
    if final_eval <= best["eval_loss"]:
        best = {"eval_loss": final_eval, "step": step, "state": None}
    else:
        model.load_state_dict(best["state"])
    print(f"done: {step} steps in {train_s:.0f}s, final train loss {train_loss:.3f}, final eval loss "
          f"{final_eval:.3f}; saving weights of step {best['step']} (eval loss {best['eval_loss']:.3f})", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, max_shard_size="10MB")
    tokenizer.save_pretrained(args.out)

    samples = greedy_samples(model, tokenizer, device)
    for prompt, text in samples.items():
        print(f"--- sample for {prompt!r} ---\n{text}\n", flush=True)

    if args.metrics_json:
        args.metrics_json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "parameters": n_params,
            "train_tokens": len(train_tokens),
            "eval_tokens": len(eval_tokens),
            "steps": step,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "tokens_seen": step * tokens_per_step,
            "epochs": round(step * tokens_per_step / len(train_tokens), 2),
            "train_seconds": round(train_s, 1),
            "tokens_per_second_overall": round(step * tokens_per_step / train_s),
            "tokens_per_second_last_interval": round(tokens_per_s),
            "final_train_loss": round(train_loss, 4),
            "final_eval_loss": round(final_eval, 4),
            "saved_step": best["step"],
            "saved_eval_loss": round(best["eval_loss"], 4),
            "wall_seconds": round(time.time() - wall_start, 1),
            "samples": samples,
        }, indent=2))


if __name__ == "__main__":
    main()
