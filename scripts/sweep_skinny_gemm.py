"""The few-row linear kernel against cuBLAS at Llama-3-8B's projection shapes, and a sweep of its launches.

    python3 scripts/sweep_skinny_gemm.py [ROWS,...]      # default 1,32
    python3 scripts/sweep_skinny_gemm.py gated [ROWS]    # gate/up with SwiGLU's activation; default 32
    python3 scripts/sweep_skinny_gemm.py tma [ROWS,...]  # the TMA kernel alone, K split up to 8 ways; default 32

Every time is per call from a CUDA graph of many calls (no launch gaps, as in a replayed decode step),
cycling over enough weight copies that none is read from L2. Prints, per shape and row count: the
bandwidth floor (weight bytes over 4.27 TB/s), cuBLAS, the default launch (``skinny_config``) and the
best launch of the sweep, each with its share of the floor, and checks the best against the reference.
``gated`` times gate/up with its activation: ``skinny_linear`` then ``gated_activation`` (two kernels)
against ``skinny_gated_linear`` (one) at its default launch and at 32 – 128 weight rows of each half and
2 – 4 stages, each checked against the float32 reference.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

from autodeploy.custom_ops.triton.gated_activation import gated_activation
from autodeploy.custom_ops.triton.skinny_gemm import (
    SkinnyConfig, skinny_config, skinny_gated_config, skinny_gated_linear, skinny_linear)

BANDWIDTH = 4.27e12  # bytes/s, the H200's measured copy bandwidth (notes/select.md)
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
L2_BYTES = 256 << 20  # cycle over at least this many weight bytes


def seconds_per_call(fn, weights, x, calls: int = 48) -> float:
    graph = torch.cuda.CUDAGraph()
    fn(x, weights[0])
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for index in range(calls):
            fn(x, weights[index % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(samples)[len(samples) // 2]


def sweep(rows: int, tma_only: bool = False) -> list[SkinnyConfig]:
    block_m = min(max(16, 1 << (rows - 1).bit_length()), 64)
    if tma_only:
        # Since a split launch sums its partials in the kernel (arrival counters), splitting K costs no second
        # kernel: more programs than the unsplit tiles' 64 – 96 may fill the card's 132 SMs better.
        # Stages: as many as fit, up to four (skinny_config's rule).
        return [SkinnyConfig(block_m, n, k, s, num_warps=4, num_stages=min(4, (200 << 10) // ((block_m + n) * k * 2)), tma=True)
                for n, k, s in itertools.product([32, 64, 128], [128, 256], [1, 2, 3, 4, 8])]
    if rows == 1:
        space = itertools.product([1], [4, 8, 16, 32], [256, 512, 1024], [1, 2, 4], [4])
    else:
        # The plain kernel lost to the swapped one at every shape (notes/perf.md); narrow weight tiles (16, 32
        # rows: Ampere-style MMAs) put more programs on the narrow projections.
        threads = [SkinnyConfig(block_m, n, k, s, num_warps=w, num_stages=st, swap=True)
                   for n, k, s, w, st in itertools.product([16, 32, 64, 128], [64, 128, 256], [1, 2, 4], [4, 8], [3, 4])]
        # The same swapped tiles fetched by the TMA unit, deeper pipelines beside them.
        tma = [SkinnyConfig(block_m, n, k, s, num_warps=4, num_stages=st, tma=True)
               for n, k, s, st in itertools.product([64, 128], [64, 128, 256], [1, 2], [3, 4, 5])]
        return threads + tma
    return [SkinnyConfig(m, n, k, s, w) for m, n, k, s, w in space]


def operands(n: int, k: int, rows: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Enough copies of a bfloat16 weight[n, k] that cycling over them misses L2, and x[rows, k]."""
    copies = max(2, -(-L2_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    return weights, torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)


def sweep_gated(rows: int, sms: int) -> None:
    n, k = SHAPES["gate_up"]
    inner = n // 2
    weights, x = operands(n, k, rows)
    floor = n * k * 2 / BANDWIDTH

    def two_kernels(a, w):
        gate_up = skinny_linear(a, w, None)
        return gated_activation(gate_up[:, :inner], gate_up[:, inner:], "silu", out=gate_up[:, :inner])

    default = skinny_gated_config(rows, inner, k, sms, tma=True)
    launches = [default] + [replace(default, block_n=n_half, num_stages=stages)
                            for n_half, stages in itertools.product([32, 64, 128], [2, 3, 4])]
    expected = F.silu(x.float() @ weights[0][:inner].float().T) * (x.float() @ weights[0][inner:].float().T)
    print(f"gate_up+silu M={rows} floor {floor * 1e6:6.2f} µs | skinny_linear + gated_activation "
          f"{seconds_per_call(two_kernels, weights, x) * 1e6:7.2f} µs")
    for config in dict.fromkeys(launches):
        try:
            seconds = seconds_per_call(lambda a, w, c=config: skinny_gated_linear(a, w, "silu", config=c), weights, x)
        except Exception as error:  # a launch that does not compile (registers, shared memory) is skipped
            print(f"  skip {config}: {type(error).__name__}: {str(error)[:120]}")
            continue
        got = skinny_gated_linear(x, weights[0], "silu", config=config).float()
        print(f"  {'default ' if config == default else ''}{config.block_n}/{config.block_k}/s{config.num_stages} "
              f"{seconds * 1e6:7.2f} µs ({100 * floor / seconds:3.0f}%) rel err "
              f"{((got - expected).norm() / expected.norm()).item():.1e}")


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}  SMs {sms}  torch {torch.__version__}")
    if sys.argv[1:2] == ["gated"]:
        sweep_gated(int(sys.argv[2]) if len(sys.argv) > 2 else 32, sms)
        return
    tma_only = sys.argv[1:2] == ["tma"]
    args = sys.argv[2:] if tma_only else sys.argv[1:]
    rows_list = [int(r) for r in (args[0] if args else ("32" if tma_only else "1,32")).split(",")]
    shapes = {name: shape for name, shape in SHAPES.items() if not (tma_only and name == "gate_up")}  # gated: not split
    for (name, (n, k)), rows in itertools.product(shapes.items(), rows_list):
        weights, x = operands(n, k, rows)
        floor = n * k * 2 / BANDWIDTH
        cublas = seconds_per_call(lambda a, w: F.linear(a, w), weights, x)
        default = skinny_config(rows, n, k, sms, tma=tma_only)
        timed = {}
        for config in [default] + sweep(rows, tma_only):
            if config in timed:
                continue
            try:
                timed[config] = seconds_per_call(lambda a, w, c=config: skinny_linear(a, w, None, config=c), weights, x)
            except Exception as error:  # a launch that does not compile (registers, shared memory) is skipped
                print(f"  skip {config}: {type(error).__name__}: {str(error)[:120]}")
        best = min(timed, key=timed.get)
        expected = F.linear(x.float(), weights[0].float())
        error = ((skinny_linear(x, weights[0], None, config=best).float() - expected).norm() / expected.norm()).item()
        pct = lambda t: f"{t * 1e6:7.2f} µs ({100 * floor / t:3.0f}%)"  # noqa: E731
        print(f"{name:8s} M={rows:<3d} floor {floor * 1e6:6.2f} µs | cuBLAS {pct(cublas)} | default {pct(timed[default])} "
              f"{default} | best {pct(timed[best])} {best} | rel err {error:.1e}")
        top = sorted(timed, key=timed.get)[:8 if tma_only else 5]
        print("   top: " + "; ".join(f"{c.block_n}/{c.block_k}/{c.split_k}/w{c.num_warps}/s{c.num_stages}{'/swap' if c.swap else ''}{'/tma' if c.tma else ''} {timed[c] * 1e6:.2f}"
                                 for c in top))
        del weights


if __name__ == "__main__":
    main()
