"""The files of a saved deployment folder, and how to recognise one.

    manifest.json        format version, the versions and device it was built with, dtype, source, verification,
                         the sha256 of every other file (manifest.py)
    graph.pt2            the served graph, a torch.export archive holding no tensor (graph_archive.py)
    weights.safetensors  the graph's tensors, as deployed (weights_file.py)
    serving.json         the serving signature: graph inputs, which tensor each tensor input takes and on which
                         device, KV cache specs, decode CUDA-graph batch sizes, eos token ids
    tuning.json          the kernel select chose for each node and why; token-count dispatch tables
    settings.yaml        the resolved settings the deployment was built with
    build_report.json    the pipeline's records (what ``LLM.pipeline_report()`` shows)
    tokenizer/           the tokenizer's files (absent when the model had none)
  a vision-language model's besides (``serving.json`` then names its image token):
    vision.pt2           the vision graph (pixels in, feature rows out), a torch.export archive holding no tensor
    vision.safetensors   its tensors
    image_processor/     the checkpoint's image processor (preprocessor_config.json)
  an encoder–decoder's besides (``serving.json`` then names the decoder's start token and the cross-KV caches):
    encoder.pt2          the encoder graph (input ids in, every decoder layer's cross keys and values out)
    encoder.safetensors  its tensors
A graph beside the model graph is recorded in ``tuning.json`` under its role: its inputs, its tensors' placements,
kernels and dispatches.
"""

from __future__ import annotations

from pathlib import Path

from autodeploy.deployment import ENCODER, VISION

from .manifest import MANIFEST_FILE

GRAPH = "graph.pt2"
WEIGHTS = "weights.safetensors"
SERVING = "serving.json"
TUNING = "tuning.json"
SETTINGS = "settings.yaml"
BUILD_REPORT = "build_report.json"
TOKENIZER = "tokenizer"
VISION_GRAPH = "vision.pt2"
VISION_WEIGHTS = "vision.safetensors"
IMAGE_PROCESSOR = "image_processor"
ENCODER_GRAPH = "encoder.pt2"
ENCODER_WEIGHTS = "encoder.safetensors"
# The graphs a deployment may hold beside its model graph, by role: (their archive, their tensors).
SIDE_GRAPHS = {VISION: (VISION_GRAPH, VISION_WEIGHTS), ENCODER: (ENCODER_GRAPH, ENCODER_WEIGHTS)}


def is_saved_deployment(path: str | Path) -> bool:
    """Whether ``path`` is a folder ``LLM.save`` wrote, whole or damaged: it holds a file only a save writes and no
    ``config.json`` (a Hugging Face checkpoint's), so a deployment that lost a file is read as one and its loader
    names what is missing."""
    path = Path(path)
    return (path.is_dir() and not (path / "config.json").exists()
            and any((path / name).is_file() for name in (MANIFEST_FILE, GRAPH, SERVING, TUNING)))


def is_whole_saved_deployment(path: str | Path) -> bool:
    """Whether ``path`` has a deployment's manifest and graph archive: what a save may replace."""
    path = Path(path)
    return path.is_dir() and (path / MANIFEST_FILE).is_file() and (path / GRAPH).is_file()
