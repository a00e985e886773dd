"""Parameter bytes per rank of a tensor-parallel deployment, on the meta device (no weights, no GPU).

    python scripts/tp_memory.py [MODEL] [2,4,8]      # default: the shipped llama-3-8b config

For each world size N the script joins a fake N-rank process group as rank 0 (PyTorch's ``fake`` backend:
nothing is communicated, and nothing needs to be on the meta device), deploys the model with
``distributed.tensor_parallel=N`` and sums its graph's parameter bytes, against the unsharded deployment's.
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from autodeploy import autodeploy

MODEL = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
WORLDS = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "2,4,8").split(",")]


def parameter_bytes(tensor_parallel: int) -> int:
    # No twin verification: the fake group communicates nothing, so a sharded twin's logits would be wrong.
    llm = autodeploy(MODEL, device="meta", dtype="bfloat16", weights="random", verify={"enabled": False},
                     distributed={"tensor_parallel": tensor_parallel})
    return sum(p.numel() * p.element_size() for p in llm.graph.parameters())


whole = parameter_bytes(1)
print(f"{MODEL}: tensor_parallel=1 {whole / 1e9:.2f} GB")
for world in WORLDS:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        share = parameter_bytes(world)
    finally:
        dist.destroy_process_group()
    print(f"{MODEL}: tensor_parallel={world} {share / 1e9:.2f} GB a rank = {share / whole:.3f}× (1/{world} = {1 / world:.3f})")
