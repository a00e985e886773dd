"""The dequantising GEMVs (int8_wo, int4_wo, fp8) at one row, against their bandwidth floor, over their launches.

    python3 scripts/sweep_quantized_gemv.py [SCHEMES] [SHAPES]     # default: int8_wo,int4_wo,fp8 and every shape

Llama-3-8B's projections as a quantized deploy serves them (q/k/v and gate/up fused). Per scheme and
shape: the floor (the stored bytes, scales included, over 4.27 TB/s), the bf16 few-row kernel's time for
scale, the scheme's `torch` backend, the default launch (``GemvLaunch()``) and the best of the sweep, each
with its share of the floor, and the best launch's error against the reference. Times are per call from a
CUDA graph cycling over enough weight copies to miss L2 (``sweep_skinny_gemm.seconds_per_call``).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autodeploy.custom_ops  # noqa: E402,F401  (registers the ops)
from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight  # noqa: E402
from autodeploy.custom_ops.triton.quantized_gemv import GemvLaunch, fp8_gemv, int4_wo_gemv, int8_wo_gemv  # noqa: E402
from autodeploy.custom_ops.triton.skinny_gemm import skinny_linear  # noqa: E402
from sweep_skinny_gemm import BANDWIDTH, L2_BYTES, seconds_per_call  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
KERNELS = {  # scheme → (GEMV, the op (reference; its `torch` backend is <op>_torch), the stored tensors it takes)
    "int8_wo": (int8_wo_gemv, "int8_wo_linear", ("qweight", "scale")),
    "int4_wo": (int4_wo_gemv, "int4_wo_linear", ("qweight", "scale", "zero")),
    "fp8": (fp8_gemv, "fp8_linear", ("qweight", "scale")),
}


def launches(scheme: str) -> list[GemvLaunch]:
    if scheme == "int4_wo":
        return [GemvLaunch(block_n=n, groups_per_step=g, num_warps=w, num_stages=s)
                for n, g, w, s in itertools.product([8, 16, 32], [1, 2, 4, 8], [4, 8], [None, 4])]
    return [GemvLaunch(block_n=n, block_k=k, num_warps=w, num_stages=s)
            for n, k, w, s in itertools.product([8, 16, 32], [512, 1024, 2048], [4, 8], [None, 4])]


def main() -> None:
    schemes = (sys.argv[1] if len(sys.argv) > 1 else ",".join(KERNELS)).split(",")
    shapes = (sys.argv[2] if len(sys.argv) > 2 else ",".join(SHAPES)).split(",")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name in shapes:
        n, k = SHAPES[name]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        copies = max(2, -(-L2_BYTES // (n * k * 2)))
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        bf16_time = seconds_per_call(lambda a, w: skinny_linear(a, w, None), bf16, x)
        print(f"{name} [{n}, {k}]: bf16 few-row kernel {bf16_time * 1e6:.2f} us ({n * k * 2 / BANDWIDTH / bf16_time:.0%} of its floor)")
        for scheme in schemes:
            gemv, op_name, roles = KERNELS[scheme]
            op, torch_backend = getattr(torch.ops.autodeploy, op_name), getattr(torch.ops.autodeploy, f"{op_name}_torch")
            first = quantize_weight(QuantScheme(scheme), bf16[0])
            nbytes = sum(first[r].numel() * first[r].element_size() for r in roles)
            weights = [tuple(first[r] for r in roles)]
            while len(weights) < max(2, -(-L2_BYTES // nbytes)):
                stored = quantize_weight(QuantScheme(scheme), torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5)
                weights.append(tuple(stored[r] for r in roles))
            floor = nbytes / BANDWIDTH
            torch_time = seconds_per_call(lambda a, w: torch_backend(a, *w, None), weights, x)
            timed = {}
            for launch in [GemvLaunch()] + launches(scheme):
                if launch in timed:
                    continue
                try:
                    timed[launch] = seconds_per_call(lambda a, w, c=launch: gemv(a, *w, None, launch=c), weights, x)
                except Exception as error:  # a launch that does not compile (registers, shared memory) is skipped
                    print(f"  skip {launch}: {type(error).__name__}: {str(error)[:100]}")
            best, default = min(timed, key=timed.get), timed[GemvLaunch()]
            want = op(x, *weights[0], None).double()
            error = ((gemv(x, *weights[0], None, launch=best).double() - want).norm() / want.norm()).item()
            print(f"  {scheme:8s} floor {floor * 1e6:7.2f} us | torch {torch_time * 1e6:7.2f} ({floor / torch_time:.0%}) | "
                  f"default {default * 1e6:7.2f} ({floor / default:.0%}) | best {timed[best] * 1e6:7.2f} "
                  f"({floor / timed[best]:.0%}) {best} | rel err {error:.1e}")
        del bf16


if __name__ == "__main__":
    main()
