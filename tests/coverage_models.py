"""Every architecture the match stage covers, as tiny random checkpoints: arch → HF model factory."""

from tests.patterns.tiny_family_configs_attention import TINY_CONFIGS as DENSE_CONFIGS
from tests.patterns.tiny_family_configs_attention import tiny_family_model
from tests.patterns.tiny_family_configs_moe import TINY_CONFIGS as MOE_CONFIGS
from tests.patterns.tiny_family_configs_moe import tiny_moe_model

# Served correctly but not (yet) canonical, and listed as unmatched: GPT-OSS's experts (biases,
# interleaved clamped SwiGLU) are outside the moe op's contract; Cohere's hand-written LayerNorm has no pattern.
KNOWN_UNMATCHED = {"gpt_oss": "moe", "cohere": "norm"}


def coverage_architectures() -> list[str]:
    return sorted(set(DENSE_CONFIGS) | set(MOE_CONFIGS))


def eager_reference_model(arch: str):
    """The HF model with eager attention: the reference the issue holds the pipeline to."""
    if arch in MOE_CONFIGS:
        model = tiny_moe_model(arch)
        model.set_attn_implementation("eager")
        return model
    return tiny_family_model(arch, attn_implementation="eager")
