"""The paged decode kernel alone at Llama-3-8B's attention shape, as a replayed decode step runs it.

    python3 scripts/time_decode_attention.py [fp8]

B decodes of about 200 keys (32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages), with the
host's longest length set to 8,192 as in a captured CUDA graph, so the grid has the splits a graph has.
Per B, over tile widths, warps, pipeline stages and forced splits per sequence (and, with the splits
chosen per batch, the grid's empty splits launched first or last): the eight fastest and the shipped launch, in microseconds per call (a CUDA graph of 20 calls), beside the K/V bytes over
4.27 TB/s and the error against the reference. With ``fp8``: float8_e4m3fn caches (half the bytes), the
launches tried with the dots in float16 (``paged_attention.FP8_IN_F16``, shipped) and in bfloat16.
"""

from __future__ import annotations

import sys

import torch

from autodeploy.custom_ops.cached_attention import cached_attention_reference
from autodeploy.custom_ops.triton import paged_attention
from autodeploy.custom_ops.triton.paged_attention import attend_over_cache

BANDWIDTH = 4.27e12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU (TRITON_INTERPRET=1): a check of B = 1 only
CAPTURED_MAX_KV = 8192
FP8 = sys.argv[1:] == ["fp8"]
CACHE_DTYPE = torch.float8_e4m3fn if FP8 else torch.bfloat16


def batch(decodes: int, keys: int = 200, page: int = 16):
    gen = torch.Generator().manual_seed(0)
    lengths = [keys - (i * 7) % 40 for i in range(decodes)]
    pages = [-(-n // page) for n in lengths]
    spare = -(-decodes // page)  # pages the reference writes this step's (unused) keys into
    order = torch.randperm(sum(pages) + spare, generator=gen)
    tables = torch.zeros(decodes, CAPTURED_MAX_KV // page, dtype=torch.int32)
    taken = 0
    for row, count in enumerate(pages):
        tables[row, :count] = order[taken : taken + count]
        taken += count
    k_cache = torch.randn(sum(pages) + spare, page, 8, 128, generator=gen).to(CACHE_DTYPE)
    v_cache = torch.randn(sum(pages) + spare, page, 8, 128, generator=gen).to(CACHE_DTYPE)
    free = order[taken:].long()
    slots = (free[:, None] * page + torch.arange(page)).flatten()[:decodes]
    q = torch.randn(1, decodes, 32, 128, generator=gen).to(torch.bfloat16)
    seq_start = torch.arange(decodes + 1, dtype=torch.int32)
    kv_lens = torch.tensor(lengths, dtype=torch.int32)
    cuda = [t.to(DEVICE) for t in (q, k_cache, v_cache, seq_start, kv_lens, tables, slots)]
    info = torch.tensor([0, decodes, 1, CAPTURED_MAX_KV], dtype=torch.int32)
    return cuda, info, sum(lengths) * 8 * 128 * 2 * CACHE_DTYPE.itemsize


def main() -> None:
    if DEVICE != "cuda":  # Triton 3.6's interpreter with numpy >= 2.4 (see tests/custom_ops/test_paged_attention_triton.py)
        from triton.runtime import interpreter

        patch = interpreter._patch_lang_tensor
        interpreter._patch_lang_tensor = lambda tensor, scope: (
            patch(tensor, scope), scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item())))
    original = paged_attention._decode_config
    # (BLOCK_N, warps, stages), swept on the GPU only
    configs = [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3) if not (n == 128 and s == 3)]
    for decodes in (1, 32, 256) if DEVICE == "cuda" else (1,):
        (q, k_cache, v_cache, seq_start, kv_lens, tables, slots), info, nbytes = batch(decodes)
        new_kv = q[:, :, :8]  # written to spare pages no table points to: the cached keys stay as they are
        expected = cached_attention_reference(q, new_kv, new_kv, k_cache.clone(), v_cache.clone(), seq_start,
                                              kv_lens, tables, slots, info, 128**-0.5)
        results = []
        # (config, forced splits, empty splits first); the shipped launch (None, None, None) first
        variants = [(None, None, None, True)] + [(c, s, True, True) for c in configs for s in (None, 1, 2, 4)] + [
            (c, None, False, True) for c in configs]
        if FP8:  # the dots in float16 (shipped) and in bfloat16, over the automatic splits
            variants = [(None, None, None, True), (None, None, None, False)] + [
                (c, None, True, f16) for c in configs for f16 in (True, False)]
        for config, splits, empty_first, f16 in variants if DEVICE == "cuda" else variants[:1]:
            paged_attention._decode_config = original if config is None else lambda dim_pad, one_wave=False, c=config: c
            paged_attention._EMPTY_SPLITS_FIRST = empty_first
            paged_attention.FP8_IN_F16 = f16
            run = lambda: attend_over_cache(q[0], k_cache, v_cache, seq_start, kv_lens, tables, info, 128**-0.5,  # noqa: E731
                                            num_decode_splits=splits)
            got = run()
            error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
            if DEVICE != "cuda":
                print(f"B={decodes} shipped launch: rel err {error:.1e} (interpreter: not timed)")
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    run()
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(5):
                start.record(); graph.replay(); end.record(); end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / 20)
            how = str(splits) if splits else {None: "shipped", True: "auto", False: "auto, empty splits last"}[empty_first]
            if FP8:
                how += ", float16 dots" if f16 else ", bfloat16 dots"
            results.append((sorted(times)[2], config, how, error))
        shipped = [r for r in results if r[2].startswith("shipped")]
        for micros, config, splits, error in sorted(results, key=lambda r: r[0])[:8] + shipped:
            print(f"B={decodes:<4d} BLOCK_N, warps, stages {config} splits {splits}: {micros:7.2f} us per call "
                  f"(merge included), floor {nbytes / BANDWIDTH * 1e6:6.2f} us, rel err {error:.1e}", flush=True)
        paged_attention._decode_config = original
        paged_attention._EMPTY_SPLITS_FIRST = None
        paged_attention.FP8_IN_F16 = True


if __name__ == "__main__":
    main()
