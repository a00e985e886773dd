"""Greedy output with and without speculative decoding, prompt by prompt (issue 42: token-identical on the GPU).

  python scripts/spec_identity.py MODEL --dataset prompts.jsonl --count 100 --method eagle3 --draft HEAD [--num-tokens 4]
      [--batch-invariant]

Prints how many of the prompts give the same tokens, and for each that does not, where they part and the two
tokens' logits under the model without speculation (a near-tie there is bfloat16 rounding, not a wrong token).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from autodeploy import SamplingParams, autodeploy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--method", required=True)
    parser.add_argument("--draft", default=None, help="speculative.model")
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--tree-width", type=int, default=1)
    parser.add_argument("--dtype", default=None, help="e.g. float32 (default: the checkpoint's)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-invariant", action="store_true", help="both deployments with batch_invariant: true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.dataset.read_text().splitlines() if line.strip()]
    prompts = (prompts * (args.count // max(len(prompts), 1) + 1))[: args.count]
    # Past the file's prompts, the same prompts with a prefix: other positions, other tokens.
    prompts = [p if i < len(set(prompts)) else f"# variant {i}\n{p}" for i, p in enumerate(prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    dtype = {"dtype": args.dtype} if args.dtype else {}
    if args.batch_invariant:
        dtype["batch_invariant"] = True
    base = autodeploy(args.model, **dtype)
    expected = [o.token_ids for o in base.generate(prompts, params)]
    spec = autodeploy(args.model, **dtype, speculative={"method": args.method, "model": args.draft, "auto": False,
                                                        "num_tokens": args.num_tokens, "tree_width": args.tree_width})
    got = [o.token_ids for o in spec.generate(prompts, params)]
    same = sum(a == b for a, b in zip(expected, got))
    differences = []
    for prompt, a, b in zip(prompts, expected, got):
        if a == b:
            continue
        at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        ids = base.engine.tokenize(prompt) + a[:at]
        logits = base.engine.prompt_logits(ids)[-1].float()
        differences.append({"at": at, "tokens": [a[at], b[at]],
                            "logits": [round(float(logits[a[at]]), 4), round(float(logits[b[at]]), 4)]})
    stats = spec.engine.speculator.stats
    summary = {"method": args.method, "tree_width": args.tree_width, "dtype": args.dtype or "checkpoint",
               "batch_invariant": args.batch_invariant, "prompts": len(prompts), "identical": same, "differences": differences,
               "acceptance_length": round(stats.acceptance_length, 3), "acceptance_rate": round(stats.acceptance_rate, 3)}
    print("identity:", json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
