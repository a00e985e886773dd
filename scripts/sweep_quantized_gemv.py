"""The quantized decode kernels (int8_wo, int4_wo, fp8; fp8_pre: fp8 over rows already rounded) against their bandwidth floor, over their launches.

    python3 scripts/sweep_quantized_gemv.py [SCHEMES] [SHAPES] [ROWS]   # default: every scheme and shape, rows 1,32

Llama-3-8B's projections as a quantized deploy serves them (q/k/v and gate/up fused). Per scheme, shape
and row count: the floor (the stored bytes, scales included, over 4.27 TB/s), the bf16 few-row kernel's
time for scale, the scheme's `torch` backend, the launch the op takes by default, and the best GEMV
(``GemvLaunch``, one row only) and tile kernel (``TileLaunch``) launches of the sweep, each with its share
of the floor, and the best launch's error against the reference. Times are per call from a CUDA graph
cycling over enough weight copies to miss L2 (``sweep_skinny_gemm.seconds_per_call``).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autodeploy.custom_ops  # noqa: E402,F401  (registers the ops)
from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight  # noqa: E402
from autodeploy.custom_ops.triton.quantized_gemv import (  # noqa: E402
    GemvLaunch, TileLaunch, _fp8_rows, fp8_gemv, fp8_prequantized_gemm, int4_wo_gemv, int8_wo_gemv)
from autodeploy.custom_ops.triton.skinny_gemm import skinny_linear  # noqa: E402
from sweep_skinny_gemm import BANDWIDTH, L2_BYTES, seconds_per_call  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
KERNELS = {  # scheme → (GEMV, the op (reference; its `torch` backend is <op>_torch), the stored tensors it takes)
    "int8_wo": (int8_wo_gemv, "int8_wo_linear", ("qweight", "scale")),
    "int4_wo": (int4_wo_gemv, "int4_wo_linear", ("qweight", "scale", "zero")),
    "fp8": (fp8_gemv, "fp8_linear", ("qweight", "scale")),
    # fp8 over rows a norm or activation kernel already rounded (fuse_fp8_quantization): the tile kernel alone
    "fp8_pre": (None, "fp8_linear", ("qweight", "scale")),
}


def launches(scheme: str, rows: int) -> list:
    if scheme == "fp8_pre":  # K split over 1 – 4 programs a tile: o_proj and down leave SMs idle at 64-row blocks
        return [TileLaunch(block_n=n, block_k=k, num_stages=st, tma=tma, split_k=split)
                for n, k, st, tma, split in itertools.product([32, 64], [128, 256], [3, 5], [False, True], [1, 2, 4])
                if n == 64 or not tma]
    depths = [128] if scheme == "int4_wo" else [128, 256]
    tiles = [TileLaunch(block_n=n, block_k=k, num_warps=w, num_stages=st, tma=tma)
             for n, k, w, st, tma in itertools.product([16, 32, 64], depths, [4], [3, 5], [False, True])
             if n == 64 or not tma]  # the TMA tiles (not yet timed) at the widest weight block
    if scheme == "int4_wo":  # the inline-PTX dequantisation, its inputs split over 1 – 4 programs a tile
        tiles += [TileLaunch(block_n=n, block_k=128, num_stages=st, tma=tma, packed_dequant=True, split_k=split)
                  for n, st, tma, split in itertools.product([32, 64], [3, 5], [False, True], [1, 2, 4])]
    if rows > 1:
        return tiles
    if scheme == "int4_wo":  # the group-wise GEMV, the word-wise one (int32 words of eight values), the tiles
        return [GemvLaunch(block_n=n, groups_per_step=g, num_warps=w)
                for n, g, w in itertools.product([8, 16, 32], [1, 2, 4], [4])] + [
            GemvLaunch(block_n=n, words=words, num_warps=w)
            for n, words, w in itertools.product([4, 8, 16], [64, 128, 256], [2, 4, 8]) if n * words >= 64 * w] + tiles
    return [GemvLaunch(block_n=n, block_k=k, num_warps=w, num_stages=s)
            for n, k, w, s in itertools.product([8, 16], [1024, 2048], [4, 8], [None])] + tiles


def _share(floor: float, seconds: float) -> str:
    return f"{seconds * 1e6:7.2f} us ({floor / seconds:.0%})"


def main() -> None:
    schemes = (sys.argv[1] if len(sys.argv) > 1 else ",".join(KERNELS)).split(",")
    shapes = (sys.argv[2] if len(sys.argv) > 2 else "qkv,o_proj,gate_up,down").split(",")
    row_counts = [int(r) for r in (sys.argv[3] if len(sys.argv) > 3 else "1,32").split(",")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name in shapes:
        n, k = SHAPES[name]
        copies = max(2, -(-L2_BYTES // (n * k * 2)))
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for scheme in schemes:
            gemv, op_name, roles = KERNELS[scheme]
            op, torch_backend = getattr(torch.ops.autodeploy, op_name), getattr(torch.ops.autodeploy, f"{op_name}_torch")
            quantized = QuantScheme("fp8" if scheme == "fp8_pre" else scheme)
            first = quantize_weight(quantized, bf16[0])
            nbytes = sum(first[r].numel() * first[r].element_size() for r in roles)
            weights = [tuple(first[r] for r in roles)]
            while len(weights) < max(2, -(-L2_BYTES // nbytes)):
                stored = quantize_weight(quantized, torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5)
                weights.append(tuple(stored[r] for r in roles))
            floor = nbytes / BANDWIDTH
            for rows in row_counts:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                if scheme == "fp8_pre":
                    rounded = _fp8_rows(x, None)
                    gemv = lambda a, *w, launch=None, r=rounded: fp8_prequantized_gemm(*r, *w, torch.bfloat16, launch=launch)  # noqa: E731
                bf16_time = seconds_per_call(lambda a, w: skinny_linear(a, w, None), bf16, x)
                torch_time = seconds_per_call(lambda a, w: torch_backend(a, *w, None), weights, x)
                default_time = seconds_per_call(lambda a, w: gemv(a, *w, None), weights, x)
                timed = {}
                for launch in launches(scheme, rows):
                    try:
                        timed[launch] = seconds_per_call(lambda a, w, c=launch: gemv(a, *w, None, launch=c), weights, x)
                    except Exception as error:  # a launch that does not compile (registers, shared memory) is skipped
                        print(f"  skip {launch}: {type(error).__name__}: {str(error)[:100]}")
                line = (f"{name:7s} [{n}, {k}] {scheme:8s} rows {rows:2d}: floor {floor * 1e6:6.2f} us | bf16 kernel "
                        f"{bf16_time * 1e6:6.2f} us | torch {_share(floor, torch_time)} | default {_share(floor, default_time)}")
                for kind in (GemvLaunch, TileLaunch):
                    mine = {c: t for c, t in timed.items() if isinstance(c, kind)}
                    for runner_up in sorted(mine, key=mine.get)[1:4]:  # the three next best
                        line += f"\n    next {kind.__name__:10s} {_share(floor, mine[runner_up])} {runner_up}"
                    if mine:
                        best = min(mine, key=mine.get)
                        want = op(x, *weights[0], None).double()
                        error = ((gemv(x, *weights[0], None, launch=best).double() - want).norm() / want.norm()).item()
                        line += f"\n    best {kind.__name__:10s} {_share(floor, mine[best])} {best} rel err {error:.1e}"
                print(line, flush=True)
        del bf16


if __name__ == "__main__":
    main()
