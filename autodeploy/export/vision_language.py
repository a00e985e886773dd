"""The two functions a vision-language checkpoint is exported as (``models/vision_language.py`` says which).

``VisionFeatures`` — the ``"vision"`` graph: preprocessed images ``[images, 3, H, W]`` in, the projected
feature rows ``[images, tokens, hidden]`` out (the tower's chosen hidden states, the class token dropped
under the ``"default"`` strategy, or its output, through the projector) — what Hugging Face's ``get_image_features`` computes,
without the list it returns (a list would fix the image count at export).

``VisionLanguageLogits`` — the ``"model"`` graph: token ids and positions, plus the side input
``image_features`` ``[N, hidden]`` and ``image_features_token_index`` ``[N]`` (which of the step's tokens each
row replaces, ``runtime/step_inputs.py``), in; logits out. The rows overwrite the embeddings of the image
placeholder tokens, as Hugging Face's ``masked_scatter`` does, before the language model runs.

Both hold the whole Hugging Face model as ``model``, so every parameter keeps its Hugging Face path under
``GRAPH_PREFIX`` and one checkpoint fills both graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from autodeploy.export.causal_lm import CAUSAL_LM_INPUTS
from autodeploy.models.vision_language import VisionLanguageSpec
from autodeploy.runtime.vision_encoder import IMAGE_FEATURES

IMAGE_FEATURES_TOKEN_INDEX = IMAGE_FEATURES + "_token_index"  # step_inputs.TOKEN_INDEX_SUFFIX's convention
VISION_LANGUAGE_INPUTS: tuple[str, ...] = (*CAUSAL_LM_INPUTS, IMAGE_FEATURES, IMAGE_FEATURES_TOKEN_INDEX)
VISION_INPUTS: tuple[str, ...] = ("pixel_values",)


class VisionFeatures(nn.Module):
    """The exported vision function (see the module docstring)."""

    def __init__(self, model: nn.Module, spec: VisionLanguageSpec):
        super().__init__()
        self.model = model
        self.feature_layers = spec.feature_layers
        self.keep_class_token = spec.keep_class_token

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        if not self.feature_layers:  # the tower's output, after its post-norm (Gemma 3)
            return inner.multi_modal_projector(inner.vision_tower(pixel_values).last_hidden_state)
        hidden_states = inner.vision_tower(pixel_values, output_hidden_states=True).hidden_states
        selected = [hidden_states[layer] if self.keep_class_token else hidden_states[layer][:, 1:] for layer in self.feature_layers]
        return inner.multi_modal_projector(torch.cat(selected, dim=-1))


class VisionLanguageLogits(nn.Module):
    """The exported language-model function of a vision-language checkpoint (see the module docstring)."""

    def __init__(self, model: nn.Module, image_token_id: int):
        super().__init__()
        self.model = model
        # A placeholder outside the vocabulary (a reduced twin's, say) is embedded as token 0, as Hugging Face does:
        # its row overwrites the embedding anyway.
        embeddings = model.get_input_embeddings().num_embeddings
        self.outside_vocabulary = image_token_id if image_token_id >= embeddings else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, image_features: torch.Tensor,
                image_features_token_index: torch.Tensor) -> torch.Tensor:
        if self.outside_vocabulary is not None:
            input_ids = input_ids.masked_fill(input_ids == self.outside_vocabulary, 0)
        embeds = self.model.get_input_embeddings()(input_ids)
        rows = torch.zeros_like(image_features_token_index)  # the runtime's graph takes every token in row 0
        embeds = embeds.index_put((rows, image_features_token_index), image_features.to(embeds.dtype))
        return self.model(inputs_embeds=embeds, position_ids=position_ids, use_cache=False).logits
