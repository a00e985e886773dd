"""What a batch job's trip through the server's routes costs against ``LLM.generate`` on the same prompts (issue 45).

Writes ``--lines`` completion requests (the demo corpus's kind of prompts, greedy, ``--max-tokens`` each), runs them
with ``run_batch_file`` and, on the same engine, with one ``generate`` call; prints output tok/s of each.

    python scripts/batch_overhead.py [--lines 256] [--max-tokens 32] [--set device=cpu --set dtype=float32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from autodeploy import SamplingParams, autodeploy
from autodeploy.serve.batch_job import run_batch_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="0", help="comma-separated; 0: run_batch_file's default")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    llm = autodeploy(args.model, set_arguments=args.sets)
    prompts = [f"def task_{i}(values):\n    # {'sort' if i % 2 else 'count'} the values" for i in range(args.lines)]
    folder = Path(tempfile.mkdtemp(prefix="batch-overhead-"))
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                          "body": {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                                                   "ignore_eos": True}}) + "\n" for i, p in enumerate(prompts)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:8], params)  # warm-up
    began = time.perf_counter()
    outputs = llm.generate(prompts, params)
    offline = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - began)
    print(f"generate: {offline:.1f} output tok/s (max_batch_size {llm.settings.max_batch_size})")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        output = folder / f"out-{concurrency}.jsonl"
        summary = run_batch_file(llm, source, output, served_model_name="m", progress=False, concurrency=concurrency or None)
        print(f"batch file, concurrency {concurrency or 'default'}: {summary.output_tokens / summary.seconds:.1f} output tok/s "
              f"({summary.output_tokens / summary.seconds / offline:.2f}×); {summary.line()}")


if __name__ == "__main__":
    main()
