"""How close the deployed tiny models' GPU logits come to HF eager on the CPU, per KV-pool size: the margin
behind ``tests/test_end_to_end.py``'s 1e-5 bound (notes/gpu_checks.md).

    python3 scripts/gpu_logit_margin.py      # on a CUDA machine
"""

from __future__ import annotations

import gc
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from autodeploy import autodeploy  # noqa: E402
from tests.test_end_to_end import SHAPES  # noqa: E402
from tests.tiny_models import ARCHITECTURES, write_tiny_checkpoint  # noqa: E402


def worst_difference(hf_model, llm) -> tuple[float, tuple[int, int]]:
    generator = torch.Generator().manual_seed(0)
    worst, where = 0.0, None
    for batch, seq in SHAPES:
        input_ids = torch.randint(3, 500, (batch, seq), generator=generator)
        with torch.no_grad():
            expected = hf_model(input_ids=input_ids).logits
        got = torch.stack(llm.logits(input_ids.tolist()))
        difference = (got - expected).abs().max().item()
        if difference > worst:
            worst, where = difference, (batch, seq)
    return worst, where


def main() -> None:
    warnings.filterwarnings("ignore")
    for arch in ARCHITECTURES:
        with tempfile.TemporaryDirectory() as directory:
            hf_model = write_tiny_checkpoint(arch, Path(directory), max_shard_size="200KB")
            for fraction in (0.9, 0.02):
                llm = autodeploy(directory, kv_cache={"memory_fraction": fraction})
                worst, where = worst_difference(hf_model, llm)
                print(f"{arch:8} memory_fraction {fraction}: {llm.engine.pool.num_blocks} blocks, max |Δlogit| {worst:.2e} at {where}, "
                      f"max |logit| {hf_model(input_ids=torch.tensor([[3, 4, 5]])).logits.abs().max().item():.2f}")
                llm.free_kv_cache()
                del llm
                gc.collect()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
