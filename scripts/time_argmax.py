"""Greedy argmax over Llama-3's 128,256 logits: ``logits.argmax(-1)`` against the chunked argmax of
``runtime/sampler.py::greedy_tokens`` (chunk maxima, then the first chunk holding the row's maximum), at
several row counts, bf16 and float32, each timed inside a CUDA graph of 100 calls (``sweep_skinny_gemm.seconds_per_call``: median of 5 replays).

Run on a GPU: python scripts/time_argmax.py
"""

import sys
from pathlib import Path

import torch

from autodeploy.runtime import sampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_skinny_gemm import seconds_per_call  # noqa: E402

VOCAB = 128256


def timed(function, logits) -> float:
    """µs a call, in a CUDA graph of 100 calls (one logits tensor: it stays in L2, as the engine's does)."""
    return seconds_per_call(lambda x, _: function(x), [None], logits, calls=100) * 1e6


def chunked(logits):
    return sampler.chunked_argmax(logits, sampler._argmax_chunk(logits.shape[1]))


for dtype in (torch.bfloat16, torch.float32):
    for rows in (1, 8, 32, 64, 128, 256, 512):
        logits = torch.randn(rows, VOCAB, device="cuda", dtype=dtype)
        assert torch.equal(chunked(logits), logits.argmax(-1))
        plain, split = timed(lambda x: x.argmax(-1), logits), timed(chunked, logits)
        print(f"{str(dtype):15s} rows {rows:4d}: argmax {plain:7.2f} µs, chunked {split:7.2f} µs "
              f"(chunk {sampler._argmax_chunk(VOCAB)})")
