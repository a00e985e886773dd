"""Build-time verification of a few tiny architectures on the GPU, per dtype (the kernels the deploy
serves with, held to HF eager): the relative error each reaches against its tolerance.

    python3 scripts/gpu_verify_sample.py      # on a CUDA machine
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autodeploy import autodeploy  # noqa: E402
from tests.sweep_models import tiny_model  # noqa: E402

MODEL_TYPES = ("llama", "mistral", "gemma2", "bloom", "mpt", "falcon", "codegen", "gpt2", "deepseek_v3", "gpt_oss")


def main() -> None:
    warnings.filterwarnings("ignore")
    for model_type in sys.argv[1:] or MODEL_TYPES:
        with tempfile.TemporaryDirectory() as directory:
            tiny_model(model_type).save_pretrained(directory)
            for dtype in ("float32", "bfloat16", "float16"):
                try:
                    llm = autodeploy(directory, device="cuda", dtype=dtype, kv_cache={"memory_fraction": 0.05})
                    print(f"{model_type:12} {dtype:9} {llm.verification}")
                    llm.free_kv_cache()
                except Exception as error:  # reported, not raised: the sample goes on
                    print(f"{model_type:12} {dtype:9} {type(error).__name__}: {' '.join(str(error).split())[:300]}")


if __name__ == "__main__":
    main()
