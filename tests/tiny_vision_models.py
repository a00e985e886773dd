"""Tiny random-weight vision-language checkpoints, built on the fly: LLaVA (a CLIP or a SigLIP tower before the tiny
Llama) and Gemma 3 (a SigLIP tower, pooled, before a tiny Gemma 3 with sliding and global layers).

The tokenizer is the tiny one of ``tiny_models.py`` with ``<image>`` (Gemma 3: its three image tokens) added as
special tokens; the image processor is the tower's own (Pillow) one at the tower's 32-pixel resolution, so a LLaVA
image is 16 patches of 8 × 8, and a Gemma 3 image 64 patches of 4 × 4 pooled 2 × 2 into 16 rows.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, Gemma3Config, Gemma3ForConditionalGeneration,
                          Gemma3ImageProcessorPil, Gemma3TextConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                          PreTrainedTokenizerFast, SiglipImageProcessorPil, SiglipVisionConfig)

from tests.tiny_models import TINY_COMMON, train_tiny_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 344  # the tiny tokenizer's first added token (it learns 344 of its 512)
IMAGE_SIZE = 32
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=8)


def tiny_llava_config(tower: str) -> LlavaConfig:
    """CLIP: the second-to-last layer's patches without the class token ("default"); SigLIP (no class token): all
    positions of the last layer ("full") — the two ways LLaVA checkpoints read their towers."""
    text = LlamaConfig(**TINY_COMMON)
    if tower == "clip":
        vision = CLIPVisionConfig(**TOWER, projection_dim=32)
        return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, vision_feature_layer=-2,
                           vision_feature_select_strategy="default")
    if tower == "siglip":
        vision = SiglipVisionConfig(**TOWER)
        return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, vision_feature_layer=-1,
                           vision_feature_select_strategy="full")
    raise ValueError(f"no tiny LLaVA with a {tower!r} tower")


def write_tiny_llava(directory: Path, tower: str = "clip", seed: int = 0) -> LlavaForConditionalGeneration:
    """Save a tiny random LLaVA (safetensors), its tokenizer and its image processor into ``directory``."""
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(tiny_llava_config(tower)).eval()
    with torch.no_grad():  # HF starts norms and biases at 1 and 0: perturb them so a misread one shows
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
    model.save_pretrained(directory)
    train_tiny_tokenizer(directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tokenizer.save_pretrained(directory)
    if tower == "clip":
        processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    else:
        processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(directory)
    return model


GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")  # ids 344, 345, 346
GEMMA3_START, GEMMA3_END, GEMMA3_IMAGE = 344, 345, 346
GEMMA3_SLIDING_WINDOW = 6  # shorter than an image's 16 rows: a window cuts through an image's both-ways attention


def tiny_gemma3_config() -> Gemma3Config:
    text = Gemma3TextConfig(**TINY_COMMON, head_dim=16, sliding_window=GEMMA3_SLIDING_WINDOW, query_pre_attn_scalar=24,
                            layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(**{**TOWER, "patch_size": 4})
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16, boi_token_index=GEMMA3_START,
                        eoi_token_index=GEMMA3_END, image_token_index=GEMMA3_IMAGE)


def write_tiny_gemma3(directory: Path, seed: int = 0) -> Gemma3ForConditionalGeneration:
    """Save a tiny random Gemma 3 vision-language model (safetensors), its tokenizer and image processor into ``directory``."""
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(tiny_gemma3_config()).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
        # HF starts the projection at zero: every image would look alike
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    train_tiny_tokenizer(directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS)})
    assert tokenizer.convert_tokens_to_ids(list(GEMMA3_TOKENS)) == [GEMMA3_START, GEMMA3_END, GEMMA3_IMAGE]
    tokenizer.save_pretrained(directory)
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(directory)
    return model


def random_image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """An RGB image of random pixels, ``size`` = (width, height)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    """``image`` as a PNG file's bytes."""
    data = io.BytesIO()
    image.save(data, format="PNG")
    return data.getvalue()
