"""Vision-language checkpoints: which ones autodeploy serves, and what it needs to know about them.

A LLaVA-style model is a vision tower (CLIP or SigLIP), a projector, and a decoder-only language model that
reads the projected image features in place of the embeddings of its image placeholder tokens. Gemma 3 is one
too (a SigLIP tower, a pooling projector), with two differences: a prompt marks where an image goes with a
start-of-image token that its processor expands to ``"\n\n<start_of_image>"``, the placeholders and
``"<end_of_image>\n\n"``; and in the prompt an image's placeholders attend to one another both ways (Hugging
Face's ``token_type_ids`` mask), which the cache stage turns into ``cached_attention``'s ``attend_until``. autodeploy
builds it as two graphs of one deployment: ``"vision"`` (pixels in, one feature row per placeholder token out)
and ``"model"`` (the language model, taking those rows as a side input scattered over the placeholders).
Everything model-specific about that split lives here; the export wrappers (``export/vision_language.py``)
and the runtime read only a ``VisionLanguageSpec``.

    >>> spec = vision_language_spec(config)   # None for a text-only model
    >>> spec.image_token_id, spec.vision_model_type
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

from autodeploy.errors import UnsupportedModelError, error_summary

# The families served: the model type of the whole checkpoint → the vision towers served inside it.
SERVED = {"llava": ("clip_vision_model", "siglip_vision_model"), "gemma3": ("siglip_vision_model",)}
GEMMA3_SEPARATOR = "\n\n"  # Gemma 3's processor puts it before and after each image's tokens


@dataclass(frozen=True)
class VisionLanguageSpec:
    """What the pipeline and the runtime need to know of a vision-language checkpoint."""

    model_type: str
    vision_model_type: str
    image_token_id: int  # the placeholder token the image's feature rows stand in for
    image_size: int  # the tower's input resolution (the image processor resizes to it)
    feature_layers: tuple[int, ...]  # the tower's hidden states the projector reads (concatenated); (): its output
    keep_class_token: bool  # vision_feature_select_strategy "full"; "default" drops the first position
    # Gemma 3: the tokens around each image's placeholders (a prompt puts the first where an image goes), the text
    # its processor puts around them, and whether the placeholders attend to one another both ways.
    boundary_token_ids: tuple[int, int] | None = None
    separator: str = ""
    bidirectional_images: bool = False


def vision_language_spec(config: PretrainedConfig, name: str = "the model") -> VisionLanguageSpec | None:
    """The spec of a vision-language ``config`` autodeploy serves; None for a model without a vision tower.
    A multimodal model of another family, or with another tower, is an ``UnsupportedModelError`` naming it."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None
    towers = SERVED.get(config.model_type)
    if towers is None:
        raise UnsupportedModelError(
            f"{name}: {type(config).__name__} ({config.model_type}) is a vision-language model of a family autodeploy "
            f"does not serve yet; it serves {', '.join(SERVED)} (with {', '.join(sorted({t for ts in SERVED.values() for t in ts}))} "
            f"vision towers) and text-only decoders")
    if vision.model_type not in towers:
        raise UnsupportedModelError(
            f"{name}: its {config.model_type} checkpoint has a {vision.model_type} vision tower; autodeploy serves "
            f"{config.model_type} with {' or '.join(towers)} towers")
    if config.model_type == "gemma3":  # the tower's output (after its post-norm), pooled and projected
        return VisionLanguageSpec(
            config.model_type, vision.model_type, int(config.image_token_id), int(vision.image_size),
            feature_layers=(), keep_class_token=True,
            boundary_token_ids=(int(config.boi_token_index), int(config.eoi_token_index)), separator=GEMMA3_SEPARATOR,
            bidirectional_images=True)
    layers = config.vision_feature_layer
    layers = tuple(layers) if isinstance(layers, (list, tuple)) else (int(layers),)
    strategy = config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise UnsupportedModelError(f"{name}: vision_feature_select_strategy {strategy!r} is neither 'default' nor 'full'")
    return VisionLanguageSpec(config.model_type, vision.model_type, int(config.image_token_id), int(vision.image_size),
                              layers, strategy == "full")


def load_image_processor(directory: str | Path, name: str = "the model"):
    """The image processor saved in ``directory`` (its ``preprocessor_config.json``), as transformers' Pillow class:
    ``AutoImageProcessor`` needs torchvision, which is not a dependency; each family's Pillow processor is its class
    name + ``Pil``. A folder without one is refused: its images' size and normalisation would be guesses."""
    import transformers

    path = Path(directory) / "preprocessor_config.json"
    try:
        class_name = json.loads(path.read_text())["image_processor_type"].removesuffix("Fast")
        processor_class = getattr(transformers, class_name + "Pil", None) or getattr(transformers, class_name)
        processor = processor_class.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as error:
        raise UnsupportedModelError(
            f"{name}: cannot load its image processor ({error_summary(error)}); a vision-language model needs its "
            f"preprocessor_config.json (the image size and normalisation its tower was trained with)") from error
    if getattr(processor, "do_pan_and_scan", False):
        raise UnsupportedModelError(
            f"{name}: its image processor crops images by pan-and-scan (do_pan_and_scan), a varying number of images a "
            f"picture, which autodeploy does not serve; set do_pan_and_scan to false in its preprocessor_config.json")
    return processor
