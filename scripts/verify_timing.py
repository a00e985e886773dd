"""What build-time verification costs and finds: each model deployed with verification on, then off.

    python scripts/verify_timing.py                                   # demo + tiny Llama on CPU, the 8B config on meta
    python scripts/verify_timing.py llama-3-8b --set weights=random   # one model, settings as on the CLI
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from autodeploy import autodeploy  # noqa: E402


def measure(model: str | None, set_arguments: list[str]) -> None:
    timings = {}
    for verify in (False, True):  # unverified first: it pays the one-time costs of the process (pattern tracing)
        start = time.perf_counter()
        llm = autodeploy(model, set_arguments=[*set_arguments, f"verify.enabled={str(verify).lower()}"])
        timings[verify] = time.perf_counter() - start
        if verify:
            report = llm.verification
        llm.free_kv_cache()  # the next build's memory check must see this one's GPU memory free again
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{model or 'demo'} {' '.join(set_arguments)}: build {timings[True]:.1f}s verified, {timings[False]:.1f}s unverified; {report}")


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--set", dest="set_arguments", action="append", default=[])
    args = parser.parse_args()
    if args.model or args.set_arguments:
        measure(args.model, args.set_arguments)
        return
    from tests.tiny_models import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        write_tiny_checkpoint("llama", Path(directory))
        measure(directory, ["device=cpu"])
    measure(None, ["device=cpu"])
    measure("llama-3-8b", ["device=meta", "weights=random"])


if __name__ == "__main__":
    main()
