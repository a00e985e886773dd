"""PyTorch's tinygemm int4 kernel (``torch._weight_int4pack_mm``) against bf16 and the Triton int4 kernels, at
Llama-3-8B's projections, 1 and 32 rows: is a prepared (repacked) weight layout worth a select hook?

    python3 scripts/probe_int4_tinygemm.py

Our int4_wo layout (``pack_int4``: even k in the low nibble; float32 scale and uint8 zero per group, a weight
``(q − zero) · scale``) converts to tinygemm's: even k in the high nibble, then ``_convert_weight_to_int4pack``;
scales and zeros as ``[K/G, N, 2]`` bf16 with tinygemm's float zero ``(8 − zero) · scale`` (it computes
``(q − 8) · scale + zero``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autodeploy.custom_ops  # noqa: E402,F401
from autodeploy.custom_ops.quantization.int4_wo import int4_wo_linear_reference  # noqa: E402
from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight  # noqa: E402
from sweep_skinny_gemm import BANDWIDTH, L2_BYTES, seconds_per_call  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128


def to_tinygemm(stored, inner_k_tiles):
    q = stored["qweight"]
    swapped = ((q & 0x0F) << 4) | (q >> 4)
    packed = torch._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
    scale = stored["scale"]
    zeros = (8.0 - stored["zero"].to(torch.float32)) * scale
    sz = torch.stack((scale, zeros), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


def main() -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-L2_BYTES // (n * k // 2)))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        stored = {key: t.cuda() for key, t in quantize_weight(QuantScheme("int4_wo", group_size=GROUP), w.float()).items()}
        floor = (n * k // 2 + n * (k // GROUP) * 4) / BANDWIDTH  # tinygemm's bytes: nibbles + bf16 scale and zero
        stored_copies = [stored] + [{key: t.clone() for key, t in stored.items()} for _ in range(copies - 1)]
        bf16_copies = [w] + [w.clone() for _ in range(max(2, -(-L2_BYTES // (n * k * 2))) - 1)]
        for rows in (1, 32):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            expected = int4_wo_linear_reference(x.float(), stored["qweight"], stored["scale"], stored["zero"], None)
            line = [f"{name:8s} rows {rows:2d} floor {floor * 1e6:6.2f} us"]
            t = seconds_per_call(lambda x, w: torch.nn.functional.linear(x, w), bf16_copies, x)
            line.append(f"bf16 {t * 1e6:6.2f}")
            triton_op = torch.ops.autodeploy.int4_wo_linear_triton
            t = seconds_per_call(lambda x, s: triton_op(x, s["qweight"], s["scale"], s["zero"], None), stored_copies, x)
            line.append(f"triton {t * 1e6:6.2f} ({floor / t:.0%})")
            for tiles in (2, 4, 8):
                prepared = [to_tinygemm(s, tiles) for s in stored_copies]
                got = torch._weight_int4pack_mm(x, prepared[0][0], GROUP, prepared[0][1]).float()
                error = ((got - expected).abs().max() / expected.abs().max()).item()
                t = seconds_per_call(lambda x, p: torch._weight_int4pack_mm(x, p[0], GROUP, p[1]), prepared, x)
                line.append(f"tinygemm/{tiles} {t * 1e6:6.2f} ({floor / t:.0%}, err {error:.1e})")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
