"""Images/s of a vision-language deployment's vision graph (CUDA graphs by image count) against Hugging Face's eager
vision tower and projector (``get_image_features``), at the batch sizes given, on one GPU, same process. Both start
from float32 pixels on the host, as the image processor leaves them (an earlier version handed HF bf16 pixels already
on the GPU and charged only the engine the 43 MB copy of 32 images: 0.94× at batch 32).

    python3 scripts/vision_tower_bench.py llava-1.5-7b --batch 1,32 [--out result.json]

Random weights (``weights=random``) when the model is a config folder; the HF model gets the same architecture with
its own random weights (the cost does not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import time

from pathlib import Path

import torch

import autodeploy.configs as autodeploy_configs
from autodeploy import autodeploy
from autodeploy.bench.hf_baselines import load_hf_model


def timed(function, repeats: int) -> float:
    """Seconds a call, the median of ``repeats`` after two untimed calls."""
    function()
    function()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        function()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = [int(size) for size in args.batch.split(",")]
    llm = autodeploy(args.model, weights="random", vision={"max_images_per_batch": max(sizes)}, max_batch_size=8,
                     kv_cache={"memory_fraction": 0.1})
    vision = llm.engine.vision
    dtype = vision.dtype
    height, width = vision.image_size
    results = {"device": torch.cuda.get_device_name(), "captured": sorted(vision._captured), "ours": {}, "hf_eager": {}}
    for size in sizes:
        pixels = torch.randn((size, 3, height, width), dtype=torch.float32)
        results["ours"][size] = size / timed(lambda: vision._forward(pixels), args.repeats)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    folder = Path(autodeploy_configs.__file__).parent / "models" / args.model if "/" not in args.model else Path(args.model)
    hf = load_hf_model(folder, dtype, torch.device("cuda"))
    with torch.inference_mode():
        for size in sizes:
            # From the same float32 host pixels as the engine's (what the image processor gives): the copy counts for both.
            pixels = torch.randn((size, 3, height, width), dtype=torch.float32)
            results["hf_eager"][size] = size / timed(
                lambda: hf.model.get_image_features(pixel_values=pixels.to("cuda", dtype)), args.repeats)
    for size in sizes:
        print(f"images/s at batch {size}: autodeploy {results['ours'][size]:.1f}, HF eager {results['hf_eager'][size]:.1f} "
              f"({results['ours'][size] / results['hf_eager'][size]:.2f}×)")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
