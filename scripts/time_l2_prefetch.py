"""Is a projection faster when its weight was prefetched into L2 while the kernels before it ran?

    python3 scripts/time_l2_prefetch.py [ROWS,...]      # default 1,32; on the GPU machine

A decode layer's q/k/v projection, then a stretch of kernels that barely use the memory (RoPE, the cache
write and attention: here a spin of a set length, or a read of a K/V-sized buffer, whose lines compete
for L2), then o_proj (Llama-3-8B shapes, bf16, the few-row kernel). Timed per layer from a CUDA graph of
many layers cycling over enough weight copies that nothing stays in L2 between layers (as in
``sweep_skinny_gemm.py``), with and without ``prefetch_l2`` of o_proj's weight (all of it, or its first
half) issued right after q/k/v on a side stream and joined after o_proj (as ``runtime/weight_prefetch.py``
does). The saving is what the prefetch could take off each layer of a step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from autodeploy.custom_ops.triton.l2_prefetch import prefetch_l2  # noqa: E402
from autodeploy.custom_ops.triton.skinny_gemm import skinny_linear  # noqa: E402
from autodeploy.runtime.weight_prefetch import join_prefetches, prefetch_after  # noqa: E402
from sweep_skinny_gemm import seconds_per_call  # noqa: E402

LAYERS = 24  # a graph of this many layers, each on its own weight copies (24 × 84 MB ≫ the 50 MB L2)


def time_graph(body, layers: int = LAYERS) -> float:
    """µs a layer of ``body(layer)`` replayed from a CUDA graph of ``layers`` layers."""
    return seconds_per_call(lambda _, layer: body(layer), list(range(layers)), None, calls=layers) * 1e6


def main() -> None:
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,32").split(",")]
    device = torch.device("cuda")
    qkv = [torch.randn(6144, 4096, device=device, dtype=torch.bfloat16) / 64 for _ in range(LAYERS)]
    o_proj = [torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) / 64 for _ in range(LAYERS)]
    kv = [torch.randn(10 << 20, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)]  # 20 MB a layer
    sleep_cycles_per_us = _calibrate_sleep()
    print(f"{torch.cuda.get_device_name()}: torch.cuda._sleep {sleep_cycles_per_us:.0f} cycles a µs")
    for rows in rows_list:
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        attn = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        sink = torch.empty(LAYERS, device=device, dtype=torch.float32)
        alone = {
            "q/k/v": time_graph(lambda i: skinny_linear(x, qkv[i], None)),
            "o_proj": time_graph(lambda i: skinny_linear(attn, o_proj[i], None)),
            "o_proj after prefetch, weight in L2": time_graph(lambda i: (prefetch_l2(o_proj[0]), torch.cuda._sleep(40000),
                                                                         skinny_linear(attn, o_proj[0], None))),
            "prefetch kernel alone": time_graph(lambda i: prefetch_l2(o_proj[i])),
        }
        print(f"rows {rows}: " + ", ".join(f"{name} {t:.2f} µs" for name, t in alone.items()))
        stretches = {f"spin {us} µs": (lambda i, c=int(us * sleep_cycles_per_us): torch.cuda._sleep(c)) for us in (0, 4, 8, 12)}
        stretches["read of 20 MB (K/V-like)"] = lambda i: torch.sum(kv[i], dim=0, out=sink[i])
        for name, stretch in stretches.items():
            timed = {}
            for label, fetched in [("none", 0), ("half", 16 << 20), ("all", None)]:
                def layer(i, fetched=fetched, stretch=stretch):
                    skinny_linear(x, qkv[i], None)
                    if fetched != 0:  # on a side stream, as runtime/weight_prefetch.py does, joined after o_proj
                        prefetch_after(x, o_proj[i], fetched if fetched is not None else 1 << 40)
                    stretch(i)
                    skinny_linear(attn, o_proj[i], None)
                    join_prefetches(None, 0)
                timed[label] = time_graph(layer)
            print(f"  {name:26s} layer: no prefetch {timed['none']:7.2f} µs | half {timed['half']:7.2f} "
                  f"({timed['half'] - timed['none']:+.2f}) | all {timed['all']:7.2f} ({timed['all'] - timed['none']:+.2f})")


def _calibrate_sleep() -> float:
    cycles = 200000
    seconds_us = time_graph(lambda i: torch.cuda._sleep(cycles), layers=8)
    return cycles / seconds_us


if __name__ == "__main__":
    main()
