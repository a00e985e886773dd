"""Greedy argmax over Llama-3's 128,256 logits: ``logits.argmax(-1)`` against the chunked argmax of
``runtime/sampler.py::greedy_tokens`` (chunk maxima, then the first chunk holding the row's maximum), at
several row counts, bf16 and float32, each timed inside a CUDA graph of 100 calls (median of 5 replays).

Run on a GPU: python scripts/time_argmax.py
"""

import statistics

import torch

from autodeploy.runtime import sampler

VOCAB = 128256


def timed(function, logits) -> float:
    function(logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            function(logits)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 10)  # µs a call
    return statistics.median(times)


def chunked(logits):
    rows, vocab = logits.shape
    chunk = sampler._argmax_chunk(vocab)
    values, within = logits.reshape(rows, vocab // chunk, chunk).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (best * chunk + within.gather(-1, best)).squeeze(-1)


for dtype in (torch.bfloat16, torch.float32):
    for rows in (1, 8, 32, 64, 128, 256, 512):
        logits = torch.randn(rows, VOCAB, device="cuda", dtype=dtype)
        assert torch.equal(chunked(logits), logits.argmax(-1))
        plain, split = timed(lambda x: x.argmax(-1), logits), timed(chunked, logits)
        print(f"{str(dtype):15s} rows {rows:4d}: argmax {plain:7.2f} µs, chunked {split:7.2f} µs "
              f"(chunk {sampler._argmax_chunk(VOCAB)})")
