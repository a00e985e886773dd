"""Canonical ops: ``torch.ops.autodeploy.<name>``, each with a torch reference, a fake and candidate backends.

Importing this package registers every built-in op (one module each) and its backends;
:func:`canonical_ops` lists them, :func:`register_op` adds an op of your own and
:func:`register_backend` a kernel for any op (see ``registry.py``).
"""

from . import (  # noqa: F401  (registers the ops and their backends)
    add_rms_norm,
    attention,
    attention_varlen,
    bidirectional_attention,
    cached_attention,
    cached_attention_rope,
    cached_attention_sdpa,
    cached_cross_attention,
    collectives,
    cutlass_backends,
    fp8_activations,
    fused_gated_mlp,
    gated_activation,
    gated_mlp,
    hidden_states,
    layer_norm,
    linear,
    mlp,
    moe,
    moe_expert_parallel,
    pipeline_ops,
    quantization,
    quantized_embedding,
    quantized_linear,
    quantized_moe,
    relative_position_bias,
    rms_norm,
    rope,
    triton_backends,
)
from . import batch_invariant  # noqa: F401,E402  (opt-in backends, listed after every other)
from .registry import (
    REFERENCE,
    Backend,
    CanonicalOp,
    OpRegistrationError,
    candidates,
    canonical_ops,
    op_by_target,
    register_backend,
    register_op,
    register_tuning_input,
)

__all__ = [
    "REFERENCE",
    "Backend",
    "CanonicalOp",
    "OpRegistrationError",
    "candidates",
    "canonical_ops",
    "op_by_target",
    "register_backend",
    "register_op",
    "register_tuning_input",
]
