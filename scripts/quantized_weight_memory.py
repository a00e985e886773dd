"""Weight bytes of a deployment per quantization scheme, on the meta device (no weights, no GPU).

    python scripts/quantized_weight_memory.py [MODEL] [--set key=value ...]    # default: llama-3-8b

For each scheme (every projection, the tied or untied LM head included where the scheme takes it), and
``int4_wo`` with ``quantize.embedding: int8`` (an untied embedding table in int8 too): the bytes of every
tensor the served graph holds, and the ratio to the unquantized deployment in bfloat16.
"""

import sys

from autodeploy import autodeploy

MODEL = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "llama-3-8b"
SETS = [a for a in sys.argv[1:] if a not in ("--set", MODEL)]


def weight_bytes(scheme: str, **quantize) -> int:
    llm = autodeploy(MODEL, device="meta", dtype="bfloat16", weights="random", quantize={"default": scheme, **quantize},
                     set_arguments=SETS)
    tensors = {id(t): t for t in [*llm.graph.parameters(), *llm.graph.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


baseline = weight_bytes("none")
print(f"{MODEL}: none (bfloat16) {baseline / 1e9:.2f} GB")
for scheme in ("int8_wo", "fp8", "int4_wo"):
    size = weight_bytes(scheme)
    print(f"{MODEL}: {scheme} {size / 1e9:.2f} GB = {size / baseline:.3f}× bfloat16")
size = weight_bytes("int4_wo", embedding="int8")
print(f"{MODEL}: int4_wo, embedding int8 {size / 1e9:.2f} GB = {size / baseline:.3f}× bfloat16")
