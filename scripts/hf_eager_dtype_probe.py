"""HF eager generate() per-token time for a random BART-large by dtype, alone in a process (issue 44: the bench's
bf16 HF-eager baseline read 70 ms a token on an H100 where float32 read ~4.5 ms on an H200).

    python3 scripts/hf_eager_dtype_probe.py [--tokens 32]
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoConfig, BartForConditionalGeneration

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "models" / "bart-large"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(CONFIG)
    ids = torch.randint(10, 30000, (1, 512), device="cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        model = BartForConditionalGeneration(config).to("cuda", dtype).eval()
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                      do_sample=False, disable_compile=True)
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        began = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        took = time.perf_counter() - began
        print(f"{dtype}: {1e3 * took / args.tokens:.2f} ms a token ({args.tokens} tokens, batch 1, 512 in)", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
