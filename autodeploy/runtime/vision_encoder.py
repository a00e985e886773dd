"""Images of a vision-language deployment: prepared at admission, encoded by the ``"vision"`` graph at the step.

At admission (``RequestIntake``, on the caller's thread) each image a prompt carries is loaded and checked
(``images.py``), preprocessed by the checkpoint's own image processor on a pool of worker threads (never the
engine's), and given its encoder-cache key: a hash of its decoded pixels and of the processor's settings. The
prompt's image placeholder tokens are expanded to one per feature row the vision graph makes of an image.

When a step first schedules a request that carries images, ``VisionEncoder.encode`` runs the vision graph on
those not in the encoder cache — every such image of the step in forwards of up to ``max_images_per_batch`` —
and hands the language model graph their rows as the request's ``image_features`` side input, at the
placeholders' positions.

    graph = deployment.graphs["vision"]
    encoder = VisionEncoder(graph, vision_signature(graph), deployment.image_processor, deployment.image_token_id, settings)
    prepared = encoder.prepare(["cat.png"])       # admission
    encoder.encode([request])                      # the step that first computes its prompt
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx

from autodeploy.custom_ops.graph_capture import GraphCapture
from autodeploy.deployment import ImageBoundaries
from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.encoder_cache import EncoderCache, key as cache_key
from autodeploy.runtime.images import ImageLimits, load_image
from autodeploy.runtime.request import Request, TokenRows

logger = logging.getLogger(__name__)

IMAGE_FEATURES = "image_features"  # the model graph's side input (export/vision_language.py declares it)


@dataclass(frozen=True)
class PreparedImage:
    """An image ready for the vision graph: its preprocessed pixels and its encoder-cache key."""

    pixel_values: torch.Tensor  # [3, H, W]
    key: str


class VisionEncoder:
    """Prepares a deployment's images and runs its vision graph (see the module docstring). Thread-safe."""

    def __init__(self, graph: Callable, signature: tuple, image_processor, image_token_id: int, settings,
                 local_files: bool | Path = True, boundaries: ImageBoundaries | None = None, tokenizer=None,
                 bidirectional: bool = False):
        """``signature``: the vision graph's input shape and dtype and its output shape (``vision_signature``);
        ``local_files``: which local image paths admission reads; ``boundaries``: the tokens the model puts around
        each image's placeholders (Gemma 3; ``tokenizer`` writes them and their separator); ``bidirectional``: whether
        a prompt's runs of placeholders attend to one another both ways (the model graph takes ``attend_until``)."""
        input_shape, input_dtype, output_shape = signature
        vision = settings.vision
        self.graph = graph
        self.tokens_per_image = int(output_shape[1])
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.boundaries = boundaries
        self.bidirectional = bidirectional
        self._tokenizer = tokenizer
        # With boundary tokens and a tokenizer: the start token's text, what a text prompt's start token becomes (as
        # the model's processor writes it), and the separator's ids (what a token prompt's start token gets around it).
        self._start_text = self._expanded_text = None
        self._separator = []
        if boundaries is not None and tokenizer is not None:
            start, image, end = tokenizer.convert_ids_to_tokens([boundaries.start_token_id, image_token_id,
                                                                 boundaries.end_token_id])
            separator = boundaries.separator
            self._start_text = start
            self._expanded_text = f"{separator}{start}{image * int(output_shape[1])}{end}{separator}"
            self._separator = tokenizer.encode(separator, add_special_tokens=False) if separator else []
        self.device = torch.device(settings.device)
        self.max_images_per_batch = vision.max_images_per_batch
        self.max_images_per_request = vision.max_images_per_request
        self.limits = ImageLimits(max_encoded_bytes=vision.max_image_bytes, max_pixels=vision.max_image_pixels,
                                  fetch_timeout_s=vision.fetch_timeout_s)
        self.local_files = local_files
        self.cache = EncoderCache(int(vision.encoder_cache_mb * 2**20))
        self.settings_digest = hashlib.blake2b(image_processor.to_json_string().encode(), digest_size=16).hexdigest()
        self._workers = ThreadPoolExecutor(vision.preprocess_workers, thread_name_prefix="autodeploy-images")
        self.images_encoded = 0  # forwards' images (misses); the cache counts its hits
        self.image_size = tuple(input_shape[-2:])
        self.dtype = input_dtype
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}  # images → graph, input, output

    # ---- admission -----------------------------------------------------------------------------
    def prepare(self, sources: Sequence) -> list[PreparedImage]:
        """Load, check and preprocess a prompt's images on the worker threads; the first bad one raises its
        ``InvalidRequestError`` (naming it)."""
        if not isinstance(sources, (list, tuple)):
            raise InvalidRequestError(f"images must be a list (paths, bytes, URLs or PIL images), got {type(sources).__name__}")
        if len(sources) > self.max_images_per_request:
            raise InvalidRequestError(f"the prompt carries {len(sources)} images; at most {self.max_images_per_request} a "
                                      f"request are served (vision.max_images_per_request)")
        return list(self._workers.map(self._prepare_one, range(len(sources)), sources))

    def _prepare_one(self, index: int, source) -> PreparedImage:
        if isinstance(source, PreparedImage):  # preprocessed elsewhere (the Triton ensemble's preprocessing step)
            shape, finite = tuple(source.pixel_values.shape), bool(torch.isfinite(source.pixel_values).all())
            if shape != (3, *self.image_size) or not finite:
                raise InvalidRequestError(f"image {index}: its pixel values are {shape}{'' if finite else ', not all finite'}; "
                                          f"the model takes finite {[3, *self.image_size]}")
            return source
        loaded = load_image(source, index=index, limits=self.limits, local_files=self.local_files)
        try:
            pixels = self.image_processor(images=[loaded.image], return_tensors="pt")["pixel_values"][0]
        except Exception as error:  # the processor's own checks (an aspect ratio it cannot resize, say)
            raise InvalidRequestError(f"image {index}: the model's image processor refused it: {error}") from error
        return PreparedImage(pixels, cache_key(loaded.digest, self.settings_digest))

    def expand_text(self, text: str) -> str:
        """A text prompt with each image's start token (Gemma 3's ``<start_of_image>``) written out as the model's
        processor writes it: the separator, the start token, a placeholder for each feature row, the end token and
        the separator. Text as it is for a model without boundary tokens, whose placeholders expand as token ids."""
        return text if self._start_text is None else text.replace(self._start_text, self._expanded_text)

    def expand_placeholders(self, token_ids: list[int], num_images: int) -> tuple[list[int], list[int]]:
        """``token_ids`` with each image's placeholder expanded to ``tokens_per_image`` placeholders, and where each
        image's placeholders start. One placeholder an image (a prompt's ``<image>``; with boundary tokens, the start
        token, expanded as ``expand_text`` writes it) is expanded; ``tokens_per_image`` an image (a Hugging Face
        processor's output) are kept, the images filling them in order, as Hugging Face does."""
        places = [position for position, token in enumerate(token_ids) if token == self.image_token_id]
        width = self.tokens_per_image
        if len(places) == num_images * width:  # already expanded (or no images and no placeholders)
            return list(token_ids), places[::width]
        marker, name = self.image_token_id, f"token {self.image_token_id}"
        before, after = [], []
        if self.boundaries is not None and not places:
            marker, name = self.boundaries.start_token_id, f"start-of-image token {self.boundaries.start_token_id}"
            places = [position for position, token in enumerate(token_ids) if token == marker]
            if self.boundaries.separator and self._tokenizer is None:
                raise InvalidRequestError(
                    "this deployment has no tokenizer to write the text around an image's tokens; send each image's "
                    "tokens as the model's processor expands them")
            before, after = [*self._separator, marker], [self.boundaries.end_token_id, *self._separator]
        if len(places) != num_images:
            raise InvalidRequestError(
                f"the prompt has {len(places)} image placeholder(s) ({name}) for {num_images} image(s); "
                f"put one placeholder where each image goes (the chat template does this for image content parts), or "
                f"{width} an image as the model's processor expands them")
        expanded: list[int] = []
        starts: list[int] = []
        previous = 0
        for place in places:
            expanded += token_ids[previous:place] + before
            starts.append(len(expanded))
            expanded += [self.image_token_id] * width + after
            previous = place + 1
        return expanded + token_ids[previous:], starts

    def whole_spans(self, token_ids: list[int]) -> tuple[tuple[int, int], ...]:
        """The runs of image placeholders in a prompt that attend to one another both ways (a bidirectional model's;
        none otherwise): each maximal run of placeholder tokens, as Hugging Face's ``token_type_ids`` mask groups them."""
        if not self.bidirectional:
            return ()
        spans: list[tuple[int, int]] = []
        for position, token in enumerate(token_ids):
            if token != self.image_token_id:
                continue
            if spans and spans[-1][1] == position:
                spans[-1] = (spans[-1][0], position + 1)
            else:
                spans.append((position, position + 1))
        return tuple(spans)

    # ---- the step ------------------------------------------------------------------------------
    def encode(self, requests: Sequence[Request]) -> None:
        """Give each request its ``image_features`` rows: cached features where the cache has its images, the
        vision graph's for the others (all of the step's in forwards of up to ``max_images_per_batch``)."""
        features: dict[str, torch.Tensor] = {}
        missing: dict[str, PreparedImage] = {}
        for request in requests:
            for image in request.images:
                if image.key in features or image.key in missing:
                    continue
                cached = self.cache.get(image.key)
                if cached is not None:
                    features[image.key] = cached
                else:
                    missing[image.key] = image
        pending = list(missing.values())
        for first in range(0, len(pending), self.max_images_per_batch):
            batch = pending[first:first + self.max_images_per_batch]
            encoded = self._forward(torch.stack([image.pixel_values for image in batch]))
            self.images_encoded += len(batch)
            for image, rows in zip(batch, encoded):
                features[image.key] = rows
                self.cache.put(image.key, rows)
        for request in requests:
            rows = torch.cat([features[image.key] for image in request.images])
            positions = tuple(p for start in request.image_starts for p in range(start, start + self.tokens_per_image))
            request.side_inputs[IMAGE_FEATURES] = TokenRows(positions, rows)
            request.images = []  # encoded: the pixels are not needed again

    def _forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """The vision graph's rows for ``pixels`` (on the host): a captured graph's replay, padded up to its image
        count, where one was captured; else the graph itself."""
        size = next((size for size in sorted(self._captured) if size >= len(pixels)), None)
        if size is None:
            return _tensor(self.graph(pixels.to(self.device, self.dtype)))
        graph, static_pixels, static_rows = self._captured[size]
        static_pixels[: len(pixels)].copy_(pixels, non_blocking=True)
        graph.replay()
        return static_rows[: len(pixels)].clone()  # the next replay overwrites the graph's output

    def capture(self) -> None:
        """On a GPU, capture the vision graph as CUDA graphs for 1, 2, 4, … up to ``max_images_per_batch`` images
        (a forward pads its images up to the next); each replay is checked against the graph run eagerly on the
        same images, and the graphs are dropped with a warning if one differs (images then run eagerly)."""
        if self.device.type != "cuda":
            return
        sizes = sorted({min(2 ** power, self.max_images_per_batch) for power in range(self.max_images_per_batch.bit_length() + 1)})
        capture = GraphCapture(self.device)
        height, width = self.image_size
        generator = torch.Generator(self.device).manual_seed(0)
        for size in sizes:
            static_pixels = torch.randn((size, 3, height, width), generator=generator, device=self.device, dtype=self.dtype)
            graph, rows = capture.capture(lambda pixels: _tensor(self.graph(pixels)), [static_pixels])
            self._captured[size] = (graph, static_pixels, rows)
            graph.replay()
            expected = _tensor(self.graph(static_pixels))
            if not torch.equal(rows, expected):
                error = (rows.float() - expected.float()).abs().max().item()
                logger.warning("the vision graph's CUDA graph for %d images differs from its eager run by up to %.3g; "
                               "images are encoded eagerly", size, error)
                self._captured.clear()
                return
        logger.info("vision graph captured for %s images (%s)", sizes, capture.times)


def prepared_from_pixels(pixel_values: torch.Tensor) -> PreparedImage:
    """An image given already preprocessed (``[3, H, W]``), keyed in the encoder cache by a hash of those pixels: the
    vision graph's output depends on nothing else."""
    pixels = pixel_values.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.blake2b(f"pixels {list(pixels.shape)}\n".encode(), digest_size=32)
    digest.update(pixels.numpy().tobytes())
    return PreparedImage(pixels, digest.hexdigest())


def _tensor(output) -> torch.Tensor:
    """An exported graph returns its one output bare; a compiled one as a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


def vision_signature(graph: fx.GraphModule) -> tuple[tuple, torch.dtype, tuple]:
    """The vision graph's input shape ``[images, 3, H, W]`` and dtype and its output shape ``[images, tokens, hidden]``,
    as export recorded them (the image count symbolic)."""
    pixels = next(n for n in graph.graph.nodes if n.op == "placeholder").meta["val"]
    output = next(n for n in graph.graph.nodes if n.op == "output")
    value = output.args[0][0] if isinstance(output.args[0], (list, tuple)) else output.args[0]
    return tuple(pixels.shape), pixels.dtype, tuple(value.meta["val"].shape)
