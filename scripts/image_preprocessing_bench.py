"""Images/s of admission's image path (load and check with runtime/images.py, then the checkpoint's Pillow image
processor) for random JPEGs of two sizes, with 1, 2 and 4 worker threads: whether preprocessing can keep up.

    python scripts/image_preprocessing_bench.py        # the LLaVA-1.5 CLIP processor (336 × 336)
"""
import time, io, numpy as np
from PIL import Image
from autodeploy.models.vision_language import load_image_processor
from autodeploy.runtime.images import load_image
from concurrent.futures import ThreadPoolExecutor
proc = load_image_processor("configs/models/llava-1.5-7b")
rng = np.random.default_rng(0)
def jpeg(w, h):
    b = io.BytesIO(); Image.fromarray(rng.integers(0,256,(h,w,3),dtype=np.uint8)).save(b, format="JPEG", quality=90); return b.getvalue()
for (w, h) in [(336, 336), (1024, 768)]:
    data = [jpeg(w, h) for _ in range(64)]
    def one(d):
        return proc(images=[load_image(d).image], return_tensors="pt")["pixel_values"]
    one(data[0])
    for workers in (1, 2, 4):
        t = time.perf_counter()
        with ThreadPoolExecutor(workers) as ex: list(ex.map(one, data))
        dt = time.perf_counter() - t
        print(f"{w}x{h} JPEG → 336 CLIP pixels: {len(data)/dt:.1f} images/s with {workers} worker(s)")
